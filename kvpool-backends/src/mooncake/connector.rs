//! `MooncakeConnector`: batches in rounds that fit the staging arena, put-race retries, fail-fast after a cluster failure.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use tracing::{debug, warn};

use kvpool_core::{BackendError, MemoryObjMut, MemoryPool, PoolError, RemoteConnector};

use super::client::*;
use super::config::*;
use super::key_claims::KeyClaims;
use super::staging::*;

pub(super) struct Inner {
    // Field order matters: the client (and its registrations) goes before the staging memory.
    client: Arc<dyn MooncakeStoreClient>,
    staging: MemoryPool,
    /// Largest value seen, so that gets usually need no size lookup first.
    size_hint: AtomicUsize,
    /// While set and in the future, calls fail fast (the cluster just failed one).
    paused_until: Mutex<Option<Instant>>,
    /// Keys this connector is writing now (see [`KeyClaims`]).
    pub(super) writing: KeyClaims,
    retry_after: Duration,
    /// The deadline of every call (see [`MooncakeConfig::call_timeout`]).
    call_timeout: Duration,
    /// Calls past their deadline that Mooncake has not returned from yet; while any is,
    /// new calls fail fast instead of queueing more blocked threads behind it.
    overdue: Arc<AtomicUsize>,
    closed: AtomicBool,
    name: String,
}

/// A call's state, shared by the caller and the thread running it: whichever of the two
/// moves it out of `CALL_RUNNING` first decides whether the call counts as overdue.
const CALL_RUNNING: u8 = 0;
/// The call returned before its deadline.
const CALL_DONE: u8 = 1;
/// The caller gave up at the deadline; the thread uncounts the call when it returns.
const CALL_OVERDUE: u8 = 2;

/// A Mooncake Store [`RemoteConnector`]. Clones share one client and staging arena.
#[derive(Clone)]
pub struct MooncakeConnector {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MooncakeConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeConnector")
            .field("name", &self.inner.name)
            .field("client", &self.inner.client.name())
            .finish()
    }
}

pub(super) fn unavailable(name: &str, reason: impl Into<String>) -> BackendError {
    BackendError::Unavailable {
        backend: name.to_string(),
        reason: reason.into(),
    }
}

impl MooncakeConnector {
    /// Connects through the embedded Python client (see [`super::python`]).
    pub async fn connect(config: &MooncakeConfig) -> Result<Self, BackendError> {
        config
            .validate()
            .map_err(|e| unavailable("mooncake", e.to_string()))?;
        probe_master(config).await?;
        let setup_config = config.clone();
        // A detached thread, not the runtime's blocking pool: Mooncake's setup retries an
        // unreachable master for minutes, and a runtime waits for its blocking tasks on drop.
        let (done, setup) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("mooncake-setup".into())
            .spawn(move || {
                let _ = done.send(super::python::PythonStoreClient::setup(&setup_config));
            })
            .map_err(|e| unavailable("mooncake", format!("cannot start setup thread: {e}")))?;
        let client = match tokio::time::timeout(config.connect_timeout, setup).await {
            Err(_) => {
                return Err(BackendError::Timeout {
                    backend: "mooncake".into(),
                    op: "setup",
                    millis: config.connect_timeout.as_millis() as u64,
                });
            }
            Ok(Err(_)) => return Err(unavailable("mooncake", "the setup thread died")),
            Ok(Ok(Err(reason))) => return Err(unavailable("mooncake", reason)),
            Ok(Ok(Ok(client))) => client,
        };
        Self::with_client(Arc::new(client), config)
    }

    /// Wraps an already set-up client (any implementation of the trait).
    pub fn with_client(
        client: Arc<dyn MooncakeStoreClient>,
        config: &MooncakeConfig,
    ) -> Result<Self, BackendError> {
        let staging = MemoryPool::with_allocator(
            config.staging_bytes as usize,
            &RegisteringAllocator {
                client: client.clone(),
            },
        )
        .map_err(|e| unavailable("mooncake", format!("staging arena: {e}")))?;
        Ok(MooncakeConnector {
            inner: Arc::new(Inner {
                client,
                staging,
                size_hint: AtomicUsize::new(0),
                paused_until: Mutex::new(None),
                writing: KeyClaims::default(),
                retry_after: config.retry_after,
                call_timeout: config.call_timeout,
                overdue: Arc::new(AtomicUsize::new(0)),
                closed: AtomicBool::new(false),
                name: format!("mooncake({})", config.master_server_address),
            }),
        })
    }

    /// Runs the blocking `f` on the blocking pool unless the connector is closed or paused,
    /// and waits at most [`MooncakeConfig::call_timeout`] for it, plus the time the `bytes`
    /// it writes take at [`crate::timeout::SLOWEST_WRITE_BYTES_PER_SEC`]. A cluster failure or a
    /// missed deadline pauses the connector for `retry_after`, and calls fail fast while a
    /// call past its deadline is still inside Mooncake.
    async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        bytes: usize,
        f: impl FnOnce(&Inner) -> Result<T, CallError> + Send + 'static,
    ) -> Result<T, BackendError> {
        let inner = &self.inner;
        let deadline = inner.call_timeout
            + Duration::from_secs_f64(bytes as f64 / crate::timeout::SLOWEST_WRITE_BYTES_PER_SEC);
        if inner.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed(inner.name.clone()));
        }
        let stuck = inner.overdue.load(Ordering::Acquire);
        if stuck > 0 {
            metrics::counter!(crate::telemetry::MOONCAKE_FAST_FAILURES).increment(1);
            return Err(unavailable(
                &inner.name,
                format!(
                    "{op} skipped: {stuck} call(s) past their deadline are still inside Mooncake"
                ),
            ));
        }
        if let Some(until) = *inner.paused_until.lock()
            && Instant::now() < until
        {
            metrics::counter!(crate::telemetry::MOONCAKE_FAST_FAILURES).increment(1);
            return Err(unavailable(
                &inner.name,
                format!("{op} skipped: the cluster failed a call moments ago"),
            ));
        }
        let shared = inner.clone();
        // On the blocking pool, never `block_in_place`: a call stuck inside Mooncake (a
        // master that stopped answering) must not hold its caller past the deadline. The
        // hand-off costs some microseconds per call (docs/benchmarks.md, "Mooncake Store").
        // The closure owns everything the call touches (its staging slots included), so a
        // call abandoned at its deadline finishes or fails on its own thread safely.
        let state = Arc::new(AtomicU8::new(CALL_RUNNING));
        let finished = state.clone();
        let overdue = inner.overdue.clone();
        let task = tokio::task::spawn_blocking(move || {
            let result = f(&shared);
            if finished
                .compare_exchange(CALL_RUNNING, CALL_DONE, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // The caller gave up on this call at its deadline and counted it overdue.
                overdue.fetch_sub(1, Ordering::AcqRel);
            }
            result
        });
        let result = match tokio::time::timeout(deadline, task).await {
            Ok(joined) => joined.map_err(|e| unavailable(&inner.name, format!("{op}: {e}")))?,
            Err(_) => {
                inner.overdue.fetch_add(1, Ordering::AcqRel);
                if state
                    .compare_exchange(
                        CALL_RUNNING,
                        CALL_OVERDUE,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_err()
                {
                    // It finished just now; its result is dropped with the task.
                    inner.overdue.fetch_sub(1, Ordering::AcqRel);
                }
                inner.pause();
                metrics::counter!(kvpool_core::telemetry::TIMEOUTS, "tier" => inner.name.clone())
                    .increment(1);
                let millis = deadline.as_millis() as u64;
                warn!(backend = %inner.name, op, millis,
                      "a Mooncake call missed its deadline; calls fail fast until it returns");
                return Err(BackendError::Timeout {
                    backend: inner.name.clone(),
                    op,
                    millis,
                });
            }
        };
        match result {
            Ok(v) => Ok(v),
            Err(CallError::Client(reason)) => Err(unavailable(&inner.name, reason)),
            Err(CallError::Code(code)) => {
                if is_cluster_failure(code) {
                    inner.pause();
                }
                Err(unavailable(
                    &inner.name,
                    format!("{op} failed with code {code} ({})", describe_code(code)),
                ))
            }
            Err(CallError::Pool(e)) => Err(BackendError::Pool(e)),
        }
    }
}

/// Fails fast, with a clear error, when nothing accepts connections at the master's address:
/// Mooncake's `setup` would otherwise retry for about a minute and a half while holding the
/// embedded interpreter's lock, stalling every other Mooncake client in the process.
async fn probe_master(config: &MooncakeConfig) -> Result<(), BackendError> {
    use std::net::{TcpStream, ToSocketAddrs};
    let address = config.master_server_address.clone();
    let limit = config.connect_timeout.min(Duration::from_secs(3));
    let target = address.clone();
    // Plain std sockets on a blocking thread: works on any runtime (no IO driver needed).
    let probe = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let addrs: Vec<_> = target
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve: {e}"))?
            .collect();
        let mut last = "no address".to_string();
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, limit) {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    })
    .await
    .map_err(|e| unavailable("mooncake", e.to_string()))?;
    probe.map_err(|reason| {
        unavailable(
            "mooncake",
            format!("cannot reach mooncake_master at {address}: {reason}"),
        )
    })
}

/// Why a blocking call failed.
pub(super) enum CallError {
    /// The client raised.
    Client(String),
    /// Mooncake answered with a negative code.
    Code(i64),
    /// The staging arena could not hold a value.
    Pool(PoolError),
}

impl From<String> for CallError {
    fn from(reason: String) -> Self {
        CallError::Client(reason)
    }
}

impl Inner {
    /// Makes calls fail fast for `retry_after` (the cluster failed one, or one is stuck).
    fn pause(&self) {
        *self.paused_until.lock() = Some(Instant::now() + self.retry_after);
    }

    /// Allocates staging for `len` bytes; a value larger than the whole arena is an error.
    fn stage(&self, len: usize) -> Result<Option<MemoryObjMut>, CallError> {
        match self.staging.allocate(len.max(1)) {
            Ok(slot) => Ok(Some(slot)),
            Err(PoolError::OutOfMemory { .. }) => Ok(None),
            Err(e) => Err(CallError::Pool(e)),
        }
    }

    /// Puts every entry, in rounds that fit the staging arena; of a key given twice, the
    /// later value (Mooncake addresses a batch's buffers by key, so one key must not appear
    /// twice in a call).
    fn put_all(&self, entries: &[(String, Bytes)]) -> Result<(), CallError> {
        let mut last: HashMap<&str, usize> = HashMap::with_capacity(entries.len());
        for (i, (key, _)) in entries.iter().enumerate() {
            last.insert(key, i);
        }
        if last.len() < entries.len() {
            let distinct: Vec<(String, Bytes)> = entries
                .iter()
                .enumerate()
                .filter(|(i, (key, _))| last[key.as_str()] == *i)
                .map(|(_, e)| e.clone())
                .collect();
            return self.put_all(&distinct);
        }
        // Every key of the call at once, before any staging is taken: a call waiting here
        // holds nothing another call needs.
        let keys: Vec<String> = entries.iter().map(|(key, _)| key.clone()).collect();
        let _claim = self.writing.claim(&keys);
        self.fail_fast_after_waiting()?;
        let mut next = 0;
        while next < entries.len() {
            let mut keys = Vec::new();
            let mut slots = Vec::new();
            while next < entries.len() {
                let value = &entries[next].1;
                let Some(mut slot) = self.stage(value.len())? else {
                    break;
                };
                slot.as_mut_slice()[..value.len()].copy_from_slice(value);
                keys.push(entries[next].0.clone());
                slots.push(slot);
                next += 1;
            }
            if slots.is_empty() {
                // The arena is full of values still held elsewhere (gets in flight).
                return Err(CallError::Pool(PoolError::OutOfMemory {
                    requested: entries[next].1.len(),
                    free: self.staging.stats().capacity - self.staging.stats().used,
                    largest: self.staging.stats().largest_free,
                }));
            }
            let buffers: Vec<RawBuffer> = slots
                .iter_mut()
                .zip(&entries[next - keys.len()..next])
                .map(|(slot, (_, value))| RawBuffer {
                    ptr: slot.as_mut_slice().as_mut_ptr(),
                    len: value.len(),
                })
                .collect();
            self.upsert_with_retries(&keys, &buffers)?;
        }
        if let Some(max) = entries.iter().map(|(_, v)| v.len()).max() {
            self.size_hint.fetch_max(max, Ordering::Relaxed);
        }
        Ok(())
    }

    /// After a wait for another call's writes: fails fast, as [`MooncakeConnector::call`]
    /// would have, if the connector closed or the cluster failed a call meanwhile.
    fn fail_fast_after_waiting(&self) -> Result<(), CallError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(CallError::Client("closed while waiting to write".into()));
        }
        if let Some(until) = *self.paused_until.lock()
            && Instant::now() < until
        {
            metrics::counter!(crate::telemetry::MOONCAKE_FAST_FAILURES).increment(1);
            return Err(CallError::Client(
                "skipped: the cluster failed a call moments ago".into(),
            ));
        }
        Ok(())
    }

    /// Upserts, retrying keys that lost a race with another writer of the same key (Mooncake
    /// answers such a loser with "not found", "already exists", "not ready" or "has a lease").
    fn upsert_with_retries(&self, keys: &[String], buffers: &[RawBuffer]) -> Result<(), CallError> {
        let (mut keys, mut buffers) = (keys.to_vec(), buffers.to_vec());
        for attempt in 0.. {
            // SAFETY: the buffers are registered staging slots the caller keeps alive.
            let codes = unsafe { self.client.batch_upsert_from(&keys, &buffers)? };
            if codes.len() != keys.len() {
                return Err(CallError::Client(format!(
                    "batch_upsert_from answered {} results for {} keys",
                    codes.len(),
                    keys.len()
                )));
            }
            let mut retry_keys = Vec::new();
            let mut retry_buffers = Vec::new();
            for ((key, buffer), code) in keys.iter().zip(&buffers).zip(codes) {
                match code {
                    OK => {}
                    -706..=-703 if attempt < PUT_RACE_RETRIES => {
                        retry_keys.push(key.clone());
                        retry_buffers.push(*buffer);
                    }
                    code => {
                        warn!(backend = %self.name, %key, code, meaning = describe_code(code), "Mooncake put failed");
                        if is_cluster_failure(code) {
                            // Before this call's key claims are let go: a put waiting on
                            // them must see the pause and fail fast.
                            self.pause();
                        }
                        return Err(CallError::Code(code));
                    }
                }
            }
            if retry_keys.is_empty() {
                break;
            }
            debug!(backend = %self.name, keys = retry_keys.len(), attempt, "retrying puts that raced another writer");
            std::thread::sleep(Duration::from_millis(1 << attempt));
            (keys, buffers) = (retry_keys, retry_buffers);
        }
        Ok(())
    }

    /// Gets every key, in rounds that fit the staging arena. Values stay in staging (no copy)
    /// unless a later round needs the room or staging would stay more than half full.
    fn get_all(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, CallError> {
        // Mooncake addresses a batch's buffers by key: with a key twice in one call, one
        // buffer would be written twice and the other reported filled, holding whatever
        // staging held before. Each key is read once and handed to every place asking for it.
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
        let mut distinct: Vec<String> = Vec::new();
        let place: Vec<usize> = keys
            .iter()
            .map(|key| {
                *first.entry(key).or_insert_with(|| {
                    distinct.push(key.clone());
                    distinct.len() - 1
                })
            })
            .collect();
        if distinct.len() < keys.len() {
            let got = self.get_distinct(&distinct)?;
            return Ok(place.into_iter().map(|i| got[i].clone()).collect());
        }
        self.get_distinct(keys)
    }

    /// [`Inner::get_all`] of keys that are all different.
    fn get_distinct(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, CallError> {
        let mut out: Vec<Option<Bytes>> = vec![None; keys.len()];
        let mut too_small = Vec::new();
        let mut next = 0;
        while next < keys.len() {
            let hint = self.size_hint.load(Ordering::Relaxed);
            let mut round: Vec<(usize, MemoryObjMut, usize)> = Vec::new();
            while next < keys.len() {
                let size = if hint > 0 {
                    hint
                } else {
                    match self.client.get_size(&keys[next])? {
                        OBJECT_NOT_FOUND => {
                            next += 1;
                            continue;
                        }
                        code if code < OK => return Err(CallError::Code(code)),
                        size => size as usize,
                    }
                };
                let Some(slot) = self.stage(size)? else {
                    break;
                };
                round.push((next, slot, size));
                next += 1;
            }
            if round.is_empty() {
                if next < keys.len() {
                    // Staging is taken by earlier results: move them to the heap and retry.
                    if !spill_to_heap(&mut out) {
                        return Err(CallError::Pool(PoolError::OutOfMemory {
                            requested: hint,
                            free: self.staging.stats().capacity - self.staging.stats().used,
                            largest: self.staging.stats().largest_free,
                        }));
                    }
                }
                continue;
            }
            self.get_round(keys, round, &mut out, &mut too_small)?;
        }
        // Values larger than the hint: their exact size, one by one.
        for index in too_small {
            let size = match self.client.get_size(&keys[index])? {
                OBJECT_NOT_FOUND => continue,
                code if code < OK => return Err(CallError::Code(code)),
                size => size as usize,
            };
            let slot = match self.stage(size)? {
                Some(slot) => slot,
                None if spill_to_heap(&mut out) => match self.stage(size)? {
                    Some(slot) => slot,
                    None => continue,
                },
                None => continue,
            };
            let mut missed = Vec::new();
            self.get_round(keys, vec![(index, slot, size)], &mut out, &mut missed)?;
        }
        // Callers may hold values for a while: staging stays at most half pinned by them, so
        // later calls always find room.
        let stats = self.staging.stats();
        if stats.used > stats.capacity / 2 {
            spill_to_heap(&mut out);
        }
        Ok(out)
    }

    fn get_round(
        &self,
        keys: &[String],
        mut round: Vec<(usize, MemoryObjMut, usize)>,
        out: &mut [Option<Bytes>],
        too_small: &mut Vec<usize>,
    ) -> Result<(), CallError> {
        let names: Vec<String> = round.iter().map(|(i, _, _)| keys[*i].clone()).collect();
        let buffers: Vec<RawBuffer> = round
            .iter_mut()
            .map(|(_, slot, size)| RawBuffer {
                ptr: slot.as_mut_slice().as_mut_ptr(),
                len: *size,
            })
            .collect();
        // SAFETY: each slot is registered staging memory of at least `size` bytes, owned here
        // and not aliased, alive until after the call.
        let codes = unsafe { self.client.batch_get_into(&names, &buffers)? };
        if codes.len() != round.len() {
            return Err(CallError::Client(format!(
                "batch_get_into answered {} results for {} keys",
                codes.len(),
                round.len()
            )));
        }
        let mut cluster_failure = None;
        for ((index, slot, size), code) in round.into_iter().zip(codes) {
            match code {
                OBJECT_NOT_FOUND => {}
                BUFFER_TOO_SMALL => too_small.push(index),
                n if n >= OK && (n as usize) <= size => {
                    self.size_hint.fetch_max(n as usize, Ordering::Relaxed);
                    out[index] = Some(staged_bytes(slot, n as usize));
                }
                n if n >= OK => {
                    return Err(CallError::Client(format!(
                        "get_into reported {n} bytes into a {size}-byte buffer"
                    )));
                }
                code if is_cluster_failure(code) => cluster_failure = Some(code),
                code => {
                    metrics::counter!(crate::telemetry::MOONCAKE_GET_ERRORS).increment(1);
                    debug!(backend = %self.name, key = %keys[index], code, meaning = describe_code(code), "Mooncake get failed; a miss");
                }
            }
        }
        match cluster_failure {
            Some(code) => Err(CallError::Code(code)),
            None => Ok(()),
        }
    }
}

pub(super) fn codes_to_bools(codes: Vec<i64>, expected: usize) -> Result<Vec<bool>, CallError> {
    if codes.len() != expected {
        return Err(CallError::Client(format!(
            "batch_is_exist answered {} results for {expected} keys",
            codes.len()
        )));
    }
    codes
        .into_iter()
        .map(|c| match c {
            1 => Ok(true),
            0 => Ok(false),
            code => Err(CallError::Code(code)),
        })
        .collect()
}

#[async_trait]
impl RemoteConnector for MooncakeConnector {
    fn name(&self) -> &str {
        &self.inner.name
    }

    async fn close(&self) -> Result<(), BackendError> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let inner = self.inner.clone();
        let closed = tokio::task::spawn_blocking(move || inner.client.close())
            .await
            .map_err(|e| unavailable(&self.inner.name, e.to_string()))?;
        if let Err(reason) = closed {
            warn!(backend = %self.inner.name, %reason, "Mooncake close failed");
        }
        Ok(())
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys = keys.to_vec();
        self.call("batch_is_exist", 0, move |inner| {
            let n = keys.len();
            codes_to_bools(inner.client.batch_is_exist(&keys)?, n)
        })
        .await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys = keys.to_vec();
        self.call("batch_get_into", 0, move |inner| inner.get_all(&keys))
            .await
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        if entries.is_empty() {
            return Ok(());
        }
        let bytes = entries.iter().map(|(_, value)| value.len()).sum();
        self.call("batch_upsert_from", bytes, move |inner| {
            inner.put_all(&entries)
        })
        .await
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let keys = keys.to_vec();
        self.call("batch_remove", 0, move |inner| {
            let codes = inner.client.batch_remove(&keys)?;
            let mut removed = 0;
            for code in codes {
                match code {
                    OK => removed += 1,
                    OBJECT_NOT_FOUND => {}
                    code => return Err(CallError::Code(code)),
                }
            }
            Ok(removed)
        })
        .await
    }
}
