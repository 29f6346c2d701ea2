//! Reading a prefix from the node's pool daemon into L1, as a lookup's load does: 32 chunks of
//! 2 MiB (the 64 MiB of `cargo xtask bench-vllm`'s 8K-token prefix). The two-copy read every
//! other tier does (`batch_get` copies each value out of the arena, then the decoder copies its
//! payload into L1) side by side with the one-copy read of node memory (`get_node_memory`:
//! straight from the arena into L1, checked there), and a plain memcpy of the same bytes. Then
//! a load into an engine's blocks: through L1, or copied once from where the chunk lies
//! (`pin_node_memory`) and checked in the blocks. A save out of those blocks: through L1, or
//! copied once into a place the daemon lends (`lend_save_slots`). Last, the first copy out of
//! an arena an engine has just mapped: faulting page by page, or with its pages mapped ahead.
//! With the `disk` feature, a daemon writing committed values behind to a disk tier: its copy
//! out of the arena into a fresh buffer for each value, or into reused buffers, for small
//! values and for values past glibc's largest mmap threshold.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvpool_backends::LocalCpuBackend;
use kvpool_backends::daemon::{
    DEFAULT_LEASE_TTL, DaemonConnector, DaemonOptions, DaemonServer, PoolDaemon, SocketAccess,
    default_copy_buffer_bytes,
};
use kvpool_core::format::chunk_format::{
    DecodeExpectation, KeyBinding, decode_header, decode_payload_into,
};
use kvpool_core::memory::SharedMapping;
use kvpool_core::{
    CacheKey, Chunk, ChunkAllocator, ChunkCodec, ChunkHash, ChunkMeta, Dtype, EvictionKind,
    KeyScope, MemoryObj, NodeMemoryBackend, RemoteBackend, RemoteConnector, SaveSlot,
    StorageBackend,
};

const CHUNKS: usize = 32;
const CHUNK_BYTES: usize = 2 << 20;
const MIB: usize = 1 << 20;

fn daemon_read_into_l1(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvpool.sock");
    let options = DaemonOptions {
        tenant: "default".into(),
        capacity: 256 * MIB,
        eviction: EvictionKind::Lru,
        lease_ttl: DEFAULT_LEASE_TTL,
        write_behind_quota: 64 * MIB,
        copy_buffer_bytes: default_copy_buffer_bytes(256 * MIB),
    };
    let daemon = Arc::new(PoolDaemon::with_tiers(options, vec![], rt.handle().clone()).unwrap());
    let _server = DaemonServer::bind(daemon, &path, SocketAccess::default()).unwrap();
    let l1 = Arc::new(LocalCpuBackend::new(512 * MIB, EvictionKind::Lru).unwrap());
    let connector = DaemonConnector::new(&path, Duration::from_secs(5));
    let max_chunk = 4 * MIB as u64;
    let backend = RemoteBackend::new(connector.clone(), ChunkCodec::default(), max_chunk)
        .with_allocator(l1.clone());

    let scope = Arc::new(KeyScope::new("bench", 1, 0, 0, 1).unwrap());
    let keys: Vec<CacheKey> = (0..CHUNKS)
        .map(|i| CacheKey::new(scope.clone(), ChunkHash([i as u8; 16])))
        .collect();
    let names: Vec<String> = keys.iter().map(ToString::to_string).collect();
    let meta = ChunkMeta {
        layout_fingerprint: scope.layout_fingerprint,
        dtype: Dtype::Bf16,
        token_count: 256,
    };
    let entries = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let bytes = (0..CHUNK_BYTES).map(|b| (b * 7 + i) as u8).collect();
            let chunk = Chunk {
                meta,
                data: MemoryObj::from_vec(bytes),
            };
            (key.clone(), chunk)
        })
        .collect();
    rt.block_on(backend.put(entries)).unwrap();

    let mut g = c.benchmark_group("daemon_read_64mib_into_l1");
    g.sample_size(30);
    g.throughput(Throughput::Bytes((CHUNKS * CHUNK_BYTES) as u64));
    g.bench_function("two copies (batch_get, then decode)", |b| {
        b.iter(|| {
            let values = rt.block_on(connector.batch_get(&names)).unwrap();
            let chunks: Vec<MemoryObj> = keys
                .iter()
                .zip(values)
                .map(|(key, value)| {
                    let bytes = value.expect("resident");
                    let expect = DecodeExpectation {
                        max_raw_len: max_chunk,
                        layout_fingerprint: Some(key.scope.layout_fingerprint),
                        bytes_per_token: None,
                        key: Some(KeyBinding::of(key)),
                    };
                    let header = decode_header(&bytes, &expect).unwrap();
                    let mut buf = l1.allocate(header.raw_len as usize).unwrap();
                    decode_payload_into(&bytes, &header, buf.as_mut_slice()).unwrap();
                    buf.freeze()
                })
                .collect();
            black_box(chunks)
        })
    });
    g.bench_function("one copy (get_node_memory)", |b| {
        b.iter(|| {
            let chunks = rt.block_on(backend.get_node_memory(&keys)).unwrap();
            assert!(chunks.iter().all(Option::is_some));
            black_box(chunks)
        })
    });
    let src = vec![3u8; CHUNKS * CHUNK_BYTES];
    let mut dst = vec![0u8; CHUNKS * CHUNK_BYTES];
    g.bench_function("memcpy of the same bytes", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    g.finish();

    // A load into an engine's KV blocks (host memory, as vLLM's CPU blocks): through L1 as
    // above, then L1 into the blocks; or pinned where it lies, copied once into the blocks
    // and checked there (what a lookup's lease and the worker's load do since the one-copy
    // cut). The blocks here are one buffer, each chunk's bytes contiguous in it.
    let mut g = c.benchmark_group("daemon_load_64mib_into_blocks");
    g.sample_size(30);
    g.throughput(Throughput::Bytes((CHUNKS * CHUNK_BYTES) as u64));
    let mut blocks = vec![0u8; CHUNKS * CHUNK_BYTES];
    g.bench_function(
        "through L1 (get_node_memory, then L1 into the blocks)",
        |b| {
            b.iter(|| {
                let chunks = rt.block_on(backend.get_node_memory(&keys)).unwrap();
                for (chunk, dst) in chunks.iter().zip(blocks.chunks_mut(CHUNK_BYTES)) {
                    dst.copy_from_slice(chunk.as_ref().expect("resident").data.as_slice());
                }
                black_box(&blocks);
            })
        },
    );
    g.bench_function(
        "one copy (pin_node_memory, copy into the blocks, check there)",
        |b| {
            b.iter(|| {
                let pinned = rt.block_on(backend.pin_node_memory(&keys)).unwrap();
                for (chunk, dst) in pinned.iter().zip(blocks.chunks_mut(CHUNK_BYTES)) {
                    let chunk = chunk.as_ref().expect("resident");
                    // SAFETY: the chunk keeps its payload mapped and pinned while it lives.
                    let src = unsafe {
                        std::slice::from_raw_parts(chunk.payload_ptr() as *const u8, CHUNK_BYTES)
                    };
                    dst.copy_from_slice(src);
                    chunk.verify_copy([&*dst]).unwrap();
                }
                black_box(&blocks);
            })
        },
    );
    g.finish();

    // A save out of an engine's KV blocks (the same buffer): copied into an L1 buffer, then
    // written behind into a daemon allocation (encoded, checksummed from L1's bytes); or
    // copied once into a place the daemon lends, sealed with a checksum hashed from the
    // blocks, and committed. Each iteration stores the 32 keys again (replacing the values).
    let mut g = c.benchmark_group("daemon_save_64mib_from_blocks");
    g.sample_size(30);
    g.throughput(Throughput::Bytes((CHUNKS * CHUNK_BYTES) as u64));
    g.bench_function(
        "through L1 (blocks into L1, then batch_copy_in into the arena)",
        |b| {
            b.iter(|| {
                let entries = keys
                    .iter()
                    .zip(blocks.chunks(CHUNK_BYTES))
                    .map(|(key, src)| {
                        let mut buf = l1.allocate(CHUNK_BYTES).unwrap();
                        buf.as_mut_slice().copy_from_slice(src);
                        let chunk = Chunk {
                            meta,
                            data: buf.freeze(),
                        };
                        (key.clone(), chunk)
                    })
                    .collect();
                rt.block_on(backend.put(entries)).unwrap();
            })
        },
    );
    let wanted: Vec<(CacheKey, usize)> = keys.iter().map(|k| (k.clone(), CHUNK_BYTES)).collect();
    g.bench_function(
        "one copy (lend_save_slots, blocks into the arena, seal from the blocks, commit)",
        |b| {
            b.iter(|| {
                let mut slots: Vec<SaveSlot> = rt
                    .block_on(backend.lend_save_slots(&wanted))
                    .unwrap()
                    .into_iter()
                    .map(|slot| slot.expect("room in the arena"))
                    .collect();
                for (slot, src) in slots.iter_mut().zip(blocks.chunks(CHUNK_BYTES)) {
                    // SAFETY: the slot's payload is CHUNK_BYTES lent to this writer.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(slot.payload_ptr() as *mut u8, CHUNK_BYTES)
                    };
                    dst.copy_from_slice(src);
                    slot.seal(&meta, [src]).unwrap();
                }
                let stored = rt.block_on(backend.commit_save_slots(slots)).unwrap();
                assert_eq!(stored.stored, CHUNKS);
            })
        },
    );
    g.finish();
}

/// The first copy out of a daemon's arena in an engine that has just mapped it (the pages were
/// written by another process): page by page on first touch, or with every page mapped ahead
/// (`SharedMapping::map_all_pages`, which an engine runs on a thread of its own on attaching).
/// The mapping is made, and mapped ahead, outside the timed copy.
fn first_copy_out_of_a_fresh_mapping(c: &mut Criterion) {
    let owner = SharedMapping::create("kvpool-bench-arena", 4 * CHUNKS * CHUNK_BYTES).unwrap();
    owner.commit_pages().unwrap();
    // SAFETY: the whole mapping is ours; nothing else writes it.
    unsafe { std::ptr::write_bytes(owner.as_ptr().as_ptr(), 7, owner.len()) };
    let mut dst = vec![0u8; CHUNKS * CHUNK_BYTES];
    let map = |ahead: bool| {
        let view = SharedMapping::map(owner.fd().try_clone_to_owned().unwrap(), owner.len());
        let view = view.unwrap();
        if ahead {
            view.map_all_pages().unwrap();
        }
        view
    };
    let mut g = c.benchmark_group("first_copy_64mib_out_of_a_fresh_mapping");
    g.sample_size(30);
    g.throughput(Throughput::Bytes(dst.len() as u64));
    for (name, ahead) in [("faulting page by page", false), ("mapped ahead", true)] {
        g.bench_function(name, |b| {
            b.iter_batched(
                || map(ahead),
                |view| {
                    // SAFETY: the first 64 MiB of the 256 MiB mapping; nothing writes them.
                    let src = unsafe {
                        std::slice::from_raw_parts(view.as_ptr().as_ptr(), CHUNKS * CHUNK_BYTES)
                    };
                    dst.copy_from_slice(src);
                    black_box(&dst);
                    view
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

/// A daemon writing committed values behind to a disk tier (on the process's low-priority
/// threads, as `kvpool serve` writes it: each commit is under a quarter of the arena), after
/// each save: 80 MiB of values committed, then waited for until the disk tier has written
/// every one. The daemon copies each value out of its arena and checks it before the tier
/// writes it to a file; the copy goes into a fresh buffer (`copy_buffer_bytes = 0`, as before
/// reused buffers) or into a buffer an earlier copy used (256 MiB kept). Two value sizes:
/// 2 MiB (a 256-token chunk of a small model) and 40 MiB (one of a model with 160 KiB of KV
/// per token, past the 32 MiB above which glibc's malloc always maps fresh pages). Over 8
/// rounds the two daemons take turns (which goes first alternates), each round 5 writes by
/// each after a `sync`; printed per write: this process's CPU time and minor page faults
/// (`getrusage`) and the wall time, medians and ranges over the rounds. Not a criterion
/// measurement: it runs only when `daemon_write_behind` is named on the command line.
#[cfg(feature = "disk")]
fn daemon_write_behind_to_disk(_: &mut Criterion) {
    if !std::env::args().any(|a| a.contains("daemon_write_behind")) {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    const WRITTEN_BYTES: usize = 80 * MIB;
    for value_bytes in [2 * MIB, 40 * MIB] {
        let values = WRITTEN_BYTES / value_bytes;
        let scope = Arc::new(KeyScope::new("bench-write-behind", 1, 0, 0, 1).unwrap());
        let meta = ChunkMeta {
            layout_fingerprint: scope.layout_fingerprint,
            dtype: Dtype::Bf16,
            token_count: 256,
        };
        let entries: Vec<(CacheKey, Chunk)> = (0..values)
            .map(|i| {
                let key = CacheKey::new(scope.clone(), ChunkHash([i as u8; 16]));
                let bytes = (0..value_bytes).map(|b| (b * 13 + i) as u8).collect();
                let chunk = Chunk {
                    meta,
                    data: MemoryObj::from_vec(bytes),
                };
                (key, chunk)
            })
            .collect();
        let variants: Vec<WriteBehindVariant> = [
            ("fresh buffer per copy", 0),
            ("reused copy buffers", 256 * MIB),
        ]
        .into_iter()
        .map(|(name, copy_buffer_bytes)| {
            let place = dir
                .path()
                .join(format!("{value_bytes}-{copy_buffer_bytes}"));
            WriteBehindVariant::start(&rt, &place, name, copy_buffer_bytes)
        })
        .collect();
        let write_all_behind = |variant: &WriteBehindVariant| {
            let written = variant.daemon.stats().tier_writes;
            rt.block_on(variant.backend.put(entries.clone())).unwrap();
            while variant.daemon.stats().tier_writes < written + values as u64 {
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        for variant in &variants {
            write_all_behind(variant); // the disk tier's files exist; a kept buffer, if any
        }
        const ROUNDS: usize = 8;
        const WRITES: u32 = 5;
        // Per variant, per round: CPU ms, minor faults and wall ms per write.
        let mut per_write: Vec<Vec<[f64; 3]>> = vec![Vec::new(); variants.len()];
        for round in 0..ROUNDS {
            let mut order: Vec<usize> = (0..variants.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                // SAFETY: sync(2) takes no arguments and cannot fail.
                unsafe { libc::sync() }; // the last variant's dirty pages are not this one's
                let (faults, cpu) = (minor_faults(), cpu_seconds());
                let started = std::time::Instant::now();
                for _ in 0..WRITES {
                    write_all_behind(&variants[i]);
                }
                let writes = f64::from(WRITES);
                per_write[i].push([
                    (cpu_seconds() - cpu) * 1e3 / writes,
                    (minor_faults() - faults) as f64 / writes,
                    started.elapsed().as_secs_f64() * 1e3 / writes,
                ]);
            }
        }
        let column = |rounds: &[[f64; 3]], k: usize| median_and_range(rounds.iter().map(|r| r[k]));
        let (fresh_cpu, fresh_wall) = (column(&per_write[0], 0).0, column(&per_write[0], 2).0);
        for (variant, rounds) in variants.iter().zip(&per_write) {
            let (cpu, cpu_min, cpu_max) = column(rounds, 0);
            let (faults, faults_min, faults_max) = column(rounds, 1);
            let (wall, wall_min, wall_max) = column(rounds, 2);
            eprintln!(
                "{} MiB values, {}: per 80 MiB written behind, CPU {cpu:.1} ms \
                 [{cpu_min:.1}-{cpu_max:.1}] ({:.2}x fresh), wall {wall:.1} ms \
                 [{wall_min:.1}-{wall_max:.1}] ({:.2}x fresh), minor page faults {faults:.0} \
                 [{faults_min:.0}-{faults_max:.0}]",
                value_bytes / MIB,
                variant.name,
                cpu / fresh_cpu,
                wall / fresh_wall,
            );
        }
    }
}

/// One daemon of [`daemon_write_behind_to_disk`], over a disk tier of its own.
#[cfg(feature = "disk")]
struct WriteBehindVariant {
    name: &'static str,
    daemon: Arc<PoolDaemon>,
    backend: RemoteBackend<DaemonConnector>,
    _server: DaemonServer,
}

#[cfg(feature = "disk")]
impl WriteBehindVariant {
    fn start(
        rt: &tokio::runtime::Runtime,
        dir: &std::path::Path,
        name: &'static str,
        copy_buffer_bytes: usize,
    ) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let disk = dir.join("disk");
        let tier = rt
            .block_on(kvpool_backends::registry::open_connector(
                &kvpool_core::TierConfig::new(format!("file://{}", disk.display())),
                64 * MIB as u64,
            ))
            .unwrap();
        let options = DaemonOptions {
            tenant: "default".into(),
            capacity: 512 * MIB,
            eviction: EvictionKind::Lru,
            lease_ttl: DEFAULT_LEASE_TTL,
            write_behind_quota: 256 * MIB,
            copy_buffer_bytes,
        };
        let daemon = Arc::new(
            PoolDaemon::with_tiers(options, vec![Arc::new(tier)], rt.handle().clone())
                .unwrap()
                .write_tier_behind_on(
                    0,
                    kvpool_backends::background::background_runtime().unwrap(),
                ),
        );
        let path = dir.join("kvpool.sock");
        let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
        let backend = RemoteBackend::new(
            DaemonConnector::new(&path, Duration::from_secs(5)),
            ChunkCodec::default(),
            64 * MIB as u64,
        );
        WriteBehindVariant {
            name,
            daemon,
            backend,
            _server: server,
        }
    }
}

/// The median, least and greatest of `values` (not empty).
#[cfg(feature = "disk")]
fn median_and_range(values: impl Iterator<Item = f64>) -> (f64, f64, f64) {
    let mut sorted: Vec<f64> = values.collect();
    sorted.sort_by(f64::total_cmp);
    (
        sorted[sorted.len() / 2],
        sorted[0],
        sorted[sorted.len() - 1],
    )
}

/// This process's resource usage so far.
#[cfg(feature = "disk")]
fn usage() -> libc::rusage {
    // SAFETY: an all-zero rusage is a valid value for getrusage to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF and a valid, writable rusage.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) }, 0);
    usage
}

/// This process's minor page faults so far.
#[cfg(feature = "disk")]
fn minor_faults() -> u64 {
    usage().ru_minflt as u64
}

/// This process's CPU time so far (user and system), in seconds.
#[cfg(feature = "disk")]
fn cpu_seconds() -> f64 {
    let u = usage();
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    seconds(u.ru_utime) + seconds(u.ru_stime)
}

#[cfg(not(feature = "disk"))]
criterion_group!(
    benches,
    daemon_read_into_l1,
    first_copy_out_of_a_fresh_mapping
);
#[cfg(feature = "disk")]
criterion_group!(
    benches,
    daemon_read_into_l1,
    first_copy_out_of_a_fresh_mapping,
    daemon_write_behind_to_disk
);
criterion_main!(benches);
