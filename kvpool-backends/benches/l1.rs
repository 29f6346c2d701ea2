//! L1 benchmarks: lookup of a 128K-token prompt fully in L1, and L1 put+get of 1/8/32 MiB
//! chunks side by side with a plain memcpy of the same bytes.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpool_backends::LocalCpuBackend;
use kvpool_backends::build_pool;
use kvpool_core::{
    ByteSize, CacheKey, Chunk, ChunkHash, ChunkMeta, Dtype, EvictionKind, HostPagedKvCache,
    KeyScope, KvKind, MemoryObj, PoolConfig, StorageBackend,
};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

/// `CacheEngine::lookup` of a 128K-token prompt whose chunks are all in L1 (hashing included),
/// for chunks of one vLLM block (16 tokens), two blocks, and the default 256 tokens: the
/// key-count cost of block-granular keys.
fn lookup_128k(c: &mut Criterion) {
    let rt = runtime();
    let n = 128 * 1024;
    let tokens: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761) % 128_000)
        .collect();
    let mut g = c.benchmark_group("lookup_128k_tokens_all_in_l1");
    for chunk_size in [16usize, 32, 256] {
        let mut config = PoolConfig {
            layout: kvpool_core::KvLayout {
                num_layers: 1,
                num_kv_heads: 1,
                head_size: 8,
                dtype: Dtype::F16,
                kind: KvKind::KeyValue,
                block_size: 16,
            },
            ..Default::default()
        };
        config.chunking.chunk_size = chunk_size;
        config.local_cpu.max_size = ByteSize::mib(64);
        let pool = rt.block_on(build_pool(&config)).unwrap();
        let engine = pool.engine.clone();
        let kv = HostPagedKvCache::new(*engine.layout(), n / 16);
        let slots: Vec<i64> = (0..n as i64).collect();
        rt.block_on(engine.store(&tokens, None, &kv, &slots))
            .unwrap();
        assert_eq!(rt.block_on(engine.lookup(&tokens)).unwrap(), n);
        g.bench_function(
            BenchmarkId::new(
                "chunk_tokens",
                format!("{chunk_size} ({} keys)", n / chunk_size),
            ),
            |b| b.iter(|| black_box(rt.block_on(engine.lookup(black_box(&tokens))).unwrap())),
        );
    }
    g.finish();
}

fn put_get_vs_memcpy(c: &mut Criterion) {
    let rt = runtime();
    let l1 = Arc::new(LocalCpuBackend::new(256 << 20, EvictionKind::Lru).unwrap());
    let key = CacheKey::new(
        Arc::new(KeyScope::new("bench", 1, 0, 0, 1).unwrap()),
        ChunkHash([1; 16]),
    );
    let mut g = c.benchmark_group("l1_put_get_vs_memcpy");
    g.sample_size(30);
    for mib in [1usize, 8, 32] {
        let len = mib << 20;
        let src: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        let chunk = Chunk {
            meta: ChunkMeta {
                layout_fingerprint: 1,
                dtype: Dtype::Bf16,
                token_count: 256,
            },
            data: MemoryObj::from_vec(src.clone()),
        };
        let mut dst = vec![0u8; len];
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(BenchmarkId::new("memcpy", format!("{mib}MiB")), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            })
        });
        g.bench_function(BenchmarkId::new("l1_put_get", format!("{mib}MiB")), |b| {
            b.iter(|| {
                rt.block_on(async {
                    l1.put(vec![(key.clone(), chunk.clone())]).await.unwrap();
                    let got = l1.get(std::slice::from_ref(&key)).await.unwrap();
                    black_box(got[0].as_ref().unwrap().data.as_slice()[len - 1]);
                    l1.remove(std::slice::from_ref(&key)).await.unwrap();
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, lookup_128k, put_get_vs_memcpy);
criterion_main!(benches);
