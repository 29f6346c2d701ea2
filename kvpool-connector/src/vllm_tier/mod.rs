//! kvpool as a secondary tier under vLLM's native offloading (`TieringOffloadingSpec`): jobs
//! that move whole chunks (rows) of vLLM's CPU primary region to and from kvpool's tiers on
//! kvpool's runtime, and lookups that answer "retry" while a lower tier is asked.
//!
//! vLLM's primary tier is one host region of `rows × row_bytes`, one row per offloaded chunk
//! holding every TP rank's part, addressed by row id; vLLM pins a job's rows until the job is
//! reported finished. The Python side (`kvpool.vllm.tier.KvpoolTier`) only forwards vLLM's calls:
//! no KV byte becomes a Python object, and no code here touches GPU memory.
//!
//! A row is stored as one kvpool chunk under vLLM's `OffloadKey` (block hash and group), in a
//! scope bound to the model's weights, the TP world and the row's layout
//! ([`pool_config_for_offload_tier`]). Lower tiers verify the value's header (key, scope,
//! layout fingerprint, checksum) before a byte is handed out, and a load also checks the
//! value's length: a value that does not match is a miss, never data.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvpool_core::{
    CacheKey, Chunk, ChunkHash, ChunkMeta, ConfigError, Dtype, HashAlgorithm, KeyScope, PoolConfig,
    StorageManager,
};
use parking_lot::{Condvar, Mutex};
use tokio::runtime::Runtime;

use crate::opaque_values::{ValueScope, pool_config_for_values};

/// How long a lookup's answer from a lower tier is reused before the tier is asked again.
pub const LOOKUP_ANSWER_TTL: Duration = Duration::from_secs(2);

/// At most this many lookup answers are remembered (pending or answered); past it, keys not
/// in L1 are misses until answers expire.
pub const MAX_REMEMBERED_LOOKUPS: usize = 65_536;

/// Fits the user's pool config to vLLM's primary region: one chunk is one row of `row_bytes`
/// ([`pool_config_for_values`]), and the key scope is `model_scope` (the served name bound to
/// the weights and the row layout), the TP `world_size` (a row holds every rank's part) and
/// rank 0.
pub fn pool_config_for_offload_tier(
    base: &PoolConfig,
    model_scope: &str,
    world_size: u32,
    row_bytes: usize,
) -> Result<PoolConfig, ConfigError> {
    let scope = ValueScope {
        model: model_scope,
        world_size,
        rank: 0,
        pp_rank: 0,
    };
    pool_config_for_values(base, scope, row_bytes, "vLLM's primary rows")
}

/// vLLM's primary region: `rows` rows of `row_bytes` at `base`.
#[derive(Debug, Clone, Copy)]
pub struct PrimaryRegion {
    base: usize,
    rows: usize,
    row_bytes: usize,
}

impl PrimaryRegion {
    /// The region at `base`; refused when `base` is null or the region's end does not fit
    /// the address space.
    ///
    /// # Safety
    ///
    /// `base .. base + rows * row_bytes` must stay valid for reads and writes for as long as
    /// any [`OffloadTier`] built on it lives, and a row named by a job must not be touched by
    /// anyone else until that job is reported finished (vLLM pins a job's rows).
    pub unsafe fn new(
        base: usize,
        rows: usize,
        row_bytes: usize,
    ) -> Result<Self, crate::address_range::AddressRangeError> {
        crate::address_range::strided_range_end(
            "vLLM's primary region",
            base,
            rows,
            row_bytes,
            row_bytes,
        )?;
        Ok(Self {
            base,
            rows,
            row_bytes,
        })
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Rows in the region.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Why a job of `keys` keys over `rows` does not fit this region (`None`: it fits): as
    /// many rows as keys, each inside the region.
    pub fn job_refusal(&self, keys: usize, rows: &[usize]) -> Option<String> {
        if keys != rows.len() {
            return Some(format!("{keys} keys but {} rows", rows.len()));
        }
        rows.iter()
            .find(|&&row| row >= self.rows)
            .map(|row| format!("row {row} is outside the region's {} rows", self.rows))
    }

    /// The address of row `row` (one [`PrimaryRegion::job_refusal`] found inside the region).
    pub fn row_address(&self, row: usize) -> usize {
        debug_assert!(row < self.rows);
        self.base + row * self.row_bytes
    }

    fn row_ptr(&self, row: usize) -> *mut u8 {
        self.row_address(row) as *mut u8
    }
}

/// A lookup's answer, as vLLM's `LookupResult`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierLookup {
    /// Not stored (or not answered in time to say otherwise).
    Miss,
    /// Stored and ready to load.
    Hit,
    /// A lower tier is being asked: ask again later.
    Retry,
}

/// A finished job, as vLLM's `JobResult`.
#[derive(Debug, Clone, PartialEq)]
pub struct TierJobResult {
    /// vLLM's job id.
    pub job_id: u64,
    /// Every row of the job was stored (store) or loaded (load).
    pub success: bool,
    /// For a load: how many leading keys of the job were loaded into their rows.
    pub loaded: Option<usize>,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from submission to completion.
    pub seconds: f64,
}

#[derive(Debug, Clone, Copy)]
enum Remembered {
    Pending,
    Answered { hit: bool, at: Instant },
}

/// Lookup answers remembered per chunk hash, and when they were last swept.
struct Lookups {
    answers: HashMap<ChunkHash, Remembered>,
    last_sweep: Instant,
}

impl Default for Lookups {
    fn default() -> Self {
        Lookups {
            answers: HashMap::new(),
            last_sweep: Instant::now(),
        }
    }
}

impl Lookups {
    fn answer(&mut self, hash: ChunkHash, hit: bool) {
        self.answers.insert(
            hash,
            Remembered::Answered {
                hit,
                at: Instant::now(),
            },
        );
    }
}

#[derive(Default)]
struct Shared {
    finished: Mutex<Vec<TierJobResult>>,
    lookups: Mutex<Lookups>,
    in_flight: AtomicUsize,
    idle: Condvar,
    idle_lock: Mutex<()>,
}

impl Shared {
    fn finish(&self, result: TierJobResult) {
        self.finished.lock().push(result);
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = self.idle_lock.lock();
            self.idle.notify_all();
        }
    }
}

/// A job on its way: what its background task needs, and its report. A job dropped without
/// a report (its task panicked, or the runtime shut down) reports itself failed, so vLLM never
/// waits for it (its rows stay pinned until then) and `drain` ends.
struct Job {
    id: u64,
    started: Instant,
    keys: Vec<CacheKey>,
    rows: Vec<usize>,
    storage: Arc<StorageManager>,
    shared: Arc<Shared>,
    region: PrimaryRegion,
    meta: ChunkMeta,
    is_load: bool,
    reported: bool,
}

impl Job {
    /// Reports the job finished, having moved `rows_moved` rows.
    fn finish(mut self, success: bool, loaded: Option<usize>, rows_moved: usize) {
        self.report(success, loaded, rows_moved);
    }

    fn report(&mut self, success: bool, loaded: Option<usize>, rows_moved: usize) {
        self.reported = true;
        if self.is_load && !success {
            // What did not load must not stay a remembered hit: vLLM would promote it again.
            let mut lookups = self.shared.lookups.lock();
            for key in self.keys.iter().skip(loaded.unwrap_or(0)) {
                lookups.answer(key.hash, false);
            }
        }
        self.shared.finish(TierJobResult {
            job_id: self.id,
            success,
            loaded,
            bytes: (rows_moved * self.region.row_bytes) as u64,
            seconds: self.started.elapsed().as_secs_f64(),
        });
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.reported {
            tracing::warn!(
                job_id = self.id,
                "offload tier: job ended without a result; reported failed"
            );
            let loaded = self.is_load.then_some(0);
            self.report(false, loaded, 0);
        }
    }
}

/// A lookup's background read: dropped without an answer (panic, shutdown), it answers "miss",
/// so the key does not stay "retry" for ever.
struct LookupRead {
    shared: Arc<Shared>,
    hash: ChunkHash,
    answered: bool,
}

impl LookupRead {
    fn answer(mut self, hit: bool) {
        self.answered = true;
        self.shared.lookups.lock().answer(self.hash, hit);
    }
}

impl Drop for LookupRead {
    fn drop(&mut self) {
        if !self.answered {
            self.shared.lookups.lock().answer(self.hash, false);
        }
    }
}

/// kvpool as one secondary tier of vLLM's offloading: every method returns at once; jobs run
/// on kvpool's runtime and are collected with [`OffloadTier::finished`].
pub struct OffloadTier {
    storage: Arc<StorageManager>,
    runtime: Arc<Runtime>,
    scope: Arc<KeyScope>,
    region: PrimaryRegion,
    meta: ChunkMeta,
    hasher: HashAlgorithm,
    /// What every key's hash chains from: the fixed root, or a random one after a reset.
    root: Mutex<ChunkHash>,
    closed: AtomicBool,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for OffloadTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadTier")
            .field("scope", &self.scope)
            .field("rows", &self.region.rows)
            .field("row_bytes", &self.region.row_bytes)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl OffloadTier {
    /// A tier over `storage` (built from a config fitted by [`pool_config_for_offload_tier`],
    /// whose key scope is `scope`) moving rows of `region`; `tokens_per_row` is only counted.
    pub fn new(
        storage: Arc<StorageManager>,
        runtime: Arc<Runtime>,
        scope: KeyScope,
        region: PrimaryRegion,
        tokens_per_row: u32,
        hasher: HashAlgorithm,
    ) -> Self {
        let meta = ChunkMeta {
            layout_fingerprint: scope.layout_fingerprint,
            dtype: Dtype::F16,
            token_count: tokens_per_row.max(1),
        };
        Self {
            storage,
            runtime,
            scope: Arc::new(scope),
            region,
            meta,
            hasher,
            root: Mutex::new(hasher.root()),
            closed: AtomicBool::new(false),
            shared: Arc::new(Shared::default()),
        }
    }

    /// What vLLM's `reset_cache` means for the tier (sleep, resume, or new weights pushed into
    /// the running engine, which change no file and so no scope): waits for the jobs in flight,
    /// then chains every later key from a fresh random root and forgets remembered lookups, so
    /// nothing stored before is ever loaded again. Restarted engines start from the fixed root
    /// and share what their weights' files allow.
    pub fn reset(&self) {
        self.drain();
        let salt: [u8; 16] = rand::random();
        *self.root.lock() = self.hasher.chain_extra(&self.hasher.root(), &salt);
        self.shared.lookups.lock().answers.clear();
    }

    /// The kvpool key of vLLM's `OffloadKey` bytes.
    pub fn key_of(&self, offload_key: &[u8]) -> CacheKey {
        let root = *self.root.lock();
        let hash = self.hasher.chain_blocks(&root, &[offload_key]);
        CacheKey::new(self.scope.clone(), hash)
    }

    /// Whether a chunk is stored: L1 answers at once; otherwise the first call starts reading
    /// it from the lower tiers (verified, and promoted into L1 for the load that follows) and
    /// answers [`TierLookup::Retry`] until they have answered; the answer is reused for
    /// [`LOOKUP_ANSWER_TTL`].
    pub fn lookup(&self, offload_key: &[u8]) -> TierLookup {
        if self.closed.load(Ordering::Acquire) {
            return TierLookup::Miss;
        }
        let key = self.key_of(offload_key);
        if self.storage.l1_tier().is_some()
            && self
                .runtime
                .block_on(self.storage.l1_prefix(std::slice::from_ref(&key)))
                == 1
        {
            return TierLookup::Hit;
        }
        if self.storage.tier_count() <= usize::from(self.storage.l1_tier().is_some()) {
            return TierLookup::Miss;
        }
        let mut lookups = self.shared.lookups.lock();
        match lookups.answers.get(&key.hash) {
            Some(Remembered::Pending) => return TierLookup::Retry,
            Some(Remembered::Answered { hit, at }) if at.elapsed() < LOOKUP_ANSWER_TTL => {
                return if *hit {
                    TierLookup::Hit
                } else {
                    TierLookup::Miss
                };
            }
            _ => {}
        }
        if lookups.answers.len() >= MAX_REMEMBERED_LOOKUPS {
            // Expired answers go at most once per TTL: a full map costs a scheduler step one
            // sweep, not one per lookup; while it stays full, new keys are misses.
            if lookups.last_sweep.elapsed() < LOOKUP_ANSWER_TTL {
                return TierLookup::Miss;
            }
            lookups.last_sweep = Instant::now();
            lookups.answers.retain(|_, r| match r {
                Remembered::Pending => true,
                Remembered::Answered { at, .. } => at.elapsed() < LOOKUP_ANSWER_TTL,
            });
            if lookups.answers.len() >= MAX_REMEMBERED_LOOKUPS {
                return TierLookup::Miss;
            }
        }
        lookups.answers.insert(key.hash, Remembered::Pending);
        drop(lookups);
        let storage = self.storage.clone();
        let read = LookupRead {
            shared: self.shared.clone(),
            hash: key.hash,
            answered: false,
        };
        self.runtime.spawn(async move {
            // A get, not an existence check: the value is verified (a corrupt or misplaced one
            // is a miss, and is deleted) and promoted into L1, where the load will find it.
            let hit = storage.get(std::slice::from_ref(&key)).await.len() == 1;
            read.answer(hit);
        });
        TierLookup::Retry
    }

    /// Starts a job: checks its shape (a bad one finishes at once as failed) and gathers what
    /// its background task needs.
    fn start(&self, job_id: u64, keys: &[Vec<u8>], rows: Vec<usize>, is_load: bool) -> Option<Job> {
        self.shared.in_flight.fetch_add(1, Ordering::AcqRel);
        let job = Job {
            is_load,
            reported: false,
            id: job_id,
            started: Instant::now(),
            keys: keys.iter().map(|k| self.key_of(k)).collect(),
            rows,
            storage: self.storage.clone(),
            shared: self.shared.clone(),
            region: self.region,
            meta: self.meta,
        };
        if self.closed.load(Ordering::Acquire) {
            tracing::warn!(job_id, "offload tier: job after close; reported failed");
            job.finish(false, is_load.then_some(0), 0);
            return None;
        }
        if let Some(reason) = self.region.job_refusal(job.keys.len(), &job.rows) {
            tracing::warn!(job_id, "offload tier: job refused: {reason}");
            job.finish(false, is_load.then_some(0), 0);
            return None;
        }
        Some(job)
    }

    /// Stores rows `rows[i]` of the primary region under `keys[i]`, in the background: each row
    /// is copied into kvpool memory, then put into L1 and written behind to the lower tiers.
    pub fn submit_store(&self, job_id: u64, keys: Vec<Vec<u8>>, rows: Vec<usize>) {
        let Some(job) = self.start(job_id, &keys, rows, false) else {
            return;
        };
        self.runtime.spawn(async move {
            let row_bytes = job.region.row_bytes;
            let mut entries = Vec::with_capacity(job.rows.len());
            for (key, &row) in job.keys.iter().zip(&job.rows) {
                let Ok(mut buf) = job.storage.allocate(row_bytes) else {
                    break;
                };
                // SAFETY: `row < region.rows` (checked in `start`), the region is valid for
                // the tier's life and vLLM keeps this job's rows pinned until it is reported.
                let src = unsafe { std::slice::from_raw_parts(job.region.row_ptr(row), row_bytes) };
                buf.as_mut_slice().copy_from_slice(src);
                let data = buf.freeze();
                entries.push((
                    key.clone(),
                    Chunk {
                        meta: job.meta,
                        data,
                    },
                ));
            }
            let copied = entries.len();
            let stored = copied == job.rows.len()
                && match job.storage.put(entries).await {
                    Ok(outcome) => outcome.skipped == 0,
                    Err(e) => {
                        tracing::warn!(job_id = job.id, error = %e, "offload tier: store failed");
                        false
                    }
                };
            job.finish(stored, None, copied);
        });
    }

    /// Loads `keys[i]` into rows `rows[i]` of the primary region, in the background. The
    /// longest available prefix of the keys is fetched (promoted into L1 on the way) and
    /// written; a value of another length ends the prefix.
    pub fn submit_load(&self, job_id: u64, keys: Vec<Vec<u8>>, rows: Vec<usize>) {
        let Some(job) = self.start(job_id, &keys, rows, true) else {
            return;
        };
        self.runtime.spawn(async move {
            let row_bytes = job.region.row_bytes;
            let chunks = job.storage.get(&job.keys).await;
            let mut loaded = 0;
            for (chunk, &row) in chunks.iter().zip(&job.rows) {
                if chunk.data.len() != row_bytes
                    || chunk.meta.layout_fingerprint != job.meta.layout_fingerprint
                {
                    tracing::warn!(
                        job_id = job.id,
                        len = chunk.data.len(),
                        row_bytes,
                        "offload tier: a stored value does not fit the row; loading stops there"
                    );
                    break;
                }
                // SAFETY: as in `submit_store`; the destination row is pinned for this job
                // and written by it alone.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(job.region.row_ptr(row), row_bytes) };
                dst.copy_from_slice(chunk.data.as_slice());
                loaded += 1;
            }
            let all = loaded == job.rows.len();
            job.finish(all, Some(loaded), loaded);
        });
    }

    /// Jobs finished since the last call.
    pub fn finished(&self) -> Vec<TierJobResult> {
        std::mem::take(&mut *self.shared.finished.lock())
    }

    /// Jobs submitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// Blocks until no job is in flight (every tier call is bounded by its timeout, so this
    /// ends). Results stay queued for [`OffloadTier::finished`].
    pub fn drain(&self) {
        let mut guard = self.shared.idle_lock.lock();
        while self.in_flight() > 0 {
            self.shared
                .idle
                .wait_for(&mut guard, Duration::from_millis(50));
        }
    }

    /// Refuses every later job and lookup, drains, then flushes write-behind and closes the
    /// tiers. After it returns nothing reads or writes the primary region.
    pub fn close(&self) -> Result<(), kvpool_core::BackendError> {
        self.closed.store(true, Ordering::Release);
        self.drain();
        self.runtime.block_on(async {
            self.storage.flush().await?;
            self.storage.close().await
        })
    }
}

#[cfg(test)]
mod tests;
