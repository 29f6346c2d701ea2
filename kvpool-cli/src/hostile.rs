//! `kvpool hostile-engine` (hidden; run by `cargo xtask soak --daemon`): an engine that attacks
//! the pool daemon it attaches to for as long as it runs. The soak puts it in a `[[tenant]]` of
//! its own beside honest engines in another, and checks that they see no wrong KV, that none of
//! their requests is refused, and that the daemon stays within its memory bounds.
//!
//! Its attacks, one at a time at random: frames of garbage; a first frame claiming a million
//! items; storms of one key repeated 65,536 times in one get; commits of values that are not
//! chunks, and of well-formed chunks of random bytes; holes punched (`MADV_REMOVE`) into its
//! mapping of its tenant's arena, under values the daemon holds; connections that never attach.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use kvpool_backends::daemon::DaemonConnector;
use kvpool_core::format::chunk_format::KeyBinding;
use kvpool_core::storage::remote::{RemoteConnector, node_memory_mapping_of};
use kvpool_core::{CacheKey, ChunkCodec, ChunkHash, ChunkMeta, Dtype, KeyScope};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use tokio::runtime::Runtime;

/// `kvpool hostile-engine`: see the module docs.
#[derive(Args, Debug)]
pub struct HostileArgs {
    /// The daemon's (its tenant's) socket.
    #[arg(long)]
    socket: PathBuf,
    /// How long to attack, in seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Seed of the attacks' choices and bytes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Connections that never attach, held open at once (the daemon closes each at its deadline).
const MAX_STALLED: usize = 8;

/// The attacks, by name (the keys of the counts it prints).
const ATTACKS: [&str; 6] = [
    "garbage frames",
    "frames claiming a million items",
    "duplicate-key storms",
    "forged commits",
    "holes punched into the arena",
    "connections that never attach",
];

/// Runs the attacks until `--seconds` pass (or it is killed); prints how many of each ran so
/// far as a JSON line, every second and at the end.
pub fn run(args: HostileArgs, rt: &Runtime) -> anyhow::Result<()> {
    let connector: Arc<dyn RemoteConnector> =
        Arc::new(DaemonConnector::new(&args.socket, Duration::from_secs(2)));
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let scope = Arc::new(KeyScope::new("hostile-model", 1, 0, 0, 0x5eed)?);
    let key = |rng: &mut SmallRng| {
        let mut hash = [0u8; 16];
        rng.fill_bytes(&mut hash);
        CacheKey::new(scope.clone(), ChunkHash(hash))
    };
    let mut counts = [0u64; ATTACKS.len()];
    let mut stalled: Vec<UnixStream> = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(args.seconds);
    let mut reported = Instant::now();
    while Instant::now() < end {
        let attack = rng.random_range(0..ATTACKS.len());
        // Every attack may fail (the daemon refuses it, closes the session, or is down while
        // the soak restarts it): the attack is the point, not its answer.
        match attack {
            0 => {
                let len = rng.random_range(1..4096usize);
                let mut frame = (len as u32).to_le_bytes().to_vec();
                frame.extend((0..len).map(|_| rng.random::<u8>()));
                let _ = send_raw(&args, &frame);
            }
            1 => {
                // `Exists` (variant 1) with a count of 2^20 keys as the first frame.
                let body = [1u8, 0x80, 0x80, 0x40];
                let mut frame = (body.len() as u32).to_le_bytes().to_vec();
                frame.extend_from_slice(&body);
                let _ = send_raw(&args, &frame);
            }
            2 => {
                let keys = vec![key(&mut rng).to_string(); 1 << 16];
                let _ = rt.block_on(connector.batch_get(&keys));
            }
            3 => {
                let entries = (0..8)
                    .map(|i| {
                        let k = key(&mut rng);
                        let value = if i % 2 == 0 {
                            not_a_chunk(&mut rng)
                        } else {
                            chunk(&k, &mut rng)
                        };
                        (k.to_string(), value)
                    })
                    .collect();
                let _ = rt.block_on(connector.batch_put(entries));
            }
            4 => {
                if let Some(mapping) = node_memory_mapping_of(connector.as_ref()) {
                    punch_hole(mapping.as_ptr().as_ptr(), mapping.len(), &mut rng);
                }
            }
            _ => {
                if let Ok(s) = UnixStream::connect(&args.socket) {
                    if stalled.len() == MAX_STALLED {
                        stalled.remove(0);
                    }
                    stalled.push(s);
                }
            }
        }
        counts[attack] += 1;
        if reported.elapsed() >= Duration::from_secs(1) {
            report(&counts)?;
            reported = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(5..50)));
    }
    report(&counts)
}

/// Prints the attacks' counts as one JSON line (the soak reads the last).
fn report(counts: &[u64; ATTACKS.len()]) -> anyhow::Result<()> {
    let line: serde_json::Map<String, serde_json::Value> = ATTACKS
        .iter()
        .zip(counts)
        .map(|(name, &n)| (name.to_string(), n.into()))
        .collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::Value::Object(line))?;
    out.flush()?;
    Ok(())
}

/// Sends `frame` on a fresh connection and reads whatever comes back (a refusal, or the
/// daemon closing the session).
fn send_raw(args: &HostileArgs, frame: &[u8]) -> std::io::Result<()> {
    let mut s = UnixStream::connect(&args.socket)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(frame)?;
    let mut reply = [0u8; 512];
    let _ = s.read(&mut reply)?;
    Ok(())
}

/// Frees a random 64 KiB-aligned range of the arena in the memory file itself
/// (`MADV_REMOVE`): the daemon's values there read back as zeros from then on.
fn punch_hole(base: *mut u8, len: usize, rng: &mut SmallRng) {
    const PAGE: usize = 64 << 10;
    if len < PAGE {
        return;
    }
    let offset = rng.random_range(0..len / PAGE) * PAGE;
    // SAFETY: [base + offset, base + offset + PAGE) lies inside this process's live shared
    // mapping of the arena (offset + PAGE <= len), and this process holds no reference into
    // it: the bytes change under the daemon and other mappings, which is the attack.
    unsafe {
        libc::madvise(base.add(offset).cast(), PAGE, libc::MADV_REMOVE);
    }
}

/// Random bytes: not a chunk at all.
fn not_a_chunk(rng: &mut SmallRng) -> Bytes {
    let mut v = vec![0u8; rng.random_range(1..64 << 10)];
    rng.fill_bytes(&mut v);
    Bytes::from(v)
}

/// A well-formed chunk bound to `key`, of random payload: what an engine forging a value
/// would commit.
fn chunk(key: &CacheKey, rng: &mut SmallRng) -> Bytes {
    let mut payload = vec![0u8; 16 << 10];
    rng.fill_bytes(&mut payload);
    let meta = ChunkMeta {
        layout_fingerprint: key.scope.layout_fingerprint,
        dtype: Dtype::F16,
        token_count: 16,
    };
    Bytes::from(ChunkCodec::default().encode(&meta, &KeyBinding::of(key), &payload))
}
