//! The conformance kit: one async check per behaviour every storage backend must have.
//!
//! Third-party backends run the same kit as the ones in this crate:
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvpool_backends::conformance::{self, Subject};
//! # async fn demo() {
//! let results = conformance::run_all(&|| async {
//!     let backend = kvpool_backends::LocalCpuBackend::new(64 << 20, Default::default()).unwrap();
//!     Subject::new(Arc::new(backend), 32 << 20)
//! })
//! .await;
//! conformance::assert_all_passed("cpu", &results);
//! # }
//! ```
//!
//! Every check gets a fresh [`Subject`] from the factory (one check closes its backend) and
//! uses keys unique to this process and check, so a shared server needs no cleanup between runs.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvpool_core::{
    CacheKey, Chunk, ChunkHash, ChunkMeta, Dtype, KeyScope, MemoryObj, StorageBackend,
};

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Overwrites the stored bytes of a key with garbage (for backends that store bytes).
pub type Corruptor = Arc<dyn Fn(CacheKey) -> BoxFuture<()> + Send + Sync>;

/// Copies the stored bytes of one key under another (for backends that store bytes).
pub type RawCopier = Arc<dyn Fn(CacheKey, CacheKey) -> BoxFuture<()> + Send + Sync>;

/// A backend under test and what the kit needs to know about it.
#[derive(Clone)]
pub struct Subject {
    /// The backend.
    pub backend: Arc<dyn StorageBackend>,
    /// Corrupts a stored value in place; `None` skips the corruption check (memory tiers).
    pub corrupt: Option<Corruptor>,
    /// Largest chunk the backend is set up to hold; larger round trips are skipped.
    pub max_chunk_bytes: usize,
    /// Copies a stored value under another key; `None` skips the wrong-key check.
    pub copy_raw: Option<RawCopier>,
}

impl Subject {
    /// A subject without a corruption hook.
    pub fn new(backend: Arc<dyn StorageBackend>, max_chunk_bytes: usize) -> Self {
        Subject {
            backend,
            corrupt: None,
            max_chunk_bytes,
            copy_raw: None,
        }
    }

    /// Adds the raw copy hook (for `value_under_wrong_key_rejected`).
    pub fn with_raw_copier(mut self, copy: RawCopier) -> Self {
        self.copy_raw = Some(copy);
        self
    }

    /// Adds the corruption hook.
    pub fn with_corruptor(mut self, corrupt: Corruptor) -> Self {
        self.corrupt = Some(corrupt);
        self
    }
}

/// How one check ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The backend behaved.
    Passed,
    /// It did not; the message says how.
    Failed(String),
    /// The check does not apply; the message says why.
    Skipped(String),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Passed => f.write_str("pass"),
            Outcome::Failed(m) => write!(f, "FAIL: {m}"),
            Outcome::Skipped(m) => write!(f, "skip: {m}"),
        }
    }
}

/// One check's name and outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    /// Check name.
    pub name: &'static str,
    /// Outcome.
    pub outcome: Outcome,
}

type CheckFn = fn(Subject) -> BoxFuture<Outcome>;

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Outcome::Failed(format!($($msg)+));
        }
    };
}

macro_rules! ok {
    ($e:expr, $what:expr) => {
        match $e {
            Ok(v) => v,
            Err(err) => return Outcome::Failed(format!("{} failed: {err}", $what)),
        }
    };
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

/// Keys unique to this process (pid and start time) and call.
fn fresh_keys(n: usize) -> Vec<CacheKey> {
    static SCOPE: std::sync::OnceLock<Arc<KeyScope>> = std::sync::OnceLock::new();
    let scope = SCOPE.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let model = format!("kvpool-conformance-{}-{nanos}", std::process::id());
        Arc::new(KeyScope::new(model, 1, 0, 0, 0x5eed).expect("valid scope"))
    });
    (0..n)
        .map(|_| {
            let id = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
            let mut h = [0u8; 16];
            h[..8].copy_from_slice(&id.to_le_bytes());
            h[8..].copy_from_slice(&(std::process::id() as u64).to_le_bytes());
            CacheKey::new(scope.clone(), ChunkHash(h))
        })
        .collect()
}

/// A chunk of `len` pseudo-random bytes derived from `seed`.
fn chunk(len: usize, seed: u64) -> Chunk {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    Chunk {
        meta: ChunkMeta {
            layout_fingerprint: 0x5eed,
            dtype: Dtype::Bf16,
            token_count: (len / 64) as u32,
        },
        data: MemoryObj::from_vec(data),
    }
}

fn same(a: &Chunk, b: &Chunk) -> bool {
    a.meta == b.meta && a.data.as_slice() == b.data.as_slice()
}

/// Put/get round trips of random bytes at 1 KiB, 1 MiB and 32 MiB.
pub fn round_trip_sizes(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let mut skipped = Vec::new();
        for (i, len) in [1usize << 10, 1 << 20, 32 << 20].into_iter().enumerate() {
            if len > s.max_chunk_bytes {
                skipped.push(len);
                continue;
            }
            let key = fresh_keys(1).remove(0);
            let value = chunk(len, i as u64 + 1);
            ok!(
                s.backend.put(vec![(key.clone(), value.clone())]).await,
                "put"
            );
            let got = ok!(s.backend.get(std::slice::from_ref(&key)).await, "get");
            ensure!(
                got.len() == 1,
                "get returned {} values for 1 key",
                got.len()
            );
            match &got[0] {
                Some(c) => ensure!(same(c, &value), "{len}-byte value came back different"),
                None => return Outcome::Failed(format!("{len}-byte value missing after put")),
            }
        }
        if skipped.len() == 3 {
            return Outcome::Skipped("max_chunk_bytes below 1 KiB".into());
        }
        Outcome::Passed
    })
}

/// `contains` answers per key, in order, for present and absent keys.
pub fn exists_batch(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let keys = fresh_keys(5);
        let stored = vec![
            (keys[0].clone(), chunk(512, 1)),
            (keys[2].clone(), chunk(512, 2)),
            (keys[3].clone(), chunk(512, 3)),
        ];
        ok!(s.backend.put(stored).await, "put");
        let found = ok!(s.backend.contains(&keys).await, "contains");
        ensure!(
            found == vec![true, false, true, true, false],
            "contains returned {found:?}"
        );
        let one = ok!(s.backend.contains(&keys[2..3]).await, "contains");
        ensure!(one == vec![true], "single contains returned {one:?}");
        Outcome::Passed
    })
}

/// A second put of a key replaces its value.
pub fn overwrite(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let key = fresh_keys(1).remove(0);
        ok!(
            s.backend.put(vec![(key.clone(), chunk(2048, 1))]).await,
            "first put"
        );
        let second = chunk(4096, 2);
        ok!(
            s.backend.put(vec![(key.clone(), second.clone())]).await,
            "second put"
        );
        let got = ok!(s.backend.get(std::slice::from_ref(&key)).await, "get");
        ensure!(
            got[0].as_ref().is_some_and(|c| same(c, &second)),
            "get did not return the second value"
        );
        Outcome::Passed
    })
}

/// Removed keys are gone; `remove` counts only keys that existed.
pub fn delete(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let keys = fresh_keys(2);
        ok!(
            s.backend.put(vec![(keys[0].clone(), chunk(1024, 1))]).await,
            "put"
        );
        let n = ok!(s.backend.remove(&keys).await, "remove");
        ensure!(
            n == 1,
            "remove of one present and one absent key returned {n}"
        );
        let found = ok!(s.backend.contains(&keys[..1]).await, "contains");
        ensure!(found == vec![false], "removed key still present");
        let got = ok!(s.backend.get(&keys[..1]).await, "get");
        ensure!(got[0].is_none(), "removed key still readable");
        let again = ok!(s.backend.remove(&keys[..1]).await, "second remove");
        ensure!(again == 0, "second remove returned {again}");
        Outcome::Passed
    })
}

/// Keys never stored are absent, not errors.
pub fn missing_keys(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let keys = fresh_keys(3);
        let found = ok!(s.backend.contains(&keys).await, "contains");
        ensure!(
            found == vec![false; 3],
            "contains of missing keys returned {found:?}"
        );
        let got = ok!(s.backend.get(&keys).await, "get");
        ensure!(
            got.len() == 3 && got.iter().all(Option::is_none),
            "get of missing keys returned values"
        );
        Outcome::Passed
    })
}

/// Empty batches are valid no-ops.
pub fn empty_batch(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        ensure!(
            ok!(s.backend.contains(&[]).await, "contains").is_empty(),
            "contains([]) not empty"
        );
        ensure!(
            ok!(s.backend.get(&[]).await, "get").is_empty(),
            "get([]) not empty"
        );
        let out = ok!(s.backend.put(Vec::new()).await, "put");
        ensure!(out.stored == 0, "put([]) stored {}", out.stored);
        ensure!(
            ok!(s.backend.remove(&[]).await, "remove") == 0,
            "remove([]) not 0"
        );
        Outcome::Passed
    })
}

/// Concurrent puts and gets of different keys and of one shared key: every read is either
/// absent or exactly one of the values written, never a mix.
pub fn concurrent_access(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let shared = fresh_keys(1).remove(0);
        let own = fresh_keys(8);
        let candidates: Arc<Vec<Chunk>> =
            Arc::new((0..8).map(|i| chunk(64 << 10, 100 + i)).collect());
        let mut tasks = tokio::task::JoinSet::new();
        for (i, key) in own.into_iter().enumerate() {
            let (backend, shared, candidates) =
                (s.backend.clone(), shared.clone(), candidates.clone());
            tasks.spawn(async move {
                let mine = chunk(32 << 10, i as u64);
                for round in 0..4 {
                    backend
                        .put(vec![
                            (key.clone(), mine.clone()),
                            (shared.clone(), candidates[i].clone()),
                        ])
                        .await
                        .map_err(|e| format!("put: {e}"))?;
                    let got = backend
                        .get(&[key.clone(), shared.clone()])
                        .await
                        .map_err(|e| format!("get: {e}"))?;
                    match &got[0] {
                        None => {
                            return Err(format!(
                                "task {i} round {round}: own key missing right after its put"
                            ));
                        }
                        Some(c) if !same(c, &mine) => {
                            return Err(format!("task {i} round {round}: own key read back wrong"));
                        }
                        Some(_) => {}
                    }
                    if let Some(c) = &got[1]
                        && !candidates.iter().any(|v| same(c, v))
                    {
                        return Err(format!(
                            "task {i} round {round}: shared key read a torn value"
                        ));
                    }
                }
                Ok::<(), String>(())
            });
        }
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Outcome::Failed(e),
                Err(e) => return Outcome::Failed(format!("task panicked: {e}")),
            }
        }
        Outcome::Passed
    })
}

/// One batch of 256 entries in, one batch of 256 keys out.
pub fn large_batch(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let keys = fresh_keys(256);
        let values: Vec<Chunk> = (0..256).map(|i| chunk(4096, i)).collect();
        let entries = keys.iter().cloned().zip(values.iter().cloned()).collect();
        let out = ok!(s.backend.put(entries).await, "put");
        ensure!(out.stored == 256, "stored {} of 256", out.stored);
        let got = ok!(s.backend.get(&keys).await, "get");
        ensure!(got.len() == 256, "get returned {} values", got.len());
        for (i, (g, v)) in got.iter().zip(&values).enumerate() {
            ensure!(
                g.as_ref().is_some_and(|c| same(c, v)),
                "entry {i} wrong or missing"
            );
        }
        Outcome::Passed
    })
}

/// A value corrupted where it is stored is a miss, and it is removed.
pub fn corrupted_value_rejected(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let Some(corrupt) = s.corrupt.clone() else {
            return Outcome::Skipped("values live in process memory; nothing to corrupt".into());
        };
        let key = fresh_keys(1).remove(0);
        ok!(
            s.backend.put(vec![(key.clone(), chunk(8192, 9))]).await,
            "put"
        );
        corrupt(key.clone()).await;
        let got = ok!(s.backend.get(std::slice::from_ref(&key)).await, "get");
        ensure!(got[0].is_none(), "a corrupted value was returned as data");
        let found = ok!(
            s.backend.contains(std::slice::from_ref(&key)).await,
            "contains"
        );
        ensure!(found == vec![false], "the corrupted entry was not removed");
        Outcome::Passed
    })
}

/// A value copied under another key (a misrouted write, a copy, a collision in a shared
/// store) passes every checksum, yet it is a miss: values are bound to their keys.
pub fn value_under_wrong_key_rejected(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let Some(copy) = s.copy_raw.clone() else {
            return Outcome::Skipped("values live in process memory, owned by their keys".into());
        };
        let keys = fresh_keys(2);
        let value = chunk(4096, 11);
        ok!(
            s.backend.put(vec![(keys[0].clone(), value.clone())]).await,
            "put"
        );
        copy(keys[0].clone(), keys[1].clone()).await;
        let got = ok!(s.backend.get(&keys).await, "get");
        ensure!(
            got[0].as_ref().is_some_and(|c| same(c, &value)),
            "the original value was lost"
        );
        ensure!(
            got[1].is_none(),
            "a value copied under another key was returned as data"
        );
        Outcome::Passed
    })
}

/// After `close`, every operation returns an error.
pub fn close_then_use_errors(s: Subject) -> BoxFuture<Outcome> {
    Box::pin(async move {
        let key = fresh_keys(1).remove(0);
        ok!(
            s.backend.put(vec![(key.clone(), chunk(1024, 1))]).await,
            "put"
        );
        ok!(s.backend.close().await, "close");
        ensure!(
            s.backend
                .put(vec![(key.clone(), chunk(1024, 2))])
                .await
                .is_err(),
            "put after close succeeded"
        );
        ensure!(
            s.backend.get(std::slice::from_ref(&key)).await.is_err(),
            "get after close succeeded"
        );
        ensure!(
            s.backend
                .contains(std::slice::from_ref(&key))
                .await
                .is_err(),
            "contains after close succeeded"
        );
        Outcome::Passed
    })
}

/// Every check, by name.
pub const CHECKS: &[(&str, CheckFn)] = &[
    ("round_trip_sizes", round_trip_sizes),
    ("exists_batch", exists_batch),
    ("overwrite", overwrite),
    ("delete", delete),
    ("missing_keys", missing_keys),
    ("empty_batch", empty_batch),
    ("concurrent_access", concurrent_access),
    ("large_batch", large_batch),
    ("corrupted_value_rejected", corrupted_value_rejected),
    (
        "value_under_wrong_key_rejected",
        value_under_wrong_key_rejected,
    ),
    ("close_then_use_errors", close_then_use_errors),
];

/// Runs every check, each on a fresh subject from `factory`.
pub async fn run_all<F, Fut>(factory: &F) -> Vec<CheckResult>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Subject>,
{
    let mut results = Vec::with_capacity(CHECKS.len());
    for (name, check) in CHECKS {
        let subject = factory().await;
        let outcome = check(subject).await;
        results.push(CheckResult { name, outcome });
    }
    results
}

/// Environment variable naming a file to which [`assert_all_passed`] appends one
/// `backend<TAB>check<TAB>outcome` line per check (used by `cargo xtask matrix`).
pub const REPORT_ENV: &str = "KVPOOL_CONFORMANCE_REPORT";

/// Prints the results (and appends them to the [`REPORT_ENV`] file, if set), then panics,
/// listing the failures, if any check failed.
pub fn assert_all_passed(backend: &str, results: &[CheckResult]) {
    let mut report = String::new();
    for r in results {
        println!("conformance {backend} {}: {}", r.name, r.outcome);
        report.push_str(&format!("{backend}\t{}\t{}\n", r.name, r.outcome));
    }
    if let Ok(path) = std::env::var(REPORT_ENV) {
        use std::io::Write;
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(report.as_bytes()));
        if let Err(e) = written {
            eprintln!("cannot append conformance results to {path}: {e}");
        }
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Failed(_)))
        .map(|r| format!("{}: {}", r.name, r.outcome))
        .collect();
    assert!(
        failed.is_empty(),
        "{backend} failed conformance checks:\n{}",
        failed.join("\n")
    );
}
