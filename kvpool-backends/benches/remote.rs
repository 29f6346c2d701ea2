//! Remote tiers, side by side with their baselines in the same run:
//! - Redis SET/GET of 1 MiB values at concurrency 1 and 8 (compare with `redis-benchmark
//!   -d 1048576` against the same server; `cargo xtask bench-backends` runs both);
//! - RocksDB get of a hot 1 MiB chunk (flushed to an SST, served from the block cache) vs
//!   reading the same bytes from a plain file in the page cache; the get is measured as is
//!   (a pinned view) and with the bytes copied out, as the file read does;
//! - the same read cold: neither the block cache nor the page cache holds the value (both
//!   dropped before each read), against a plain file read after dropping its cached pages;
//! - S3 (moto) PUT/GET of 1 MiB at concurrency 1 and 8, and a 1-byte GET (per-request overhead).
//!
//! Servers come from KVPOOL_BENCH_REDIS_URL and KVPOOL_BENCH_S3_URL/KVPOOL_BENCH_S3_ENDPOINT;
//! a group whose server is not given is skipped with a message.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpool_backends::disk::{DiskConfig, DiskConnector};
use kvpool_backends::redis::{RedisConfig, RedisConnector};
use kvpool_backends::s3::{S3Config, S3Connector};
use kvpool_core::RemoteConnector;
use tokio::runtime::Runtime;

const MIB: usize = 1 << 20;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn value() -> Bytes {
    Bytes::from((0..MIB).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>())
}

/// Runs `op` `iters` times on each of `concurrency` tasks; returns the wall time.
fn concurrent<C, F, Fut>(
    rt: &Runtime,
    connector: &C,
    concurrency: usize,
    iters: u64,
    op: F,
) -> Duration
where
    C: RemoteConnector + Clone,
    F: Fn(C, usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    rt.block_on(async {
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..concurrency {
            let (c, op) = (connector.clone(), op.clone());
            tasks.spawn(async move {
                for _ in 0..iters {
                    op(c.clone(), t).await;
                }
            });
        }
        while tasks.join_next().await.is_some() {}
        started.elapsed()
    })
}

fn put_get_groups<C: RemoteConnector + Clone>(
    c: &mut Criterion,
    group: &str,
    rt: &Runtime,
    connector: C,
) {
    let v = value();
    let mut g = c.benchmark_group(group);
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    for concurrency in [1usize, 8] {
        g.throughput(Throughput::Bytes((MIB * concurrency) as u64));
        let keys: Vec<String> = (0..concurrency)
            .map(|t| format!("kvpool-bench-{t}"))
            .collect();
        rt.block_on(async {
            for k in &keys {
                connector.put(k, v.clone()).await.unwrap();
            }
        });
        let (vv, kk) = (v.clone(), keys.clone());
        g.bench_function(
            BenchmarkId::new("put_1MiB", format!("c{concurrency}")),
            |b| {
                b.iter_custom(|iters| {
                    let (v, keys) = (vv.clone(), kk.clone());
                    concurrent(rt, &connector, concurrency, iters, move |c: C, t| {
                        let (v, k) = (v.clone(), keys[t].clone());
                        async move { c.put(&k, v).await.unwrap() }
                    })
                })
            },
        );
        let kk = keys.clone();
        g.bench_function(
            BenchmarkId::new("get_1MiB", format!("c{concurrency}")),
            |b| {
                b.iter_custom(|iters| {
                    let keys = kk.clone();
                    concurrent(rt, &connector, concurrency, iters, move |c: C, t| {
                        let k = keys[t].clone();
                        async move {
                            black_box(c.get(&k).await.unwrap().unwrap());
                        }
                    })
                })
            },
        );
    }
    g.finish();
}

fn redis(c: &mut Criterion) {
    let Ok(url) = std::env::var("KVPOOL_BENCH_REDIS_URL") else {
        eprintln!(
            "skipping redis benchmarks: KVPOOL_BENCH_REDIS_URL is not set (cargo xtask bench-backends sets it)"
        );
        return;
    };
    let rt = runtime();
    let connector = rt
        .block_on(RedisConnector::connect(&RedisConfig::new(url)))
        .unwrap();
    put_get_groups(c, "redis", &rt, connector);
}

fn s3(c: &mut Criterion) {
    let (Ok(url), Ok(endpoint)) = (
        std::env::var("KVPOOL_BENCH_S3_URL"),
        std::env::var("KVPOOL_BENCH_S3_ENDPOINT"),
    ) else {
        eprintln!(
            "skipping s3 benchmarks: KVPOOL_BENCH_S3_URL / KVPOOL_BENCH_S3_ENDPOINT are not set"
        );
        return;
    };
    let rt = runtime();
    let mut config = S3Config::new(url);
    config.endpoint = Some(endpoint);
    config.region = Some("us-east-1".into());
    let connector = rt.block_on(S3Connector::connect(&config)).unwrap();
    put_get_groups(c, "s3", &rt, connector.clone());
    rt.block_on(connector.put("kvpool-bench-tiny", Bytes::from_static(b"x")))
        .unwrap();
    let mut g = c.benchmark_group("s3");
    g.sample_size(20);
    g.bench_function("get_1B_request_overhead", |b| {
        b.iter(|| black_box(rt.block_on(connector.get("kvpool-bench-tiny")).unwrap()))
    });
    g.finish();
}

fn rocksdb_vs_file(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path().join("db"))).unwrap();
    let v = value();
    rt.block_on(disk.put("hot", v.clone())).unwrap();
    // Out of the memtable, into an SST file: reads now go through the block cache.
    disk.persist().unwrap();
    let file = dir.path().join("plain.bin");
    std::fs::write(&file, &v).unwrap();
    let mut g = c.benchmark_group("hot_1MiB_read");
    g.throughput(Throughput::Bytes(MIB as u64));
    g.sample_size(50);
    g.bench_function("page_cache_file", |b| {
        b.iter(|| black_box(std::fs::read(&file).unwrap()))
    });
    let disk = Arc::new(disk);
    g.bench_function("rocksdb_get", |b| {
        b.iter(|| black_box(rt.block_on(disk.get("hot")).unwrap().unwrap()))
    });
    // Like the file read, end with the bytes copied into a buffer of our own.
    g.bench_function("rocksdb_get_copied_out", |b| {
        b.iter(|| black_box(rt.block_on(disk.get("hot")).unwrap().unwrap().to_vec()))
    });
    g.finish();
}

/// Drops the page cache's copy of `path` (its pages were written back: the files here are
/// fsynced), so that the next read comes from the disk.
fn drop_cached_pages(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: the descriptor is open for the duration of the call; fadvise only drops clean
    // cached pages of this file.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise({})", path.display());
}

/// A 1 MiB read that is in neither RocksDB's block cache nor the page cache: what a tier
/// below L1 mostly serves. Before each read, three other values go through a 2 MiB block
/// cache (evicting the one read) and every SST file's pages are dropped; the baseline reads
/// a plain file whose pages were dropped the same way.
fn cold_rocksdb_vs_file(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let db_dir = dir.path().join("db");
    let mut config = DiskConfig::new(&db_dir);
    config.block_cache_bytes = 2 * MIB;
    let disk = DiskConnector::open(config).unwrap();
    let v = value();
    let others = ["other-0", "other-1", "other-2"];
    for key in std::iter::once("cold").chain(others) {
        rt.block_on(disk.put(key, v.clone())).unwrap();
    }
    disk.persist().unwrap();
    let file = dir.path().join("plain.bin");
    std::fs::write(&file, &v).unwrap();
    std::fs::File::open(&file).unwrap().sync_all().unwrap();
    let drop_rocksdb_caches = || {
        for key in others {
            black_box(rt.block_on(disk.get(key)).unwrap().unwrap());
        }
        for entry in std::fs::read_dir(&db_dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "sst") {
                drop_cached_pages(&path);
            }
        }
    };
    let mut g = c.benchmark_group("cold_1MiB_read");
    g.throughput(Throughput::Bytes(MIB as u64));
    g.sample_size(30);
    g.bench_function("disk_file", |b| {
        b.iter_batched(
            || drop_cached_pages(&file),
            |()| black_box(std::fs::read(&file).unwrap()),
            BatchSize::PerIteration,
        )
    });
    g.bench_function("rocksdb_get_copied_out", |b| {
        b.iter_batched(
            drop_rocksdb_caches,
            |()| black_box(rt.block_on(disk.get("cold")).unwrap().unwrap().to_vec()),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, rocksdb_vs_file, cold_rocksdb_vs_file, redis, s3);
criterion_main!(benches);
