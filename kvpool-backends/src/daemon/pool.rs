//! The daemon's pool: shared memory over the lower tiers, answering one engine's request at a
//! time (lookups, pins, saves, promotion from the lower tiers; `write_behind.rs` writes
//! committed values down).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvpool_core::memory::{EvictionKind, MemoryObj};
use kvpool_core::storage::remote::{
    RejectedValue, RemoteConnector, delete_rejected, record_rejected,
};
use kvpool_core::{ConfigError, PoolConfig, PoolError};
use tokio::runtime::Handle;
use tracing::{debug, info, warn};

use super::lower_tiers::{check_stored_value, is_kvpool_key, tier_op_seconds};
use super::protocol::{DaemonStats, Reply, Request};
use super::store::{SessionId, SharedStore};
use super::write_behind::DaemonWriteBehind;
use crate::telemetry;

/// How long a pin or uncommitted allocation lives when its engine neither ends it nor
/// disconnects (an engine copies a value out within one call, so this only bounds a hung one).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

/// The largest request frame the daemon reads (requests carry keys, never values).
pub const MAX_REQUEST_BYTES: usize = 8 << 20;

/// Bytes of request frames (and what decoding them allocates) the daemon holds at once, over
/// all sessions: a request past it is refused ("busy") without being stored, so many engines
/// sending large frames at once cannot grow the daemon's heap past this.
pub const MAX_REQUEST_BYTES_IN_FLIGHT: usize = 256 << 20;

/// The most keys, lengths or entries one request may carry.
pub const MAX_ITEMS_PER_REQUEST: usize = 1 << 16;

/// How long a new connection has to attach.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

/// The tenant name of a daemon without `[[tenant]]`s (in logs and metric labels).
pub const DEFAULT_TENANT: &str = "default";

/// Where tenants' keys live in the lower tiers (`tenant/<name>/...`): refused to an untenanted
/// daemon's engines.
pub const TENANT_PREFIX: &str = "tenant/";

/// A request answered this slowly or slower is logged at `debug` (`kvpool_daemon_request_seconds`
/// times every request).
const SLOW_REQUEST: Duration = Duration::from_millis(10);

/// Bytes of copy buffers a daemon with an arena of `arena_capacity` bytes keeps by default
/// ([`DaemonOptions::copy_buffer_bytes`]): a sixteenth of the arena, resident besides it at
/// most.
pub fn default_copy_buffer_bytes(arena_capacity: usize) -> usize {
    arena_capacity / 16
}

/// The daemon's sizing, from the `[local_cpu]` and `[write_behind]` tables of its config.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    /// The tenant it serves ([`DEFAULT_TENANT`] without tenants): its metrics' label.
    pub tenant: String,
    /// The shared arena's size: the node's memory budget for KV.
    pub capacity: usize,
    /// Which values leave shared memory first.
    pub eviction: EvictionKind,
    /// See [`DEFAULT_LEASE_TTL`].
    pub lease_ttl: Duration,
    /// Bytes of committed values being written to each lower tier at once; more are not
    /// written to that tier (counted).
    pub write_behind_quota: usize,
    /// Bytes of buffers kept between the copies of committed values out of the arena for the
    /// lower tiers ([`default_copy_buffer_bytes`] of the arena); `0` allocates a fresh buffer
    /// for each copy, whose pages the kernel may fault in and zero each time (always, for a
    /// value past glibc's largest mmap threshold, 32 MiB).
    pub copy_buffer_bytes: usize,
}

impl DaemonOptions {
    /// The options `config` describes. A daemon's lower tiers must be stores: one naming a
    /// pool daemon (`kvpool+unix://`) is refused.
    pub fn from_config(config: &PoolConfig) -> Result<Self, ConfigError> {
        for tier in &config.tiers {
            let scheme = tier.url.split_once("://").map_or("", |(s, _)| s);
            if super::SCHEMES.contains(&scheme) {
                return Err(ConfigError::Invalid {
                    field: "tier.url",
                    reason: format!(
                        "`{}` is a pool daemon: a daemon's lower tiers must be stores (file://, redis://, s3://, ...)",
                        kvpool_core::redact_url(&tier.url)
                    ),
                });
            }
        }
        Ok(DaemonOptions {
            tenant: DEFAULT_TENANT.to_string(),
            capacity: config.local_cpu.max_size.as_usize(),
            eviction: config.local_cpu.eviction,
            lease_ttl: DEFAULT_LEASE_TTL,
            write_behind_quota: config.write_behind.quota.as_usize(),
            copy_buffer_bytes: default_copy_buffer_bytes(config.local_cpu.max_size.as_usize()),
        })
    }

    /// These options for tenant `name` with an arena of `memory` bytes (its `[[tenant]]`
    /// table's `memory`), its copy buffers sized by that arena.
    pub fn for_tenant(&self, name: &str, memory: usize) -> Self {
        DaemonOptions {
            tenant: name.to_string(),
            capacity: memory,
            copy_buffer_bytes: default_copy_buffer_bytes(memory),
            ..self.clone()
        }
    }
}

/// The node's pool: shared memory over the lower tiers, answering engines' requests.
pub struct PoolDaemon {
    pub(super) store: SharedStore,
    tiers: Vec<Arc<dyn RemoteConnector>>,
    /// Writes committed values to `tiers`.
    write_behind: DaemonWriteBehind,
    runtime: Handle,
    options: DaemonOptions,
    pub(super) daemon_id: u64,
    next_session: AtomicU64,
    sessions: AtomicU64,
    pub(super) refused: AtomicU64,
    /// Bytes of requests being read and decoded now, over all sessions.
    request_bytes: AtomicUsize,
}

/// A share of [`MAX_REQUEST_BYTES_IN_FLIGHT`], given back on drop.
pub(super) struct RequestBudget<'a> {
    bytes: usize,
    held: &'a AtomicUsize,
}

impl Drop for RequestBudget<'_> {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl PoolDaemon {
    /// A daemon over already opened `tiers` (values are written to every one of them and
    /// read from the first that has them; `kvpool serve` opens its config's `[[tier]]`s with
    /// `registry::open_connectors`).
    pub fn with_tiers(
        options: DaemonOptions,
        tiers: Vec<Arc<dyn RemoteConnector>>,
        runtime: Handle,
    ) -> Result<Self, PoolError> {
        let store = SharedStore::new(options.capacity, options.eviction, options.lease_ttl)?;
        let daemon_id = rand_id();
        let write_behind = DaemonWriteBehind::new(
            &tiers,
            options.write_behind_quota,
            options.capacity,
            options.copy_buffer_bytes,
            runtime.clone(),
            options.tenant.clone(),
        );
        Ok(PoolDaemon {
            store,
            write_behind,
            tiers,
            runtime,
            options,
            daemon_id,
            next_session: AtomicU64::new(1),
            sessions: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            request_bytes: AtomicUsize::new(0),
        })
    }

    /// Runs the writes to lower tier `tier` (its position in `with_tiers`) on `runtime`: the
    /// process's low-priority runtime for a disk tier (see
    /// [`crate::background::write_behind_runtime_for`]). Reads stay on the daemon's runtime.
    ///
    /// # Panics
    ///
    /// If the daemon has no tier at `tier`.
    pub fn write_tier_behind_on(mut self, tier: usize, runtime: Handle) -> Self {
        self.write_behind.write_tier_on(tier, runtime);
        self
    }

    /// Paces the daemon's low-priority work by `pacer` instead of the system's CPU pressure.
    #[cfg(test)]
    pub(super) fn paced_by(mut self, pacer: crate::cpu_pressure::CpuPacer) -> Self {
        self.write_behind.pace_with(pacer);
        self
    }

    /// How long the daemon's low-priority work has paused to give a contested CPU back.
    #[cfg(test)]
    pub(super) fn write_behind_paused(&self) -> Duration {
        self.write_behind.paused()
    }

    /// The nice value of each thread that copied committed values out of the arena for the
    /// lower tiers, in order.
    #[cfg(test)]
    pub(super) fn copying_thread_nices(&self) -> Vec<Option<i32>> {
        self.write_behind
            .copying_thread_nices
            .lock()
            .unwrap()
            .clone()
    }

    /// The daemon's counters.
    pub fn stats(&self) -> DaemonStats {
        DaemonStats {
            sessions: self.sessions.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            tier_writes: self.write_behind.written(),
            ..self.store.stats()
        }
    }

    /// Committed values not written to a lower tier because that tier's write-behind quota
    /// was full (one per tier).
    pub fn write_behind_dropped(&self) -> u64 {
        self.write_behind.dropped()
    }

    /// Committed values not written to a lower tier because its write to that tier was in
    /// flight already (one per tier).
    pub fn write_behind_deduplicated(&self) -> u64 {
        self.write_behind.deduplicated()
    }

    /// Bytes of committed values being written to the lower tiers now (a value written to
    /// two tiers counts in each).
    pub(super) fn write_behind_bytes(&self) -> usize {
        self.write_behind.bytes_in_flight()
    }

    /// Records one call to a lower tier in `kvpool_daemon_tier_op_seconds`.
    fn record_tier_op(&self, tier: &str, op: &'static str, started: Instant) {
        tier_op_seconds(&self.options.tenant, tier, op).record(started.elapsed());
    }

    /// Publishes the counters as Prometheus series (for `[metrics] listen`).
    pub fn record_metrics(&self) {
        let s = self.stats();
        let t = self.options.tenant.clone();
        metrics::gauge!(telemetry::DAEMON_CAPACITY_BYTES, "tenant" => t.clone())
            .set(s.capacity_bytes as f64);
        metrics::gauge!(telemetry::DAEMON_WRITE_BEHIND_BYTES, "tenant" => t.clone())
            .set(self.write_behind_bytes() as f64);
        metrics::counter!(telemetry::DAEMON_WRITE_BEHIND_DROPPED, "tenant" => t.clone())
            .absolute(self.write_behind_dropped());
        metrics::counter!(telemetry::DAEMON_WRITE_BEHIND_DEDUPLICATED, "tenant" => t.clone())
            .absolute(self.write_behind_deduplicated());
        metrics::gauge!(telemetry::DAEMON_SESSIONS, "tenant" => t.clone()).set(s.sessions as f64);
        metrics::gauge!(telemetry::DAEMON_USED_BYTES, "tenant" => t.clone())
            .set(s.used_bytes as f64);
        metrics::gauge!(telemetry::DAEMON_ENTRIES, "tenant" => t.clone()).set(s.entries as f64);
        metrics::gauge!(telemetry::DAEMON_LEASES, "tenant" => t.clone())
            .set((s.pins + s.allocations) as f64);
        for (result, n) in [
            ("memory", s.memory_hits),
            ("tier", s.tier_hits),
            ("miss", s.misses),
        ] {
            metrics::counter!(telemetry::DAEMON_GETS, "tenant" => t.clone(), "result" => result)
                .absolute(n);
        }
        metrics::counter!(telemetry::DAEMON_COMMITS, "tenant" => t.clone()).absolute(s.commits);
        metrics::counter!(telemetry::DAEMON_EVICTIONS, "tenant" => t.clone()).absolute(s.evictions);
        metrics::counter!(telemetry::DAEMON_TIER_WRITES, "tenant" => t.clone())
            .absolute(s.tier_writes);
        metrics::counter!(telemetry::DAEMON_LEASES_RECLAIMED, "tenant" => t.clone())
            .absolute(s.leases_reclaimed);
        metrics::counter!(telemetry::DAEMON_REQUESTS_REFUSED, "tenant" => t).absolute(s.refused);
    }

    /// Waits (at most `limit`) for writes to the lower tiers to end, then closes the tiers.
    pub async fn close(&self, limit: Duration) {
        self.write_behind.wait_idle(limit).await;
        for tier in &self.tiers {
            if let Err(e) = tier.close().await {
                warn!(tier = tier.name(), "closing a lower tier failed: {e}");
            }
        }
    }

    /// `bytes` of the requests-in-flight budget, or `None` when it is spent.
    pub(super) fn request_budget(&self, bytes: usize) -> Option<RequestBudget<'_>> {
        let limit = MAX_REQUEST_BYTES_IN_FLIGHT;
        self.request_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held + bytes <= limit).then_some(held + bytes)
            })
            .ok()
            .map(|_| RequestBudget {
                bytes,
                held: &self.request_bytes,
            })
    }

    pub(super) fn new_session(&self) -> SessionId {
        self.sessions.fetch_add(1, Ordering::Relaxed);
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn end_session(&self, session: SessionId) {
        self.sessions.fetch_sub(1, Ordering::Relaxed);
        let ended = self.store.end_session(session);
        if ended > 0 {
            info!(
                session,
                leases = ended,
                "an engine left holding leases; reclaimed"
            );
        }
    }

    /// Answers one request of `session` (anything but `Attach`), timed by kind
    /// (`kvpool_daemon_request_seconds`; one taking 10 ms or more is logged at `debug`).
    pub fn handle(&self, session: SessionId, request: Request) -> Reply {
        let started = Instant::now();
        let kind = request.kind();
        let items = request.item_count();
        let reply = self.answer(session, request);
        let took = started.elapsed();
        metrics::histogram!(telemetry::DAEMON_REQUEST_SECONDS,
            "tenant" => self.options.tenant.clone(), "kind" => kind)
        .record(took);
        if took >= SLOW_REQUEST {
            debug!(
                session,
                kind,
                items,
                ms = took.as_secs_f64() * 1e3,
                "slow request"
            );
        }
        reply
    }

    fn answer(&self, session: SessionId, request: Request) -> Reply {
        let items = request.item_count();
        if items > MAX_ITEMS_PER_REQUEST {
            return self.refuse(&format!(
                "{items} items in one request (at most {MAX_ITEMS_PER_REQUEST})"
            ));
        }
        // An untenanted daemon over tiers tenants also use must not reach their namespaces.
        if self.options.tenant == DEFAULT_TENANT {
            let tenant_key = |k: &String| k.starts_with(TENANT_PREFIX);
            let touches = match &request {
                Request::Exists { keys }
                | Request::Get { keys }
                | Request::GetResident { keys }
                | Request::Delete { keys } => keys.iter().any(tenant_key),
                Request::Commit { entries } => entries.iter().any(|(_, k)| tenant_key(k)),
                _ => false,
            };
            if touches {
                return self.refuse(&format!(
                    "keys under `{TENANT_PREFIX}` belong to the daemon's tenants"
                ));
            }
        }
        match request {
            Request::Attach { .. } => self.refuse("already attached"),
            Request::Exists { keys } => Reply::Exists(self.exists(&keys)),
            Request::Get { keys } => Reply::Pinned(self.get(session, &keys, true)),
            Request::GetResident { keys } => Reply::Pinned(self.get(session, &keys, false)),
            Request::PrepareSave { lens } => Reply::Prepared(
                lens.iter()
                    .map(|&len| self.store.prepare(session, len as usize))
                    .collect(),
            ),
            Request::Commit { entries } => {
                let committed: Vec<(String, MemoryObj)> = entries
                    .into_iter()
                    .filter_map(|(id, key)| {
                        let value = self.store.commit(session, id, key.clone())?;
                        Some((key, value))
                    })
                    .collect();
                let n = committed.len() as u64;
                self.write_behind.write(committed);
                Reply::Committed(n)
            }
            Request::Release { ids } => {
                self.store.release(session, &ids);
                Reply::Released
            }
            Request::Delete { keys } => {
                // Only shared memory's copy: an engine deletes a value whose copy out of this
                // memory failed its check, and a stray write or a late DMA into the arena must
                // not cost the lower tiers their (good) copies. A bad lower-tier copy is found
                // and deleted where it is read (`get`).
                Reply::Deleted(self.store.remove(&keys) as u64)
            }
            Request::Stats => Reply::Stats(self.stats()),
        }
    }

    pub(super) fn refuse(&self, why: &str) -> Reply {
        self.refused.fetch_add(1, Ordering::Relaxed);
        Reply::Error(why.to_string())
    }

    fn exists(&self, keys: &[String]) -> Vec<bool> {
        let (distinct, index) = distinct_keys(keys);
        let found = self.exists_distinct(&distinct);
        index.iter().map(|&p| found[p]).collect()
    }

    fn exists_distinct(&self, keys: &[String]) -> Vec<bool> {
        let mut found = self.store.contains(keys);
        for tier in &self.tiers {
            let ask: Vec<usize> = (0..keys.len())
                .filter(|&i| !found[i] && is_kvpool_key(&keys[i]))
                .collect();
            if ask.is_empty() {
                break;
            }
            let ask_keys: Vec<String> = ask.iter().map(|&i| keys[i].clone()).collect();
            let started = Instant::now();
            let answer = self.runtime.block_on(tier.batch_exists(&ask_keys));
            self.record_tier_op(tier.name(), "contains", started);
            match answer {
                Ok(answers) => {
                    for (&i, yes) in ask.iter().zip(answers) {
                        found[i] = yes;
                    }
                }
                Err(e) => debug!(tier = tier.name(), "exists failed (a miss): {e}"),
            }
        }
        found
    }

    /// Pins each key's value; with `from_tiers`, a value shared memory lacks is first promoted
    /// from the first lower tier that has it. Without, only the leading run shared memory
    /// holds is pinned (the reader stops at its first miss).
    fn get(
        &self,
        session: SessionId,
        keys: &[String],
        from_tiers: bool,
    ) -> Vec<Option<super::protocol::Region>> {
        // One pin per distinct key: a key named twice gets the same region twice (a request
        // of 65,536 copies of one key pins it once, not 65,536 times).
        let (distinct, index) = distinct_keys(keys);
        let regions = self.get_distinct(session, &distinct, from_tiers);
        let mut missed = false;
        index
            .iter()
            .map(|&p| {
                // Without the tiers, only the leading run: nothing after the first miss.
                let region = if missed { None } else { regions[p] };
                missed |= region.is_none() && !from_tiers;
                region
            })
            .collect()
    }

    fn get_distinct(
        &self,
        session: SessionId,
        keys: &[String],
        from_tiers: bool,
    ) -> Vec<Option<super::protocol::Region>> {
        let mut out: Vec<_> = if from_tiers {
            keys.iter().map(|k| self.store.pin(session, k)).collect()
        } else {
            let mut run: Vec<_> = keys
                .iter()
                .map_while(|k| self.store.pin(session, k).map(Some))
                .collect();
            run.resize(keys.len(), None);
            run
        };
        let mut tier_hits = 0;
        let tiers: &[_] = if from_tiers { &self.tiers } else { &[] };
        for tier in tiers {
            let want: Vec<usize> = (0..keys.len())
                .filter(|&i| out[i].is_none() && is_kvpool_key(&keys[i]))
                .collect();
            if want.is_empty() {
                break;
            }
            let want_keys: Vec<String> = want.iter().map(|&i| keys[i].clone()).collect();
            let started = Instant::now();
            let answer = self.runtime.block_on(tier.batch_get(&want_keys));
            self.record_tier_op(tier.name(), "get", started);
            match answer {
                Ok(values) => {
                    let mut corrupt = Vec::new();
                    for (&i, value) in want.iter().zip(values) {
                        let Some(bytes) = value else { continue };
                        if let Err(e) = check_stored_value(&keys[i], &bytes) {
                            // This tier's copy is bad: a miss, and gone from this tier only.
                            record_rejected(tier.name(), &keys[i], &e);
                            corrupt.push(RejectedValue::new(keys[i].clone(), &bytes));
                            continue;
                        }
                        out[i] = self.store.promote_and_pin(session, &keys[i], &bytes);
                        tier_hits += u64::from(out[i].is_some());
                    }
                    self.runtime
                        .block_on(delete_rejected(tier.as_ref(), corrupt));
                }
                Err(e) => debug!(tier = tier.name(), "get failed (a miss): {e}"),
            }
        }
        let misses = out.iter().filter(|r| r.is_none()).count() as u64;
        self.store.count_lookups(tier_hits, misses);
        out
    }
}

/// `keys` without repeats, in first-seen order, and each key's position among them.
fn distinct_keys(keys: &[String]) -> (Vec<String>, Vec<usize>) {
    let mut position: std::collections::HashMap<&str, usize> =
        std::collections::HashMap::with_capacity(keys.len());
    let mut distinct = Vec::new();
    let index = keys
        .iter()
        .map(|k| {
            *position.entry(k.as_str()).or_insert_with(|| {
                distinct.push(k.clone());
                distinct.len() - 1
            })
        })
        .collect();
    (distinct, index)
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}
