//! The daemon's shared-memory store: values in one arena that every attached engine maps,
//! bounded by the node's budget, with per-session pins and uncommitted allocations that end
//! with their session or their deadline.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_core::PoolError;
use kvpool_core::memory::{
    EvictionKind, EvictionPolicy, MemoryObj, MemoryObjMut, MemoryPool, SharedMapping,
    SharedMemoryAllocator,
};
use parking_lot::Mutex;

use super::protocol::{DaemonStats, Region};

/// A session's id (one per attached connection).
pub type SessionId = u64;

/// The most pins and uncommitted allocations one session may hold at once: an engine holds
/// a few thousand (a load's chunks, a save's); past this a pin or an allocation is refused (a
/// miss, a save not made), so no session can grow the daemon's heap without bound.
pub const MAX_LEASES_PER_SESSION: usize = 1 << 18;

/// The most pins and uncommitted allocations all sessions together may hold.
pub const MAX_LEASES: usize = 1 << 21;

struct Lent<T> {
    memory: T,
    session: SessionId,
}

#[derive(Default)]
struct Counters {
    memory_hits: u64,
    tier_hits: u64,
    misses: u64,
    commits: u64,
    evictions: u64,
    leases_reclaimed: u64,
}

struct State {
    values: HashMap<String, MemoryObj>,
    policy: Box<dyn EvictionPolicy<String>>,
    pins: HashMap<u64, Lent<MemoryObj>>,
    allocations: HashMap<u64, Lent<MemoryObjMut>>,
    /// Every lease's deadline in the order leases were made: with one time-to-live for all,
    /// that is deadline order, so expiry pops from the front (amortised O(1), where a sweep
    /// of every lease under the lock made each request cost the number of leases held).
    /// Entries of leases ended earlier are skipped as they come up.
    deadlines: VecDeque<(Instant, u64)>,
    /// Leases held per session.
    held: HashMap<SessionId, usize>,
    next_id: u64,
    counters: Counters,
}

impl State {
    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Whether `session` may take one more lease.
    fn may_lease(&self, session: SessionId) -> bool {
        self.held.get(&session).copied().unwrap_or(0) < MAX_LEASES_PER_SESSION
            && self.pins.len() + self.allocations.len() < MAX_LEASES
    }

    fn leased(&mut self, session: SessionId, id: u64, expires: Instant) {
        *self.held.entry(session).or_default() += 1;
        self.deadlines.push_back((expires, id));
        // Leases ended early leave their deadline behind: past twice the live leases, the
        // queue keeps only the live ones (so it tracks leases held, not leases made).
        let live = self.pins.len() + self.allocations.len();
        if self.deadlines.len() > 2 * live + 4096 {
            let (pins, allocations) = (&self.pins, &self.allocations);
            self.deadlines
                .retain(|(_, id)| pins.contains_key(id) || allocations.contains_key(id));
            self.deadlines.shrink_to(2 * self.deadlines.len() + 4096);
        }
    }

    fn unleased(&mut self, session: SessionId) {
        if let Some(n) = self.held.get_mut(&session) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&session);
            }
        }
    }

    /// Ends lease `id` (a pin or an allocation) if it is live; returns its session.
    fn end_lease(&mut self, id: u64) -> Option<SessionId> {
        let session = match self.pins.remove(&id) {
            Some(p) => p.session,
            None => self.allocations.remove(&id)?.session,
        };
        self.unleased(session);
        Some(session)
    }

    /// Evicts one value nobody else holds; false when there is none.
    fn evict_one(&mut self) -> bool {
        let values = &self.values;
        let victim = self
            .policy
            .pop_victim(&mut |k| values.get(k).is_some_and(|v| v.ref_count() == 1));
        match victim.and_then(|k| self.values.remove(&k)) {
            Some(_) => {
                self.counters.evictions += 1;
                true
            }
            None => false,
        }
    }
}

/// Values in shared memory under string keys (the engines' encoded chunks, opaque here).
///
/// A value is evicted only when nothing else holds it: a pin or a write to a lower tier in
/// flight keeps it. An allocation is a unique buffer outside the index, so a value being
/// written is never visible; it becomes a value at [`SharedStore::commit`].
pub struct SharedStore {
    pool: MemoryPool,
    arena: Arc<SharedMapping>,
    lease_ttl: Duration,
    state: Mutex<State>,
}

/// How much of the arena [`commit_within_memory_limit`] takes at a time.
const COMMIT_STEP: usize = 64 << 20;

/// Room [`commit_within_memory_limit`] leaves under the memory limit for the daemon's own
/// heap, its threads and the page tables of the arena.
const COMMIT_MARGIN: u64 = 64 << 20;

/// Commits the arena's pages from its start in steps of [`COMMIT_STEP`], each only while the
/// process's cgroups have room for it and [`COMMIT_MARGIN`]; returns the bytes committed.
/// A restarted daemon must not be killed for taking its arena while engines still map the
/// previous daemon's (charged to the same cgroup until they let go): what is not committed
/// here is taken page by page as values arrive, by when the engines have let the old go.
fn commit_within_memory_limit(arena: &SharedMapping) -> std::io::Result<usize> {
    let mut committed = 0;
    while committed < arena.len() {
        let step = COMMIT_STEP.min(arena.len() - committed);
        if let Some(room) = kvpool_core::memory::cgroup::memory_headroom()
            && room < step as u64 + COMMIT_MARGIN
        {
            break;
        }
        arena.commit_pages_in(committed, step)?;
        committed += step;
    }
    Ok(committed)
}

impl SharedStore {
    /// A store of `capacity` bytes in a new memory file, allocated now as far as the
    /// process's memory limit leaves room (`commit_within_memory_limit`), evicting by
    /// `eviction`; pins and allocations not ended within `lease_ttl` are reclaimed.
    pub fn new(
        capacity: usize,
        eviction: EvictionKind,
        lease_ttl: Duration,
    ) -> Result<Self, PoolError> {
        let allocator = SharedMemoryAllocator::new();
        let pool = MemoryPool::with_allocator(capacity, &allocator)?;
        let arena = allocator.arena().ok_or_else(|| PoolError::Arena {
            bytes: capacity,
            reason: "the shared allocator kept no arena".into(),
        })?;
        // Taken whole at start where the memory limit allows, as engines take their KV
        // memory: no page is allocated under load, and an engine's mapping of a committed
        // page needs no allocation either.
        let started = Instant::now();
        let committed = commit_within_memory_limit(&arena).map_err(|e| PoolError::Arena {
            bytes: capacity,
            reason: format!("committing the shared memory: {e}"),
        })?;
        if committed < arena.len() {
            tracing::warn!(
                committed,
                bytes = arena.len(),
                "committed only part of the pool's shared memory at start: the cgroup's memory \
                 limit leaves no more room (engines may still map the arena of a daemon that ran \
                 before, until they notice it is gone); the rest is taken as values arrive"
            );
        } else {
            tracing::info!(
                bytes = capacity,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "committed the pool's shared memory"
            );
        }
        Ok(SharedStore {
            pool,
            arena,
            lease_ttl,
            state: Mutex::new(State {
                values: HashMap::new(),
                policy: eviction.build(capacity),
                pins: HashMap::new(),
                allocations: HashMap::new(),
                deadlines: VecDeque::new(),
                held: HashMap::new(),
                next_id: 1,
                counters: Counters::default(),
            }),
        })
    }

    /// The arena's memory file, mapped (its descriptor is what attaching engines receive).
    pub fn arena(&self) -> &Arc<SharedMapping> {
        &self.arena
    }

    /// How long a pin or an allocation lives when its session does not end it.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    fn region(id: u64, offset: Option<usize>, len: usize) -> Option<Region> {
        offset.map(|offset| Region {
            id,
            offset: offset as u64,
            len: len as u64,
        })
    }

    /// Drops pins and allocations past their deadline (popping the deadline queue's front).
    fn reclaim_expired(&self, st: &mut State, now: Instant) {
        while let Some(&(expires, id)) = st.deadlines.front() {
            if expires > now {
                break;
            }
            st.deadlines.pop_front();
            if st.end_lease(id).is_some() {
                st.counters.leases_reclaimed += 1;
            }
        }
        // Ended leases leave entries behind until their deadline: bounded by the leases made
        // within one time-to-live.
    }

    /// Whether shared memory holds each key.
    pub fn contains(&self, keys: &[String]) -> Vec<bool> {
        let st = self.state.lock();
        keys.iter().map(|k| st.values.contains_key(k)).collect()
    }

    /// Pins `key`'s value for `session`; `None` when shared memory does not hold it.
    pub fn pin(&self, session: SessionId, key: &str) -> Option<Region> {
        let mut st = self.state.lock();
        // Read under the lock: deadlines then enter the queue in order.
        let now = Instant::now();
        self.reclaim_expired(&mut st, now);
        let region = self.pin_locked(&mut st, session, key, now)?;
        st.counters.memory_hits += 1;
        Some(region)
    }

    fn pin_locked(
        &self,
        st: &mut State,
        session: SessionId,
        key: &str,
        now: Instant,
    ) -> Option<Region> {
        if !st.may_lease(session) {
            return None;
        }
        let value = st.values.get(key).cloned()?;
        st.policy.on_access(&key.to_string());
        let id = st.next_id();
        let region = Self::region(id, value.arena_offset(), value.len());
        let expires = now + self.lease_ttl;
        st.pins.insert(
            id,
            Lent {
                memory: value,
                session,
            },
        );
        st.leased(session, id, expires);
        region
    }

    /// Counts gets a lower tier answered, and gets nothing answered.
    pub fn count_lookups(&self, tier_hits: u64, misses: u64) {
        let mut st = self.state.lock();
        st.counters.tier_hits += tier_hits;
        st.counters.misses += misses;
    }

    /// A buffer of `len` bytes, evicting unheld values until one fits; `None` when it cannot.
    fn allocate(&self, st: &mut State, len: usize) -> Option<MemoryObjMut> {
        if len == 0 || len > self.pool.capacity() {
            return None;
        }
        loop {
            match self.pool.allocate(len) {
                Ok(buf) => return Some(buf),
                Err(_) if st.evict_one() => continue,
                Err(_) => return None,
            }
        }
    }

    /// Allocates `len` bytes for `session` to write; invisible until committed.
    pub fn prepare(&self, session: SessionId, len: usize) -> Option<Region> {
        let mut st = self.state.lock();
        // Read under the lock: deadlines then enter the queue in order.
        let now = Instant::now();
        self.reclaim_expired(&mut st, now);
        if !st.may_lease(session) {
            return None;
        }
        let buf = self.allocate(&mut st, len)?;
        let id = st.next_id();
        let region = Self::region(id, buf.arena_offset(), buf.len());
        let expires = now + self.lease_ttl;
        st.allocations.insert(
            id,
            Lent {
                memory: buf,
                session,
            },
        );
        st.leased(session, id, expires);
        region
    }

    fn publish(st: &mut State, key: String, value: MemoryObj) {
        st.policy.on_insert(key.clone(), value.len());
        st.values.insert(key, value);
        st.counters.commits += 1;
    }

    /// Publishes `session`'s allocation `id` under `key`; the committed value (for the lower
    /// tiers), or `None` when the id is not this session's live allocation (one past its
    /// deadline is reclaimed, not committed: its engine may have stopped writing it halfway).
    pub fn commit(&self, session: SessionId, id: u64, key: String) -> Option<MemoryObj> {
        let mut st = self.state.lock();
        // Read under the lock: deadlines then enter the queue in order.
        let now = Instant::now();
        self.reclaim_expired(&mut st, now);
        if st.allocations.get(&id).is_none_or(|a| a.session != session) {
            return None;
        }
        let value = st.allocations.remove(&id)?.memory.freeze();
        st.unleased(session);
        Self::publish(&mut st, key, value.clone());
        Some(value)
    }

    /// Copies `bytes` (a lower tier's value) into shared memory under `key` and pins it for
    /// `session`; `None` when no room could be made.
    pub fn promote_and_pin(&self, session: SessionId, key: &str, bytes: &[u8]) -> Option<Region> {
        let mut st = self.state.lock();
        // Read under the lock: deadlines then enter the queue in order.
        let now = Instant::now();
        let mut buf = self.allocate(&mut st, bytes.len())?;
        buf.as_mut_slice().copy_from_slice(bytes);
        let value = buf.freeze();
        Self::publish(&mut st, key.to_string(), value);
        // Pinned under the same lock: nothing can evict it in between.
        self.pin_locked(&mut st, session, key, now)
    }

    /// Ends `session`'s pins and uncommitted allocations among `ids` (others' are ignored).
    pub fn release(&self, session: SessionId, ids: &[u64]) {
        let mut st = self.state.lock();
        for id in ids {
            let owner = st
                .pins
                .get(id)
                .map(|p| p.session)
                .or_else(|| st.allocations.get(id).map(|a| a.session));
            if owner == Some(session) {
                st.end_lease(*id);
            }
        }
    }

    /// Ends everything `session` holds (its connection closed); returns how many leases.
    pub fn end_session(&self, session: SessionId) -> usize {
        let mut st = self.state.lock();
        if st.held.remove(&session).is_none() {
            return 0;
        }
        let before = st.pins.len() + st.allocations.len();
        st.pins.retain(|_, p| p.session != session);
        st.allocations.retain(|_, a| a.session != session);
        let ended = before - st.pins.len() - st.allocations.len();
        st.counters.leases_reclaimed += ended as u64;
        ended
    }

    /// Removes keys from shared memory (their memory is freed when the last pin ends).
    pub fn remove(&self, keys: &[String]) -> usize {
        let mut st = self.state.lock();
        let mut removed = 0;
        for k in keys {
            if st.values.remove(k).is_some() {
                st.policy.on_remove(k);
                removed += 1;
            }
        }
        removed
    }

    /// The store's counters; `sessions`, `tier_writes` and `refused` are left for the server.
    pub fn stats(&self) -> DaemonStats {
        let mut st = self.state.lock();
        self.reclaim_expired(&mut st, Instant::now());
        let pool = self.pool.stats();
        DaemonStats {
            sessions: 0,
            entries: st.values.len() as u64,
            used_bytes: pool.used as u64,
            capacity_bytes: self.pool.capacity() as u64,
            pins: st.pins.len() as u64,
            allocations: st.allocations.len() as u64,
            memory_hits: st.counters.memory_hits,
            tier_hits: st.counters.tier_hits,
            misses: st.counters.misses,
            commits: st.counters.commits,
            evictions: st.counters.evictions,
            tier_writes: 0,
            leases_reclaimed: st.counters.leases_reclaimed,
            refused: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(capacity: usize) -> SharedStore {
        SharedStore::new(capacity, EvictionKind::Lru, Duration::from_secs(60)).unwrap()
    }

    fn write(store: &SharedStore, session: SessionId, key: &str, byte: u8, len: usize) -> bool {
        let Some(r) = store.prepare(session, len) else {
            return false;
        };
        // SAFETY: the region was allocated to this session and lies inside the arena.
        unsafe {
            std::ptr::write_bytes(
                store.arena().as_ptr().as_ptr().add(r.offset as usize),
                byte,
                len,
            );
        }
        store.commit(session, r.id, key.into()).is_some()
    }

    #[test]
    fn an_uncommitted_allocation_is_invisible_and_another_session_cannot_commit_it() {
        let s = store(1 << 20);
        let r = s.prepare(1, 4096).unwrap();
        assert_eq!(s.contains(&["k".into()]), vec![false]);
        assert!(s.pin(2, "k").is_none());
        assert!(s.commit(2, r.id, "k".into()).is_none());
        assert!(s.commit(1, r.id, "k".into()).is_some());
        assert_eq!(s.contains(&["k".into()]), vec![true]);
        assert!(s.commit(1, r.id, "k2".into()).is_none(), "committed twice");
    }

    #[test]
    fn a_pinned_value_is_not_evicted_and_an_ended_session_frees_everything() {
        let s = store(64 << 10);
        assert!(write(&s, 1, "a", 1, 32 << 10));
        let pin = s.pin(2, "a").unwrap();
        // Room for one more 32 KiB value only by evicting `a`, which session 2 pins.
        assert!(s.prepare(1, 48 << 10).is_none());
        assert_eq!(s.contains(&["a".into()]), vec![true]);
        let alloc = s.prepare(2, 16 << 10).unwrap();
        assert_eq!(s.stats().pins, 1);
        assert_eq!(s.end_session(2), 2);
        let st = s.stats();
        assert_eq!((st.pins, st.allocations), (0, 0));
        assert_eq!(st.used_bytes, 32 << 10, "the allocation's memory came back");
        assert!(s.commit(2, alloc.id, "b".into()).is_none());
        // Unpinned now: a large value evicts it.
        assert!(write(&s, 1, "c", 3, 48 << 10));
        assert_eq!(s.contains(&["a".into(), "c".into()]), vec![false, true]);
        assert_eq!(s.stats().evictions, 1);
        let _ = pin;
    }

    #[test]
    fn a_session_holds_at_most_its_share_of_leases() {
        let s = store(1 << 20);
        assert!(write(&s, 1, "a", 1, 4096));
        for _ in 0..MAX_LEASES_PER_SESSION {
            assert!(s.pin(2, "a").is_some());
        }
        assert!(s.pin(2, "a").is_none(), "past its share: refused");
        assert!(s.prepare(2, 256).is_none());
        assert!(s.pin(3, "a").is_some(), "another session is not affected");
        assert_eq!(s.end_session(2), MAX_LEASES_PER_SESSION);
        assert!(s.pin(2, "a").is_some());
    }

    #[test]
    fn the_deadline_queue_tracks_leases_held_not_leases_made() {
        let s = store(1 << 20);
        assert!(write(&s, 1, "a", 1, 4096));
        for _ in 0..100_000 {
            let r = s.pin(2, "a").unwrap();
            s.release(2, &[r.id]);
        }
        let queued = s.state.lock().deadlines.len();
        assert!(
            queued <= 4096 + 2,
            "{queued} deadlines queued for no lease held"
        );
    }

    #[test]
    fn leases_past_their_deadline_are_reclaimed() {
        let s = SharedStore::new(1 << 20, EvictionKind::Lru, Duration::from_millis(20)).unwrap();
        assert!(write(&s, 1, "a", 1, 4096));
        s.pin(1, "a").unwrap();
        s.prepare(1, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(40));
        let st = s.stats();
        assert_eq!((st.pins, st.allocations, st.leases_reclaimed), (0, 0, 2));
        assert_eq!(st.used_bytes, 4096);
    }

    #[test]
    fn an_allocation_past_its_deadline_is_never_committed() {
        let s = SharedStore::new(1 << 20, EvictionKind::Lru, Duration::from_millis(20)).unwrap();
        let r = s.prepare(1, 4096).unwrap();
        std::thread::sleep(Duration::from_millis(40));
        // Nothing swept it since (no prepare, pin or stats call): the commit itself refuses.
        assert!(s.commit(1, r.id, "late".into()).is_none());
        assert_eq!(s.contains(&["late".into()]), [false]);
        assert_eq!(s.stats().leases_reclaimed, 1);
    }
}
