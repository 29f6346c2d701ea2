//! GPU transfer benchmarks, each side by side with its baseline in the same run (skipped with a
//! message where no CUDA device is present):
//! - gather + device-to-host of N 256-token chunks of an 8B-model layout (32 layers, 8 KV
//!   heads, head size 128, bf16, 128 KiB per token) vs one `cuMemcpyDtoHAsync` of the same
//!   bytes from a contiguous device buffer into pinned memory (target ≥ 0.8×), staged and mapped;
//! - host-to-device + scatter vs one `cuMemcpyHtoDAsync` (target ≥ 0.8×);
//! - a layer-wise retrieve overlapped with a synthetic per-layer compute kernel of about the
//!   same length as a layer's load: the share of transfer time hidden (target ≥ 70%).
//!
//! Criterion measures each operation; a summary with medians of 15 runs and the ratios is
//! printed at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys};
use cudarc::nvrtc::Ptx;
use kvpool_core::{
    Dtype, KvKind, KvLayout, KvTransfer, MemoryObj, MemoryObjMut, MemoryPool, OwnedChunkWindow,
};
use kvpool_cuda::driver::{device_count, open_context};
use kvpool_cuda::kernels::compile_cubin;
use kvpool_cuda::{
    DeviceLayer, GpuTransferEngine, HostPath, PagedOrder, PinnedAllocator, RegisteredKvCaches,
};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const CHUNK_TOKENS: usize = 256;
const CHUNKS: usize = 8;
const BLOCKS: usize = 1024;

const SPIN_SOURCE: &str = r#"
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}"#;

struct Setup {
    ctx: Arc<CudaContext>,
    layout: KvLayout,
    _tensors: Vec<u64>,
    contiguous: u64,
    host: Vec<MemoryObjMut>,
    /// The same chunk bytes, shared and read-only, for layer-wise loads (which own theirs).
    frozen: Vec<MemoryObj>,
    slots: Vec<Vec<i64>>,
    staged: GpuTransferEngine,
    mapped: GpuTransferEngine,
    spin: CudaFunction,
}

fn alloc(bytes: usize, rng: &mut SmallRng) -> u64 {
    let mut ptr = 0;
    let data: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
    // SAFETY: the context is current on this thread (set up by the caller); the copy reads
    // `bytes` bytes from `data`, which holds exactly that many, into the allocation just made.
    unsafe {
        sys::cuMemAlloc_v2(&mut ptr, bytes).result().unwrap();
        sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), bytes)
            .result()
            .unwrap();
    }
    ptr
}

fn setup() -> Option<Setup> {
    match device_count() {
        Ok(n) if n > 0 => {}
        other => {
            eprintln!("SKIP kvpool-cuda benches: no CUDA device ({other:?})");
            return None;
        }
    }
    let ctx = open_context(0).unwrap();
    let mut rng = SmallRng::seed_from_u64(7);
    let layout = KvLayout::new(32, 8, 128, Dtype::Bf16, KvKind::KeyValue, 16).unwrap();
    let layer_bytes = 2 * BLOCKS * 16 * layout.bytes_per_token_per_plane();
    let tensors: Vec<u64> = (0..layout.num_layers)
        .map(|_| alloc(layer_bytes, &mut rng))
        .collect();
    let layers: Vec<DeviceLayer> = tensors
        .iter()
        .map(|&ptr| DeviceLayer {
            ptr,
            shape: vec![2, BLOCKS, 16, 8, 128],
            dtype: Dtype::Bf16,
        })
        .collect();
    let caches = RegisteredKvCaches::new(layout, PagedOrder::FlashAttention, &layers).unwrap();
    let chunk_bytes = layout.chunk_bytes(CHUNK_TOKENS);
    let pool = MemoryPool::with_allocator(
        CHUNKS * chunk_bytes + (64 << 20),
        &PinnedAllocator::new(0).unwrap(),
    )
    .unwrap();
    let host: Vec<MemoryObjMut> = (0..CHUNKS)
        .map(|_| pool.allocate(chunk_bytes).unwrap())
        .collect();
    let frozen: Vec<MemoryObj> = (0..CHUNKS)
        .map(|_| {
            let mut m = pool.allocate(chunk_bytes).unwrap();
            rng.fill(m.as_mut_slice());
            m.freeze()
        })
        .collect();
    let mut all: Vec<i64> = (0..(BLOCKS * 16) as i64).collect();
    all.shuffle(&mut rng);
    let slots = (0..CHUNKS)
        .map(|i| all[i * CHUNK_TOKENS..(i + 1) * CHUNK_TOKENS].to_vec())
        .collect();
    // Machine code for this device, as the engine's own kernels are built.
    let (major, minor) = ctx.compute_capability().unwrap();
    let cubin = compile_cubin(SPIN_SOURCE, &format!("sm_{major}{minor}")).unwrap();
    let spin = ctx
        .load_module(Ptx::from_binary(cubin))
        .unwrap()
        .load_function("spin")
        .unwrap();
    Some(Setup {
        contiguous: alloc(CHUNKS * chunk_bytes, &mut rng),
        staged: GpuTransferEngine::new(0, caches.clone(), HostPath::Staged).unwrap(),
        mapped: GpuTransferEngine::new(0, caches, HostPath::Mapped).unwrap(),
        ctx,
        layout,
        _tensors: tensors,
        host,
        frozen,
        slots,
        spin,
    })
}

impl Setup {
    fn d2h_baseline(&mut self) {
        let stream = self.staged.stream();
        let chunk_bytes = self.layout.chunk_bytes(CHUNK_TOKENS);
        for (i, h) in self.host.iter_mut().enumerate() {
            // SAFETY: chunk `i` of `contiguous` (CHUNKS chunks long) into pinned host memory of
            // one chunk, which nothing else touches until the stream is synchronized below.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    h.as_mut_slice().as_mut_ptr().cast(),
                    self.contiguous + (i * chunk_bytes) as u64,
                    chunk_bytes,
                    stream.cu_stream(),
                )
                .result()
                .unwrap();
            }
        }
        stream.synchronize().unwrap();
    }

    fn h2d_baseline(&mut self) {
        let stream = self.staged.stream();
        let chunk_bytes = self.layout.chunk_bytes(CHUNK_TOKENS);
        for (i, h) in self.host.iter().enumerate() {
            // SAFETY: one chunk of pinned host memory, unchanged until the stream is
            // synchronized below, into chunk `i` of `contiguous` (CHUNKS chunks long).
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.contiguous + (i * chunk_bytes) as u64,
                    h.as_slice().as_ptr().cast(),
                    chunk_bytes,
                    stream.cu_stream(),
                )
                .result()
                .unwrap();
            }
        }
        stream.synchronize().unwrap();
    }

    fn gather(&mut self, mapped: bool) {
        let engine = if mapped { &self.mapped } else { &self.staged };
        for (h, s) in self.host.iter_mut().zip(&self.slots) {
            engine.gather(s, h.as_mut_slice()).unwrap();
        }
    }

    fn scatter(&mut self, mapped: bool) {
        let engine = if mapped {
            &mut self.mapped
        } else {
            &mut self.staged
        };
        for (h, s) in self.host.iter().zip(&self.slots) {
            engine.scatter(h.as_slice(), CHUNK_TOKENS, 0, s).unwrap();
        }
    }

    fn loads(&self) -> Vec<OwnedChunkWindow<MemoryObj>> {
        self.frozen
            .iter()
            .zip(&self.slots)
            .map(|(h, s)| OwnedChunkWindow {
                data: h.clone(),
                chunk_tokens: CHUNK_TOKENS,
                token_offset: 0,
                slots: s.clone(),
            })
            .collect()
    }

    fn compute_layers(
        &self,
        stream: &CudaStream,
        cycles: i64,
        waits: Option<&kvpool_cuda::LayerwiseLoad>,
    ) {
        for layer in 0..self.layout.num_layers {
            if let Some(load) = waits {
                load.wait_layer(layer, stream).unwrap();
            }
            let mut b = stream.launch_builder(&self.spin);
            b.arg(&cycles);
            // SAFETY: `spin` takes one `long long`, which is the one argument pushed; it
            // touches no memory.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .unwrap();
        }
    }
}

fn median(mut f: impl FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..15)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn bench(c: &mut Criterion) {
    let Some(mut s) = setup() else { return };
    let bytes = (CHUNKS * s.layout.chunk_bytes(CHUNK_TOKENS)) as u64;
    let mut g = c.benchmark_group("gpu_transfer_8x256_tokens_8b");
    g.throughput(Throughput::Bytes(bytes)).sample_size(20);
    g.bench_function("d2h_cuMemcpy_baseline", |b| b.iter(|| s.d2h_baseline()));
    g.bench_function("gather_staged_d2h", |b| b.iter(|| s.gather(false)));
    g.bench_function("gather_mapped", |b| b.iter(|| s.gather(true)));
    g.bench_function("h2d_cuMemcpy_baseline", |b| b.iter(|| s.h2d_baseline()));
    g.bench_function("h2d_staged_scatter", |b| b.iter(|| s.scatter(false)));
    g.bench_function("scatter_mapped", |b| b.iter(|| s.scatter(true)));
    g.finish();

    // Summary: medians of 15 runs, side by side.
    let d2h = median(|| s.d2h_baseline());
    let gather_staged = median(|| s.gather(false));
    let gather_mapped = median(|| s.gather(true));
    let h2d = median(|| s.h2d_baseline());
    let scatter_staged = median(|| s.scatter(false));
    let scatter_mapped = median(|| s.scatter(true));

    // Layer-wise: calibrate the spin kernel to about one layer's load time.
    let compute = s.ctx.new_stream().unwrap();
    let load_only = median(|| {
        let load = s.staged.retrieve_layerwise(s.loads()).unwrap();
        load.synchronize().unwrap();
    });
    let per_layer = load_only / s.layout.num_layers as u32;
    let probe_cycles = 1_000_000i64;
    let probe = median(|| {
        s.compute_layers(&compute, probe_cycles, None);
        compute.synchronize().unwrap();
    }) / s.layout.num_layers as u32;
    let cycles = (probe_cycles as f64 * per_layer.as_secs_f64() / probe.as_secs_f64()) as i64;
    let compute_only = median(|| {
        s.compute_layers(&compute, cycles, None);
        compute.synchronize().unwrap();
    });
    let sequential = median(|| {
        let load = s.staged.retrieve_layerwise(s.loads()).unwrap();
        load.synchronize().unwrap();
        s.compute_layers(&compute, cycles, None);
        compute.synchronize().unwrap();
    });
    let overlapped = median(|| {
        let load = s.staged.retrieve_layerwise(s.loads()).unwrap();
        s.compute_layers(&compute, cycles, Some(&load));
        compute.synchronize().unwrap();
    });
    let hidden = (sequential.as_secs_f64() - overlapped.as_secs_f64()) / load_only.as_secs_f64();

    let gibs = |d: Duration| bytes as f64 / d.as_secs_f64() / (1u64 << 30) as f64;
    let ratio = |base: Duration, ours: Duration| base.as_secs_f64() / ours.as_secs_f64();
    println!(
        "\n== kvpool-cuda, {} chunks x {CHUNK_TOKENS} tokens, 8B layout ({:.0} MiB), medians of 15 ==",
        CHUNKS,
        bytes as f64 / (1 << 20) as f64
    );
    println!(
        "d2h cuMemcpy baseline   {:>9.3} ms {:>7.1} GiB/s",
        d2h.as_secs_f64() * 1e3,
        gibs(d2h)
    );
    println!(
        "gather + staged DMA     {:>9.3} ms {:>7.1} GiB/s  {:.2}x baseline",
        gather_staged.as_secs_f64() * 1e3,
        gibs(gather_staged),
        ratio(d2h, gather_staged)
    );
    println!(
        "gather into mapped host {:>9.3} ms {:>7.1} GiB/s  {:.2}x baseline",
        gather_mapped.as_secs_f64() * 1e3,
        gibs(gather_mapped),
        ratio(d2h, gather_mapped)
    );
    println!(
        "h2d cuMemcpy baseline   {:>9.3} ms {:>7.1} GiB/s",
        h2d.as_secs_f64() * 1e3,
        gibs(h2d)
    );
    println!(
        "staged DMA + scatter    {:>9.3} ms {:>7.1} GiB/s  {:.2}x baseline",
        scatter_staged.as_secs_f64() * 1e3,
        gibs(scatter_staged),
        ratio(h2d, scatter_staged)
    );
    println!(
        "scatter from mapped     {:>9.3} ms {:>7.1} GiB/s  {:.2}x baseline",
        scatter_mapped.as_secs_f64() * 1e3,
        gibs(scatter_mapped),
        ratio(h2d, scatter_mapped)
    );
    println!(
        "layer-wise load only    {:>9.3} ms",
        load_only.as_secs_f64() * 1e3
    );
    println!(
        "compute only            {:>9.3} ms ({} layers x {cycles} cycles)",
        compute_only.as_secs_f64() * 1e3,
        s.layout.num_layers
    );
    println!(
        "load then compute       {:>9.3} ms",
        sequential.as_secs_f64() * 1e3
    );
    println!(
        "overlapped (per-layer events) {:>9.3} ms: {:.0}% of transfer time hidden",
        overlapped.as_secs_f64() * 1e3,
        hidden * 100.0
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
