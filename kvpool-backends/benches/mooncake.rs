//! Mooncake Store: 1 MiB put/get through kvpool, to compare with the same operations driven
//! directly from Mooncake's Python client (`benches/mooncake_direct.py`) in the same run.
//! `cargo xtask bench-mooncake` starts a master and a segment holder, runs both and prints the
//! ratios.
//!
//! - `connector`: [`MooncakeConnector`] put (an upsert, as the Python `upsert_from`) and get of
//!   raw bytes: the client path kvpool adds (staging copy, blocking-pool hop, embedded Python).
//! - `backend`: the same through [`RemoteBackend`], which adds the chunk format (header and
//!   xxh3 checksum on every value) and decodes into L1 memory, as a built pool does.
//!
//! Reads KVPOOL_BENCH_MOONCAKE_MASTER (host:port) and KVPOOL_BENCH_MOONCAKE_SITE (the
//! site-packages holding the wheel); skipped with a message when they are not set.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvpool_backends::mooncake::{
    MooncakeConfig, MooncakeConnector, MooncakeStoreClient, RawBuffer,
};
use kvpool_core::{
    CacheKey, Chunk, ChunkCodec, ChunkHash, ChunkMeta, Dtype, KeyScope, MemoryObj, MemoryPool,
    RemoteBackend, RemoteConnector, StorageBackend,
};

const MIB: usize = 1 << 20;

fn bench(c: &mut Criterion) {
    let (Ok(master), Ok(site)) = (
        std::env::var("KVPOOL_BENCH_MOONCAKE_MASTER"),
        std::env::var("KVPOOL_BENCH_MOONCAKE_SITE"),
    ) else {
        eprintln!(
            "SKIP mooncake benches: set KVPOOL_BENCH_MOONCAKE_MASTER and \
             KVPOOL_BENCH_MOONCAKE_SITE, or run `cargo xtask bench-mooncake`"
        );
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let config = MooncakeConfig {
        master_server_address: master,
        python_path: vec![site.into()],
        ..MooncakeConfig::default()
    };
    let connector = rt.block_on(MooncakeConnector::connect(&config)).unwrap();
    let value = Bytes::from((0..MIB).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>());

    // The client alone, called on this thread: what embedding Python costs by itself.
    let client = kvpool_backends::mooncake::python::PythonStoreClient::setup(&config).unwrap();
    let mut raw = vec![0u8; 2 * MIB];
    raw[..MIB].copy_from_slice(&value);
    let (src, dst) = (
        RawBuffer {
            ptr: raw.as_mut_ptr(),
            len: MIB,
        },
        RawBuffer {
            ptr: raw[MIB..].as_mut_ptr(),
            len: MIB,
        },
    );
    // SAFETY: `raw` outlives every use of the client below.
    unsafe {
        assert_eq!(
            client.register_buffer(RawBuffer {
                ptr: raw.as_mut_ptr(),
                len: 2 * MIB
            }),
            Ok(0)
        );
    }

    let mut g = c.benchmark_group("mooncake_1MiB");
    g.sample_size(30)
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Bytes(MIB as u64));
    let key = ["kvpool-client-1mib".to_string()];
    g.bench_function("client_put", |b| {
        b.iter(|| {
            // SAFETY: `src` points into `raw`, registered above, which outlives the benchmark.
            let stored = unsafe { client.batch_upsert_from(&key, &[src]) };
            assert_eq!(stored, Ok(vec![0]))
        })
    });
    g.bench_function("client_get", |b| {
        b.iter(|| {
            // SAFETY: `dst` points into `raw` (registered, outlives the benchmark), apart from `src`;
            // nothing else reads or writes it while the call fills it.
            let read = unsafe { client.batch_get_into(&key, &[dst]) };
            assert_eq!(read, Ok(vec![MIB as i64]))
        })
    });
    g.bench_function("connector_put", |b| {
        b.iter(|| {
            rt.block_on(connector.put("kvpool-1mib", value.clone()))
                .unwrap()
        })
    });
    g.bench_function("connector_get", |b| {
        b.iter(|| {
            let got = rt.block_on(connector.get("kvpool-1mib")).unwrap().unwrap();
            assert_eq!(got.len(), MIB);
            black_box(got)
        })
    });

    // As in a built pool: loaded chunks are decoded into L1 memory (here a pool of its own).
    let l1 = Arc::new(MemoryPool::new(64 << 20).unwrap());
    let backend =
        RemoteBackend::new(connector.clone(), ChunkCodec::default(), 64 << 20).with_allocator(l1);
    let scope = Arc::new(KeyScope::new("bench", 1, 0, 0, 0x5eed).unwrap());
    let key = CacheKey::new(scope, ChunkHash(42u128.to_be_bytes()));
    let chunk = Chunk {
        meta: ChunkMeta {
            layout_fingerprint: 0x5eed,
            dtype: Dtype::Bf16,
            token_count: 256,
        },
        data: MemoryObj::from_vec(value.to_vec()),
    };
    g.bench_function("backend_put", |b| {
        b.iter(|| {
            rt.block_on(backend.put(vec![(key.clone(), chunk.clone())]))
                .unwrap()
        })
    });
    g.bench_function("backend_get", |b| {
        b.iter(|| {
            let got = rt
                .block_on(backend.get(std::slice::from_ref(&key)))
                .unwrap();
            assert_eq!(got[0].as_ref().unwrap().data.len(), MIB);
            black_box(got)
        })
    });
    g.finish();
    rt.block_on(connector.close()).unwrap();
}

criterion_group!(benches, bench);
criterion_main!(benches);
