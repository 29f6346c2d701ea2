//! The first disk hits of a fresh process: where a new engine's first loads from the RocksDB
//! tier spend their time, apart from vLLM.
//!
//! One process stores `PROMPTS` prompts of 8,192 tokens (64 MiB of KV each, 32 chunks of
//! 256 tokens) into L1 with a disk tier behind it and closes. Then `PROCESSES` fresh processes
//! (this binary again, `--load`), each with an empty 512 MiB L1 over the same disk tier, load
//! the prompts one at a time and time, per request, the fetch from disk into L1 (reads,
//! checks, the copy into L1 pages) and the copy into a paged KV cache, with the minor page
//! faults each took. Prints the median over processes of each request, in order.
//!
//! ```sh
//! cargo bench -p kvpool-backends --features disk --bench first_hit
//! ```

use std::process::Command;
use std::time::Instant;

use kvpool_backends::build_pool;
use kvpool_core::{ByteSize, Dtype, HostPagedKvCache, KvKind, KvLayout, PoolConfig, TierConfig};

const PROMPTS: usize = 10;
const TOKENS: usize = 8192;
const PROCESSES: usize = 5;

fn config(dir: &std::path::Path) -> PoolConfig {
    let mut config = PoolConfig {
        // 8 KiB of KV per token: 4 layers, K and V, 4 heads of 64 float32s.
        layout: KvLayout {
            num_layers: 4,
            num_kv_heads: 4,
            head_size: 64,
            dtype: Dtype::F32,
            kind: KvKind::KeyValue,
            block_size: 32,
        },
        ..Default::default()
    };
    config.local_cpu.max_size = ByteSize::mib(512);
    config
        .tiers
        .push(TierConfig::new(format!("file://{}", dir.display())));
    config
}

fn prompt(i: usize) -> Vec<u32> {
    (0..TOKENS as u32)
        .map(|t| (t.wrapping_mul(2654435761) ^ (i as u32 * 7919)) % 32_000)
        .collect()
}

fn minor_faults() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable rusage; getrusage fills it.
    unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init().ru_minflt
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn store(dir: &std::path::Path) {
    let rt = runtime();
    let pool = rt.block_on(build_pool(&config(dir))).unwrap();
    let engine = pool.engine.clone();
    let mut kv = HostPagedKvCache::new(*engine.layout(), TOKENS / 32);
    for layer in 0..4 {
        kv.layer_mut(layer)
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 31 + layer) as u8);
    }
    let slots: Vec<i64> = (0..TOKENS as i64).collect();
    for i in 0..PROMPTS {
        rt.block_on(engine.store(&prompt(i), None, &kv, &slots))
            .unwrap();
        // Every chunk on disk before the next prompt (write-behind drops past its quota).
        rt.block_on(engine.storage().flush()).unwrap();
    }
    rt.block_on(engine.storage().close()).unwrap();
}

/// Resident memory of this process (bytes), from `/proc/self/statm`.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split(' ').nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// One fresh process's loads: a first line `build_ms resident_mib` (opening the pool), then
/// one line per request, `fetch_ms copy_ms fetch_faults`.
fn load(dir: &std::path::Path) {
    let rt = runtime();
    let start = Instant::now();
    let pool = rt.block_on(build_pool(&config(dir))).unwrap();
    println!(
        "{:.2} {}",
        start.elapsed().as_secs_f64() * 1e3,
        resident_bytes() >> 20
    );
    let engine = pool.engine.clone();
    let mut kv = HostPagedKvCache::new(*engine.layout(), TOKENS / 32);
    let slots: Vec<i64> = (0..TOKENS as i64).collect();
    for i in 0..PROMPTS {
        let i = if std::env::var_os("REV").is_some() {
            PROMPTS - 1 - i
        } else {
            i
        };
        let tokens = prompt(i);
        let faults = minor_faults();
        let start = Instant::now();
        let mut plan = rt
            .block_on(engine.begin_retrieve_layerwise(&tokens, None, &slots))
            .unwrap();
        let fetched = start.elapsed();
        let fetch_faults = minor_faults() - faults;
        let start = Instant::now();
        plan.load_all(&mut kv).unwrap();
        let copied = start.elapsed();
        assert_eq!(plan.loaded_tokens(), TOKENS, "request {i} missed");
        println!(
            "{:.2} {:.2} {}",
            fetched.as_secs_f64() * 1e3,
            copied.as_secs_f64() * 1e3,
            fetch_faults
        );
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--load") {
        load(std::path::Path::new(&args[at + 1]));
        return;
    }
    if let Some(at) = args.iter().position(|a| a == "--store") {
        store(std::path::Path::new(&args[at + 1]));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    store(dir.path());
    let exe = std::env::current_exe().unwrap();
    // rows[process][request] = (fetch ms, copy ms, faults); opened[process] = (ms, MiB)
    let mut rows: Vec<Vec<(f64, f64, f64)>> = Vec::new();
    let mut opened: Vec<(f64, f64)> = Vec::new();
    for _ in 0..PROCESSES {
        let out = Command::new(&exe)
            .arg("--load")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let mut lines = stdout.lines();
        let first: Vec<f64> = lines
            .next()
            .unwrap()
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        opened.push((first[0], first[1]));
        rows.push(
            lines
                .map(|l| {
                    let f: Vec<f64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
                    (f[0], f[1], f[2])
                })
                .collect(),
        );
    }
    println!(
        "first disk hits of a fresh process: {PROCESSES} processes, {PROMPTS} requests of \
         {TOKENS} tokens (64 MiB) each; medians over the processes"
    );
    println!(
        "opening the pool (512 MiB of L1, the disk tier): {:.1} ms, then {:.0} MiB resident",
        median(opened.iter().map(|o| o.0).collect()),
        median(opened.iter().map(|o| o.1).collect()),
    );
    println!(
        "request | fetch into L1 (ms) [range] | copy into the KV cache (ms) | minor faults in the fetch"
    );
    for r in 0..PROMPTS {
        let fetch: Vec<f64> = rows.iter().map(|p| p[r].0).collect();
        let lo = fetch.iter().cloned().fold(f64::MAX, f64::min);
        let hi = fetch.iter().cloned().fold(0.0, f64::max);
        println!(
            "{:>7} | {:>6.1} [{lo:.1}-{hi:.1}] | {:>6.1} | {:>7.0}",
            r + 1,
            median(fetch),
            median(rows.iter().map(|p| p[r].1).collect()),
            median(rows.iter().map(|p| p[r].2).collect()),
        );
    }
}
