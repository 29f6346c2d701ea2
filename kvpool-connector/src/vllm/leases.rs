//! Lookup leases: the in-memory chunks a lookup promised (L1's, and those it loaded from the
//! node's pool daemon), held from the scheduler's lookup until the worker loads them or the
//! request ends, so saves in between cannot evict what was promised.
//!
//! A lease holds the chunks themselves (their memory stays alive even if L1 evicts the keys),
//! so the load reads exactly what the lookup saw. Leases are bounded: in bytes (a lookup that
//! would pass the budget leases only what fits, and promises only that much from memory) and in
//! time (a lease not taken within its time to live is dropped, so a request the engine forgot
//! cannot pin memory for ever).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvpool_core::{CacheEngine, CacheKey, Chunk, ChunkHash, SharedChunk};
use parking_lot::Mutex;

/// How long an untaken lease lives by default.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

/// A leased chunk: in this process's memory (L1), or lent by the node's pool daemon where it
/// lies in shared memory, for the load to copy once into the engine's blocks and check there.
#[derive(Debug)]
pub enum LeasedChunk {
    /// A chunk in this process's memory, checked.
    Held(Chunk),
    /// A chunk in node memory, pinned, its payload not yet checked (see [`SharedChunk`]).
    Shared {
        /// The chunk.
        chunk: SharedChunk,
        /// The tier that lent it.
        tier: String,
    },
}

impl LeasedChunk {
    /// Bytes of the chunk's KV.
    pub fn len(&self) -> usize {
        match self {
            LeasedChunk::Held(c) => c.data.len(),
            LeasedChunk::Shared { chunk, .. } => chunk.payload_len(),
        }
    }

    /// Whether the chunk holds no KV.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One request's leased chunks: the leading chunks of its lookup, in order.
#[derive(Debug)]
pub struct Lease {
    /// Chunk hashes and the chunks, in chain order from the first chunk.
    pub chunks: Vec<(ChunkHash, LeasedChunk)>,
    bytes: usize,
    expires: Instant,
}

#[derive(Debug, Default)]
struct LeaseState {
    by_request: HashMap<String, Lease>,
    bytes: usize,
    expired: u64,
}

/// What a lookup found: chunks in any tier, and how many of the leading ones are leased in
/// memory (a load of those cannot miss and needs no I/O).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LookupAnswer {
    /// Leading chunks some tier holds.
    pub chunks: usize,
    /// Leading chunks held in memory under the request's lease (at most `chunks`).
    pub leased: usize,
}

/// The leases of one worker's pool, shared by its lookup server and its worker.
#[derive(Debug)]
pub struct LeaseTable {
    state: Mutex<LeaseState>,
    max_bytes: usize,
    ttl: Duration,
    /// Whether the worker checks its loads' copies in the engine's blocks, so a lookup may
    /// lease node memory where it lies ([`LeasedChunk::Shared`]).
    checks_copies: AtomicBool,
}

/// A snapshot of a lease table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Requests holding a lease.
    pub leases: usize,
    /// Bytes of chunk memory leased.
    pub bytes: usize,
    /// Leases dropped because nobody took them in time.
    pub expired: u64,
}

impl LeaseTable {
    /// A table holding at most `max_bytes` of chunks, each lease for at most `ttl`.
    pub fn new(max_bytes: usize, ttl: Duration) -> Self {
        LeaseTable {
            state: Mutex::new(LeaseState::default()),
            max_bytes,
            ttl,
            checks_copies: AtomicBool::new(false),
        }
    }

    /// Says whether the worker can check a load's copy in the engine's blocks (it reads them:
    /// host memory), so lookups may lease chunks of node memory where they lie.
    pub fn set_checks_copies(&self, checks: bool) {
        self.checks_copies.store(checks, Ordering::Release);
    }

    /// Whether lookups may lease chunks of node memory where they lie.
    pub fn checks_copies(&self) -> bool {
        self.checks_copies.load(Ordering::Acquire)
    }

    fn expire(&self, st: &mut LeaseState, now: Instant) {
        let before = st.by_request.len();
        let mut freed = 0;
        st.by_request.retain(|_, l| {
            let keep = l.expires > now;
            if !keep {
                freed += l.bytes;
            }
            keep
        });
        st.bytes -= freed;
        st.expired += (before - st.by_request.len()) as u64;
    }

    /// Replaces `req_id`'s lease with the leading `chunks` that fit the byte budget; returns
    /// how many were leased.
    pub fn grant(&self, req_id: &str, chunks: Vec<(ChunkHash, LeasedChunk)>) -> usize {
        let now = Instant::now();
        let mut st = self.state.lock();
        self.expire(&mut st, now);
        if let Some(old) = st.by_request.remove(req_id) {
            st.bytes -= old.bytes;
        }
        let mut bytes = 0;
        let fitting = chunks
            .iter()
            .take_while(|(_, c)| {
                let next = bytes + c.len();
                let fits = st.bytes + next <= self.max_bytes;
                if fits {
                    bytes = next;
                }
                fits
            })
            .count();
        if fitting == 0 {
            return 0;
        }
        let mut chunks = chunks;
        chunks.truncate(fitting);
        st.bytes += bytes;
        st.by_request.insert(
            req_id.to_string(),
            Lease {
                chunks,
                bytes,
                expires: now + self.ttl,
            },
        );
        self.record(&st);
        fitting
    }

    /// Bytes a new lease for `req_id` could hold now (the budget less every other request's
    /// lease: a grant replaces the request's own).
    pub fn room_for(&self, req_id: &str) -> usize {
        let mut st = self.state.lock();
        self.expire(&mut st, Instant::now());
        let own = st.by_request.get(req_id).map_or(0, |l| l.bytes);
        self.max_bytes.saturating_sub(st.bytes - own)
    }

    /// Takes `req_id`'s lease (the load uses its chunks); `None` if it has none.
    pub fn take(&self, req_id: &str) -> Option<Lease> {
        let mut st = self.state.lock();
        self.expire(&mut st, Instant::now());
        let lease = st.by_request.remove(req_id)?;
        st.bytes -= lease.bytes;
        self.record(&st);
        Some(lease)
    }

    /// Ends `req_id`'s lease, if any (the request finished or was aborted).
    pub fn release(&self, req_id: &str) {
        drop(self.take(req_id));
    }

    /// Current leases and bytes, and leases expired so far.
    pub fn stats(&self) -> LeaseStats {
        let st = self.state.lock();
        LeaseStats {
            leases: st.by_request.len(),
            bytes: st.bytes,
            expired: st.expired,
        }
    }

    fn record(&self, st: &LeaseState) {
        metrics::gauge!(kvpool_core::telemetry::LEASED_BYTES).set(st.bytes as f64);
    }
}

/// The most bytes of KV one lookup loads from a tier that [reads node
/// memory](kvpool_core::StorageManager::tier_reads_node_memory). The scheduler waits for the
/// load, so it is bounded like a synchronous L1 load's copy (tens of milliseconds); a larger
/// hit is left whole to an asynchronous load.
pub const NODE_MEMORY_LOAD_MAX_BYTES: usize = 256 << 20;

/// How long a lookup may spend loading chunks from a tier that reads node memory before it
/// leaves them to an asynchronous load: a safety net for an overloaded daemon (a copy of
/// [`NODE_MEMORY_LOAD_MAX_BYTES`] out of shared memory takes far less).
pub const NODE_MEMORY_LOAD_BUDGET: Duration = Duration::from_millis(500);

/// How many leading chunks of `chunk_hashes` `engine`'s pool holds (any tier), leasing the
/// leading run held in memory under `req_id` (no lease when `req_id` is empty).
///
/// Held in memory means: in L1, then, with `load_node_memory` and when every chunk after L1's
/// prefix was found in one tier that reads node memory (the node's pool daemon), those
/// chunks, when they fit the lease budget's room and [`NODE_MEMORY_LOAD_MAX_BYTES`], within
/// [`NODE_MEMORY_LOAD_BUDGET`]. Where the worker checks its copies
/// ([`LeaseTable::checks_copies`]: an engine whose KV blocks are in host memory) and the tier
/// lends its memory, the lookup pins them where they lie, and the load copies each once into
/// the engine's blocks and checks the copy there; otherwise the lookup loads them into L1
/// (promoting them), decoded and checked like any lower tier's. Either way the request loads
/// them before its forward pass like an L1 hit. A hit the lookup cannot complete this way is
/// loaded asynchronously.
///
/// A chunk L1 reported but lost before it could be leased ends the answer there: a promise
/// is only made for what is held or what a lower tier reported.
pub async fn lookup_and_lease(
    engine: &CacheEngine,
    leases: &LeaseTable,
    req_id: &str,
    chunk_hashes: &[ChunkHash],
    load_node_memory: bool,
) -> LookupAnswer {
    if chunk_hashes.is_empty() {
        return LookupAnswer::default();
    }
    let scope = engine.token_database().scope();
    let keys: Vec<CacheKey> = chunk_hashes
        .iter()
        .map(|h| CacheKey::new(scope.clone(), *h))
        .collect();
    let found = engine.storage().lookup(&keys).await;
    let chunk = engine.token_database().chunk_size();
    kvpool_core::cache_engine::record_lookup(keys.len() * chunk, found.len() * chunk);
    let storage = engine.storage();
    let l1 = storage.l1_tier();
    let in_l1 = found.tiers.iter().take_while(|t| Some(**t) == l1).count();
    let node_tier = found.tiers[in_l1..]
        .first()
        .copied()
        .filter(|&t| load_node_memory && l1.is_some() && storage.tier_reads_node_memory(t));
    let in_node_memory = node_tier.map_or(0, |t| {
        found.tiers[in_l1..].iter().take_while(|&&x| x == t).count()
    });
    if req_id.is_empty() || in_l1 + in_node_memory == 0 {
        return LookupAnswer {
            chunks: found.len(),
            leased: 0,
        };
    }
    let held = storage.l1_get_prefix(&keys[..in_l1]).await;
    let got = held.len();
    let room = leases
        .room_for(req_id)
        .saturating_sub(held.iter().map(|c| c.data.len()).sum::<usize>())
        .min(NODE_MEMORY_LOAD_MAX_BYTES);
    let fitting = in_node_memory.min(room / engine.layout().chunk_bytes(chunk).max(1));
    // Only a load that completes the answer makes the request's load synchronous; any other
    // is left to the asynchronous load, off the scheduler's thread.
    let completes = got == in_l1 && fitting == in_node_memory && in_l1 + fitting == found.len();
    let mut held: Vec<LeasedChunk> = held.into_iter().map(LeasedChunk::Held).collect();
    if let (Some(t), true) = (node_tier, completes && fitting > 0) {
        let wanted = &keys[in_l1..in_l1 + fitting];
        // Where the worker checks its copies in the engine's blocks, the chunks stay where
        // they lie, pinned, for one copy into the blocks; else they are copied into L1 and
        // checked there.
        let load = async {
            if leases.checks_copies() && storage.tier_lends_node_memory(t) {
                let pinned = storage.pin_node_memory_prefix(t, wanted).await;
                let tier = &storage.tier_names()[t];
                pinned
                    .into_iter()
                    .map(|chunk| LeasedChunk::Shared {
                        chunk,
                        tier: tier.clone(),
                    })
                    .collect()
            } else {
                let loaded = storage.get_node_memory_prefix(t, wanted).await;
                loaded
                    .into_iter()
                    .map(LeasedChunk::Held)
                    .collect::<Vec<_>>()
            }
        };
        match tokio::time::timeout(NODE_MEMORY_LOAD_BUDGET, load).await {
            Ok(loaded) => held.extend(loaded),
            Err(_) => tracing::warn!(
                tier = %storage.tier_names()[t],
                budget_ms = NODE_MEMORY_LOAD_BUDGET.as_millis() as u64,
                "loading from node memory at lookup ran past its budget; loading asynchronously"
            ),
        }
    }
    let leased = leases.grant(
        req_id,
        chunk_hashes.iter().copied().zip(held).collect::<Vec<_>>(),
    );
    LookupAnswer {
        chunks: if got < in_l1 { got } else { found.len() },
        leased,
    }
}
