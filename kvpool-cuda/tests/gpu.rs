//! The GPU transfer engine against the host transfer (the oracle), byte for byte, on random
//! data and random slot mappings (non-contiguous, partial blocks), for the flash-attention,
//! FlashInfer and MLA orders, whole and per layer, staged and mapped, plus layer-wise loads and
//! pinned memory. Skips with a message where no CUDA device is present (CI); run on a GPU
//! machine (see docs/benchmarks.md for how the binaries are carried there).

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use kvpool_backends::build_pool_with_allocator;
use kvpool_core::{
    ByteSize, Dtype, HostPagedKvCache, KvKind, KvTransfer, LayerwiseTransfer, MemoryObj,
    MemoryPool, OwnedChunkWindow, PoolConfig,
};
use kvpool_cuda::driver::{device_count, open_context};
use kvpool_cuda::{
    CudaError, DeviceLayer, GpuTransferEngine, HostPath, PagedOrder, PinnedAllocator,
    RegisteredKvCaches,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{layer_in_order, layouts, random_cache, random_slots, shape};

fn gpu() -> Option<Arc<CudaContext>> {
    match device_count() {
        Ok(n) if n > 0 => Some(open_context(0).unwrap()),
        other => {
            println!("SKIP: no CUDA device ({other:?}); these tests run on a GPU machine");
            None
        }
    }
}

/// Device memory holding a copy of `bytes`, freed on drop.
struct DeviceTensor {
    ptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceTensor {
    fn upload(ctx: &Arc<CudaContext>, bytes: &[u8]) -> Self {
        ctx.bind_to_thread().unwrap();
        let mut ptr = 0;
        // SAFETY: the context is bound; the copy reads `bytes.len()` bytes from `bytes` into
        // the allocation of that size just made.
        unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes.len()).result().unwrap();
            sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), bytes.len())
                .result()
                .unwrap();
        }
        DeviceTensor {
            ptr,
            len: bytes.len(),
            ctx: ctx.clone(),
        }
    }

    fn download(&self) -> Vec<u8> {
        self.ctx.bind_to_thread().unwrap();
        let mut out = vec![0u8; self.len];
        // SAFETY: the context is bound; `self.ptr` holds `self.len` bytes (allocated in
        // `upload`), and `out` has room for exactly that many.
        unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr, self.len)
                .result()
                .unwrap();
        }
        out
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `self.ptr` came from cuMemAlloc in `upload` and is freed only here, once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Device tensors in `order` holding `host`'s bytes, and an engine over them.
fn device_copy(
    ctx: &Arc<CudaContext>,
    host: &HostPagedKvCache,
    order: PagedOrder,
    blocks: usize,
    path: HostPath,
) -> (Vec<DeviceTensor>, GpuTransferEngine) {
    let layout = *host.layout();
    let tensors: Vec<DeviceTensor> = (0..layout.num_layers)
        .map(|l| DeviceTensor::upload(ctx, &layer_in_order(host, l, order, blocks)))
        .collect();
    let layers: Vec<DeviceLayer> = tensors
        .iter()
        .map(|t| DeviceLayer {
            ptr: t.ptr,
            shape: shape(order, &layout, blocks),
            dtype: layout.dtype,
        })
        .collect();
    let caches = RegisteredKvCaches::new(layout, order, &layers).unwrap();
    (tensors, GpuTransferEngine::new(0, caches, path).unwrap())
}

#[test]
fn gather_matches_the_host_oracle_byte_for_byte() {
    let Some(ctx) = gpu() else { return };
    let pinned = MemoryPool::with_allocator(64 << 20, &PinnedAllocator::new(0).unwrap()).unwrap();
    let mut rng = SmallRng::seed_from_u64(1);
    for (layout, order) in layouts() {
        for path in [HostPath::Staged, HostPath::Mapped] {
            let blocks = 37;
            let host = random_cache(layout, blocks, &mut rng);
            let (_tensors, engine) = device_copy(&ctx, &host, order, blocks, path);
            for n in [1usize, 5, 16, 100, 256] {
                let slots = random_slots(n, blocks * 16, &mut rng);
                let mut want = vec![0u8; layout.chunk_bytes(n)];
                host.gather(&slots, &mut want).unwrap();
                // With HostPath::Mapped the kernel writes straight into pinned host memory.
                let mut got = pinned.allocate(layout.chunk_bytes(n)).unwrap();
                got.as_mut_slice().fill(0xAA);
                engine.gather(&slots, got.as_mut_slice()).unwrap();
                assert!(
                    got.as_slice() == want,
                    "{order:?} {path:?} n={n}: whole gather differs"
                );
                let mut by_layer = vec![0x55u8; layout.chunk_bytes(n)];
                for l in 0..layout.num_layers {
                    engine.gather_layer(l, &slots, &mut by_layer).unwrap();
                }
                assert!(
                    by_layer == want,
                    "{order:?} {path:?} n={n}: per-layer gather differs"
                );
            }
        }
    }
}

#[test]
fn scatter_matches_the_host_oracle_and_touches_nothing_else() {
    let Some(ctx) = gpu() else { return };
    let pinned = MemoryPool::with_allocator(64 << 20, &PinnedAllocator::new(0).unwrap()).unwrap();
    let mut rng = SmallRng::seed_from_u64(2);
    for (layout, order) in layouts() {
        for path in [HostPath::Staged, HostPath::Mapped] {
            let blocks = 29;
            let mut host = random_cache(layout, blocks, &mut rng);
            let (tensors, mut engine) = device_copy(&ctx, &host, order, blocks, path);
            let chunk_tokens = 64;
            // With HostPath::Mapped the kernel reads straight from pinned host memory.
            let mut chunk = pinned.allocate(layout.chunk_bytes(chunk_tokens)).unwrap();
            rng.fill(chunk.as_mut_slice());
            let chunk = chunk.freeze();
            let chunk = chunk.as_slice();
            // A partial window of the chunk, as when the GPU already holds its first tokens.
            let (offset, count) = (13, 40);
            let slots = random_slots(count, blocks * 16, &mut rng);
            host.scatter(chunk, chunk_tokens, offset, &slots).unwrap();
            engine.scatter(chunk, chunk_tokens, offset, &slots).unwrap();
            // Then one layer only, elsewhere.
            let slots2 = random_slots(9, blocks * 16, &mut rng);
            host.scatter_layer(1, chunk, chunk_tokens, 0, &slots2)
                .unwrap();
            engine
                .scatter_layer(1, chunk, chunk_tokens, 0, &slots2)
                .unwrap();
            for (l, tensor) in tensors.iter().enumerate() {
                assert!(
                    tensor.download() == layer_in_order(&host, l, order, blocks),
                    "{order:?} {path:?}: layer {l} differs from the host after scatter"
                );
            }
        }
    }
}

#[test]
fn bad_slots_are_errors_and_write_nothing() {
    let Some(ctx) = gpu() else { return };
    let mut rng = SmallRng::seed_from_u64(3);
    let (layout, order) = layouts()[0];
    let host = random_cache(layout, 4, &mut rng);
    let (tensors, mut engine) = device_copy(&ctx, &host, order, 4, HostPath::Staged);
    let chunk = vec![1u8; layout.chunk_bytes(2)];
    assert!(
        engine.scatter(&chunk, 2, 0, &[3, -1]).is_err(),
        "padding slot"
    );
    assert!(
        engine.scatter(&chunk, 2, 0, &[3, 64]).is_err(),
        "beyond the cache"
    );
    let mut out = vec![0u8; layout.chunk_bytes(2)];
    assert!(engine.gather(&[0, 64], &mut out).is_err());
    for (l, t) in tensors.iter().enumerate() {
        assert!(t.download() == layer_in_order(&host, l, order, 4));
    }
}

#[test]
fn kv_caches_that_are_not_memory_of_this_device_are_rejected() {
    let Some(ctx) = gpu() else { return };
    let (layout, order) = layouts()[0];
    let blocks = 4;
    let layer_bytes = layout.chunk_bytes(blocks * 16) / layout.num_layers;
    let device = DeviceTensor::upload(&ctx, &vec![7u8; layer_bytes]);
    let pinned = MemoryPool::with_allocator(16 << 20, &PinnedAllocator::new(0).unwrap()).unwrap();
    let mut host = pinned.allocate(layer_bytes).unwrap();
    let host_ptr = host.as_mut_slice().as_mut_ptr() as u64;
    let register = |ptrs: [u64; 3]| {
        let layers: Vec<DeviceLayer> = ptrs
            .iter()
            .map(|&ptr| DeviceLayer {
                ptr,
                shape: shape(order, &layout, blocks),
                dtype: layout.dtype,
            })
            .collect();
        let caches = RegisteredKvCaches::new(layout, order, &layers).unwrap();
        GpuTransferEngine::new(0, caches, HostPath::Staged)
    };
    register([device.ptr; 3]).expect("device memory of the right size is accepted");
    let cases = [
        (
            [device.ptr, host_ptr, device.ptr],
            "layer 1",
            "not device memory",
        ),
        (
            [device.ptr, device.ptr, 0x10000],
            "layer 2",
            "not memory the CUDA driver knows",
        ),
    ];
    for (ptrs, layer, why) in cases {
        match register(ptrs) {
            Err(CudaError::Registration(m)) => {
                assert!(m.contains(layer) && m.contains(why), "{m}")
            }
            other => panic!("{ptrs:x?} accepted or wrong error: {:?}", other.err()),
        }
    }
}

#[test]
fn layerwise_loads_equal_a_whole_scatter_and_signal_every_layer() {
    let Some(ctx) = gpu() else { return };
    let mut rng = SmallRng::seed_from_u64(4);
    let (layout, order) = layouts()[1];
    let blocks = 40;
    let mut host = random_cache(layout, blocks, &mut rng);
    let (tensors, engine) = device_copy(&ctx, &host, order, blocks, HostPath::Staged);
    let pool = MemoryPool::with_allocator(64 << 20, &PinnedAllocator::new(0).unwrap()).unwrap();
    assert!(pool.is_pinned());
    let mut chunks = Vec::new();
    for _ in 0..3 {
        let mut buf = pool.allocate(layout.chunk_bytes(32)).unwrap();
        rng.fill(buf.as_mut_slice());
        chunks.push(buf.freeze());
    }
    let mut all = random_slots(32 * 3, blocks * 16, &mut rng).into_iter();
    let slots: Vec<Vec<i64>> = (0..3)
        .map(|i| all.by_ref().take(if i == 2 { 20 } else { 32 }).collect())
        .collect();
    let loads: Vec<OwnedChunkWindow<MemoryObj>> = chunks
        .iter()
        .zip(&slots)
        .enumerate()
        .map(|(i, (c, s))| OwnedChunkWindow {
            data: c.clone(),
            chunk_tokens: 32,
            token_offset: if i == 2 { 12 } else { 0 },
            slots: s.clone(),
        })
        .collect();
    for load in &loads {
        host.scatter(load.data.as_slice(), 32, load.token_offset, &load.slots)
            .unwrap();
    }
    let compute = ctx.new_stream().unwrap();
    let inflight = engine.retrieve_layerwise(loads).unwrap();
    for layer in 0..layout.num_layers {
        inflight.wait_layer(layer, &compute).unwrap();
    }
    compute.synchronize().unwrap();
    assert!(inflight.layer_event(layout.num_layers - 1).is_complete());
    drop(inflight);
    for (l, tensor) in tensors.iter().enumerate() {
        assert!(
            tensor.download() == layer_in_order(&host, l, order, blocks),
            "layer {l}"
        );
    }
}

#[test]
fn transfers_work_from_threads_that_never_touched_cuda() {
    let Some(ctx) = gpu() else { return };
    let mut rng = SmallRng::seed_from_u64(5);
    let (layout, order) = layouts()[0];
    let blocks = 20;
    let host = random_cache(layout, blocks, &mut rng);
    for path in [HostPath::Staged, HostPath::Mapped] {
        let (_tensors, engine) = device_copy(&ctx, &host, order, blocks, path);
        let slot_sets: Vec<Vec<i64>> = (0..4)
            .map(|_| random_slots(33, blocks * 16, &mut rng))
            .collect();
        // Each thread starts with no current CUDA context, as a tokio worker would.
        std::thread::scope(|scope| {
            for slots in &slot_sets {
                let (engine, host) = (&engine, &host);
                scope.spawn(move || {
                    let mut want = vec![0u8; layout.chunk_bytes(slots.len())];
                    host.gather(slots, &mut want).unwrap();
                    let mut got = vec![0xAAu8; want.len()];
                    engine.gather(slots, &mut got).unwrap();
                    assert!(got == want, "{path:?}: gather from another thread differs");
                });
            }
        });
    }
}

#[test]
fn successive_layerwise_loads_reuse_buffers_without_stale_bytes() {
    let Some(ctx) = gpu() else { return };
    let mut rng = SmallRng::seed_from_u64(6);
    let (layout, order) = layouts()[0];
    let blocks = 64;
    let mut host = random_cache(layout, blocks, &mut rng);
    let (tensors, engine) = device_copy(&ctx, &host, order, blocks, HostPath::Staged);
    // The engine's compute stream belongs to another library: wrap it without owning it.
    let mut raw = std::ptr::null_mut();
    // SAFETY: the engine's context is bound on this thread; `raw` receives the new stream.
    unsafe {
        sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            .result()
            .unwrap()
    };
    // SAFETY: `raw` is a live stream of the engine's context, destroyed only at the end of
    // this test, after `compute` (the borrowed wrapper) is dropped.
    let compute = unsafe { engine.context().wrap_borrowed_stream(raw) };
    // Large, then smaller (a reused, larger buffer), then large again; each from another
    // thread than the last, so the context is bound wherever the call lands.
    for (round, (chunks, tokens)) in [(4usize, 48usize), (1, 16), (3, 48)]
        .into_iter()
        .enumerate()
    {
        let data: Vec<Vec<u8>> = (0..chunks)
            .map(|_| {
                let mut d = vec![0u8; layout.chunk_bytes(tokens)];
                rng.fill(d.as_mut_slice());
                d
            })
            .collect();
        let mut all = random_slots(chunks * tokens, blocks * 16, &mut rng).into_iter();
        let slots: Vec<Vec<i64>> = (0..chunks)
            .map(|_| all.by_ref().take(tokens).collect())
            .collect();
        let loads: Vec<OwnedChunkWindow> = data
            .iter()
            .zip(&slots)
            .map(|(d, s)| OwnedChunkWindow {
                data: d.clone(),
                chunk_tokens: tokens,
                token_offset: 0,
                slots: s.clone(),
            })
            .collect();
        for load in &loads {
            host.scatter(&load.data, tokens, 0, &load.slots).unwrap();
        }
        if round == 2 {
            // Freed between loads: the next one allocates afresh.
            engine.release_cached_buffers();
        }
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let inflight = engine.retrieve_layerwise(loads).unwrap();
                for layer in 0..layout.num_layers {
                    inflight.wait_layer(layer, &compute).unwrap();
                }
                compute.synchronize().unwrap();
            });
        });
        for (l, tensor) in tensors.iter().enumerate() {
            assert!(
                tensor.download() == layer_in_order(&host, l, order, blocks),
                "round {round}: layer {l}"
            );
        }
    }
    drop(compute);
    // SAFETY: the stream created above; its borrowed wrapper is gone and nothing else uses it.
    unsafe { sys::cuStreamDestroy_v2(raw).result().unwrap() };
}

/// The cache engine over a pool whose L1 is pinned memory, storing from and loading into GPU
/// caches: whole retrieves through `KvTransfer`, and layer-wise ones by handing the plan's
/// windows to `retrieve_layerwise`. The host cache, moved the same way, is the oracle.
#[test]
fn the_cache_engine_stores_and_loads_through_the_gpu_with_a_pinned_pool() {
    let Some(ctx) = gpu() else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let chunk = 32;
    let mut config = PoolConfig {
        layout: kvpool_core::KvLayout {
            num_layers: 3,
            num_kv_heads: 8,
            head_size: 128,
            dtype: Dtype::Bf16,
            kind: KvKind::KeyValue,
            block_size: 16,
        },
        ..PoolConfig::default()
    };
    config.chunking.chunk_size = chunk;
    config.local_cpu.max_size = ByteSize::mib(64);
    let pinned = PinnedAllocator::new(0).unwrap();
    let pool = runtime
        .block_on(build_pool_with_allocator(&config, &pinned))
        .unwrap();
    let layout = *pool.engine.layout();
    let blocks = 48;
    let mut rng = SmallRng::seed_from_u64(7);
    let mut host = random_cache(layout, blocks, &mut rng);
    let n = 3 * chunk;
    for (round, path) in [HostPath::Staged, HostPath::Mapped].into_iter().enumerate() {
        let (tensors, mut engine) =
            device_copy(&ctx, &host, PagedOrder::FlashAttention, blocks, path);
        let tokens: Vec<u32> = (0..n as u32)
            .map(|t| t * 7 + round as u32 * 100_000)
            .collect();
        let mut all = random_slots(3 * n, blocks * 16, &mut rng).into_iter();
        let mut take = || -> Vec<i64> { all.by_ref().take(n).collect() };
        let (src, whole_dst, layerwise_dst) = (take(), take(), take());
        let copy_on_host = |host: &mut HostPagedKvCache, from: &[i64], to: &[i64], skip: usize| {
            let mut buf = vec![0u8; layout.chunk_bytes(from.len())];
            host.gather(from, &mut buf).unwrap();
            host.scatter(&buf, from.len(), skip, &to[skip..]).unwrap();
        };

        let stored = runtime
            .block_on(pool.engine.store(&tokens, None, &engine, &src))
            .unwrap();
        assert_eq!(stored.stored_tokens, n, "{path:?}");

        let loaded = runtime
            .block_on(pool.engine.retrieve(&tokens, None, &mut engine, &whole_dst))
            .unwrap();
        assert!(loaded.iter().all(|&l| l), "{path:?}: whole retrieve hit");
        copy_on_host(&mut host, &src, &whole_dst, 0);

        // The engine already holds the first 5 tokens; load the rest layer by layer.
        let skip = 5;
        let mask: Vec<bool> = (0..n).map(|i| i >= skip).collect();
        let plan = runtime
            .block_on(
                pool.engine
                    .begin_retrieve_layerwise(&tokens, Some(&mask), &layerwise_dst),
            )
            .unwrap();
        assert_eq!(plan.loaded_mask(), mask.as_slice());
        let compute = ctx.new_stream().unwrap();
        let load = engine.retrieve_layerwise(plan).unwrap();
        for layer in 0..layout.num_layers {
            load.wait_layer(layer, &compute).unwrap();
        }
        compute.synchronize().unwrap();
        drop(load);
        copy_on_host(&mut host, &src, &layerwise_dst, skip);

        for (l, tensor) in tensors.iter().enumerate() {
            assert!(
                tensor.download() == layer_in_order(&host, l, PagedOrder::FlashAttention, blocks),
                "{path:?}: layer {l} differs from the host oracle"
            );
        }
    }
}

#[test]
fn a_large_pinned_pool_is_registered() {
    let Some(_ctx) = gpu() else { return };
    // Larger than peers' single cudaHostAlloc tends to tolerate on shared hosts.
    let pool = MemoryPool::with_allocator(16 << 30, &PinnedAllocator::new(0).unwrap()).unwrap();
    assert!(pool.is_pinned());
    let mut a = pool.allocate(1 << 30).unwrap();
    a.as_mut_slice()[..4096].fill(9);
    assert_eq!(a.as_slice()[4095], 9);
}

/// kvpool-core's `LayerwiseTransfer` on the GPU, as the connector's worker drives it: a store
/// fenced after a write queued on the compute stream sees that write, and a submitted load
/// makes the compute stream wait per layer, landing the same bytes as the host oracle.
#[test]
fn the_layerwise_trait_fences_stores_and_loads_on_the_compute_stream() {
    let Some(ctx) = gpu() else { return };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut config = PoolConfig {
        layout: kvpool_core::KvLayout {
            num_layers: 4,
            num_kv_heads: 8,
            head_size: 128,
            dtype: Dtype::Bf16,
            kind: KvKind::KeyValue,
            block_size: 16,
        },
        ..PoolConfig::default()
    };
    config.chunking.chunk_size = 32;
    config.local_cpu.max_size = ByteSize::mib(64);
    let pinned = PinnedAllocator::new(0).unwrap();
    let pool = runtime
        .block_on(build_pool_with_allocator(&config, &pinned))
        .unwrap();
    let layout = *pool.engine.layout();
    let blocks = 64;
    let order = PagedOrder::FlashAttention;
    let mut rng = SmallRng::seed_from_u64(11);
    let mut host = random_cache(layout, blocks, &mut rng);
    let (tensors, mut engine) = device_copy(&ctx, &host, order, blocks, HostPath::Staged);
    let compute = ctx.new_stream().unwrap();
    engine.set_compute_stream(compute.clone());

    // The "forward pass" rewrites layer 0 on the compute stream; the store must see it.
    let newer = random_cache(layout, blocks, &mut rng);
    let fresh = DeviceTensor::upload(&ctx, &layer_in_order(&newer, 0, order, blocks));
    // SAFETY: both tensors hold `fresh.len` bytes (layer 0 in the same order) and live to the
    // end of this test, past the store below that waits for this stream.
    unsafe {
        sys::cuMemcpyDtoDAsync_v2(tensors[0].ptr, fresh.ptr, fresh.len, compute.cu_stream())
            .result()
            .unwrap();
    }
    host.layer_mut(0).copy_from_slice(newer.layer(0));
    LayerwiseTransfer::fence_before_store(&engine).unwrap();
    let n = 96;
    let mut all = random_slots(2 * n, blocks * 16, &mut rng).into_iter();
    let src: Vec<i64> = all.by_ref().take(n).collect();
    let dst: Vec<i64> = all.by_ref().take(n).collect();
    let mut stored = vec![0u8; layout.chunk_bytes(n)];
    engine.gather(&src, &mut stored).unwrap();
    let mut expected = vec![0u8; layout.chunk_bytes(n)];
    host.gather(&src, &mut expected).unwrap();
    assert!(
        stored == expected,
        "the store did not wait for the compute stream's write"
    );

    // Store through the cache engine, then load through the trait into other slots.
    let tokens: Vec<u32> = (0..n as u32).map(|t| t * 13 + 5).collect();
    let report = runtime
        .block_on(pool.engine.store(&tokens, None, &engine, &src))
        .unwrap();
    assert_eq!(report.stored_tokens, n);
    let plan = runtime
        .block_on(pool.engine.begin_retrieve_layerwise(&tokens, None, &dst))
        .unwrap();
    let load = LayerwiseTransfer::submit_load(&mut engine, plan).unwrap();
    assert_eq!(load.loaded_tokens(), n);
    for layer in 0..layout.num_layers {
        load.wait_layer(layer).unwrap();
    }
    compute.synchronize().unwrap();
    drop(load);
    host.scatter(&expected, n, 0, &dst).unwrap();
    for (l, tensor) in tensors.iter().enumerate() {
        assert!(
            tensor.download() == layer_in_order(&host, l, order, blocks),
            "layer {l} differs from the host oracle after a trait load"
        );
    }
}
