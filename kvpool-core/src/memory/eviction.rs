//! Eviction policies (LRU, FIFO, S3-FIFO) behind one trait, size-aware, skipping pinned entries.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

use serde::{Deserialize, Serialize};

/// Decides which entry a bounded tier drops next.
///
/// The tier tells the policy about inserts, hits and removals; when it needs space it asks
/// for a victim, passing a predicate that says which entries may go now (e.g. not pinned by an
/// in-flight read). A returned victim is already forgotten by the policy.
pub trait EvictionPolicy<K>: Send {
    /// Policy name for logs and metrics.
    fn name(&self) -> &'static str;
    /// A new entry of `size` bytes was inserted (re-inserting a known key replaces it).
    fn on_insert(&mut self, key: K, size: usize);
    /// An entry was read.
    fn on_access(&mut self, key: &K);
    /// An entry was removed by the tier itself.
    fn on_remove(&mut self, key: &K);
    /// The next victim among entries for which `evictable` is true; `None` if there is none.
    fn pop_victim(&mut self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<K>;
    /// Tracked entries.
    fn len(&self) -> usize;
    /// Whether nothing is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which policy a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionKind {
    /// Least recently used.
    #[default]
    Lru,
    /// First in, first out (hits do not matter).
    Fifo,
    /// S3-FIFO (Yang et al., SOSP'23): small probation queue, main queue, ghost keys.
    S3fifo,
}

impl std::str::FromStr for EvictionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "lru" => Ok(EvictionKind::Lru),
            "fifo" => Ok(EvictionKind::Fifo),
            "s3fifo" => Ok(EvictionKind::S3fifo),
            _ => Err(format!(
                "unknown eviction policy `{s}`: expected lru, fifo or s3fifo"
            )),
        }
    }
}

impl EvictionKind {
    /// Builds the policy for a tier of `capacity_bytes`.
    pub fn build<K: Hash + Eq + Clone + Send + 'static>(
        self,
        capacity_bytes: usize,
    ) -> Box<dyn EvictionPolicy<K>> {
        match self {
            EvictionKind::Lru => Box::new(OrderedPolicy::lru()),
            EvictionKind::Fifo => Box::new(OrderedPolicy::fifo()),
            EvictionKind::S3fifo => Box::new(S3Fifo::new(capacity_bytes)),
        }
    }
}

/// Entries ordered by a monotonically increasing tick.
#[derive(Debug)]
struct TickQueue<K> {
    tick_of: HashMap<K, u64>,
    by_tick: BTreeMap<u64, K>,
    next: u64,
}

impl<K> Default for TickQueue<K> {
    fn default() -> Self {
        TickQueue {
            tick_of: HashMap::new(),
            by_tick: BTreeMap::new(),
            next: 0,
        }
    }
}

impl<K: Hash + Eq + Clone> TickQueue<K> {
    fn push_newest(&mut self, key: K) {
        self.remove(&key);
        self.next += 1;
        self.tick_of.insert(key.clone(), self.next);
        self.by_tick.insert(self.next, key);
    }

    fn move_to_newest(&mut self, key: &K) {
        if self.tick_of.contains_key(key) {
            self.push_newest(key.clone());
        }
    }

    fn remove(&mut self, key: &K) {
        if let Some(t) = self.tick_of.remove(key) {
            self.by_tick.remove(&t);
        }
    }

    fn pop_oldest(&mut self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        let (&tick, _) = self.by_tick.iter().find(|(_, k)| evictable(k))?;
        let key = self.by_tick.remove(&tick)?;
        self.tick_of.remove(&key);
        Some(key)
    }
}

/// LRU or FIFO: entries leave in the order of their tick, oldest first. Under LRU a hit makes
/// an entry the newest; under FIFO hits change nothing.
#[derive(Debug)]
pub struct OrderedPolicy<K> {
    queue: TickQueue<K>,
    refresh_on_access: bool,
}

impl<K> OrderedPolicy<K> {
    /// Least recently used.
    pub fn lru() -> Self {
        OrderedPolicy {
            queue: TickQueue::default(),
            refresh_on_access: true,
        }
    }

    /// First in, first out.
    pub fn fifo() -> Self {
        OrderedPolicy {
            queue: TickQueue::default(),
            refresh_on_access: false,
        }
    }
}

impl<K: Hash + Eq + Clone + Send> EvictionPolicy<K> for OrderedPolicy<K> {
    fn name(&self) -> &'static str {
        if self.refresh_on_access {
            "lru"
        } else {
            "fifo"
        }
    }
    fn on_insert(&mut self, key: K, _size: usize) {
        self.queue.push_newest(key);
    }
    fn on_access(&mut self, key: &K) {
        if self.refresh_on_access {
            self.queue.move_to_newest(key);
        }
    }
    fn on_remove(&mut self, key: &K) {
        self.queue.remove(key);
    }
    fn pop_victim(&mut self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        self.queue.pop_oldest(evictable)
    }
    fn len(&self) -> usize {
        self.queue.tick_of.len()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

#[derive(Debug, Clone, Copy)]
struct S3Entry {
    queue: Queue,
    freq: u8,
    size: usize,
    seq: u64,
}

/// S3-FIFO: new entries go to a small probation FIFO (10% of capacity); entries hit while
/// there move to the main FIFO, the rest are evicted and remembered as ghosts. A ghost that
/// returns goes straight to main. Main gives entries with hits (frequency up to 3) another
/// round, one hit at a time. Queues hold `(key, seq)` pairs; stale pairs are skipped lazily.
#[derive(Debug)]
pub struct S3Fifo<K> {
    entries: HashMap<K, S3Entry>,
    small: VecDeque<(K, u64)>,
    main: VecDeque<(K, u64)>,
    ghost: VecDeque<(K, u64)>,
    ghost_seq: HashMap<K, u64>,
    small_bytes: usize,
    small_target: usize,
    next_seq: u64,
}

const S3_MAX_FREQ: u8 = 3;

impl<K: Hash + Eq + Clone> S3Fifo<K> {
    /// A policy for a tier of `capacity_bytes` (the small queue targets 10% of it).
    pub fn new(capacity_bytes: usize) -> Self {
        S3Fifo {
            entries: HashMap::new(),
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            ghost_seq: HashMap::new(),
            small_bytes: 0,
            small_target: (capacity_bytes / 10).max(1),
            next_seq: 0,
        }
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn push(&mut self, key: K, queue: Queue, freq: u8, size: usize) {
        let seq = self.seq();
        match queue {
            Queue::Small => {
                self.small.push_back((key.clone(), seq));
                self.small_bytes += size;
            }
            Queue::Main => self.main.push_back((key.clone(), seq)),
        }
        self.entries.insert(
            key,
            S3Entry {
                queue,
                freq,
                size,
                seq,
            },
        );
    }

    fn forget(&mut self, key: &K) -> Option<S3Entry> {
        let e = self.entries.remove(key)?;
        if e.queue == Queue::Small {
            self.small_bytes -= e.size;
        }
        Some(e)
    }

    fn remember_ghost(&mut self, key: K) {
        let seq = self.seq();
        self.ghost_seq.insert(key.clone(), seq);
        self.ghost.push_back((key, seq));
        let cap = self.entries.len().max(16);
        while self.ghost_seq.len() > cap {
            let Some((k, s)) = self.ghost.pop_front() else {
                break;
            };
            if self.ghost_seq.get(&k) == Some(&s) {
                self.ghost_seq.remove(&k);
            }
        }
    }

    fn compact(queue: &mut VecDeque<(K, u64)>, entries: &HashMap<K, S3Entry>) {
        if queue.len() > 2 * entries.len() + 64 {
            queue.retain(|(k, s)| entries.get(k).is_some_and(|e| e.seq == *s));
        }
    }

    /// One step on the small queue: evicts its oldest cold entry, or promotes a hit one.
    fn step_small(&mut self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Option<K>> {
        let (key, seq) = self.small.pop_front()?;
        let Some(e) = self.entries.get(&key).copied() else {
            return Some(None);
        };
        if e.seq != seq || e.queue != Queue::Small {
            return Some(None);
        }
        self.forget(&key);
        if e.freq >= 1 {
            self.push(key, Queue::Main, 0, e.size);
            Some(None)
        } else if evictable(&key) {
            self.remember_ghost(key.clone());
            Some(Some(key))
        } else {
            self.push(key, Queue::Small, e.freq, e.size);
            Some(None)
        }
    }

    /// One step on the main queue: evicts its oldest cold entry, or gives a hit one a round.
    fn step_main(&mut self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<Option<K>> {
        let (key, seq) = self.main.pop_front()?;
        let Some(e) = self.entries.get(&key).copied() else {
            return Some(None);
        };
        if e.seq != seq || e.queue != Queue::Main {
            return Some(None);
        }
        self.forget(&key);
        if e.freq > 0 {
            self.push(key, Queue::Main, e.freq - 1, e.size);
            Some(None)
        } else if evictable(&key) {
            Some(Some(key))
        } else {
            self.push(key, Queue::Main, 0, e.size);
            Some(None)
        }
    }
}

impl<K: Hash + Eq + Clone + Send> EvictionPolicy<K> for S3Fifo<K> {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn on_insert(&mut self, key: K, size: usize) {
        self.forget(&key);
        if self.ghost_seq.remove(&key).is_some() {
            self.push(key, Queue::Main, 0, size);
        } else {
            self.push(key, Queue::Small, 0, size);
        }
    }

    fn on_access(&mut self, key: &K) {
        if let Some(e) = self.entries.get_mut(key) {
            e.freq = (e.freq + 1).min(S3_MAX_FREQ);
        }
    }

    fn on_remove(&mut self, key: &K) {
        self.forget(key);
        Self::compact(&mut self.small, &self.entries);
        Self::compact(&mut self.main, &self.entries);
    }

    fn pop_victim(&mut self, evictable: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        // Every entry can be visited a bounded number of times (freq <= 3 plus one move and
        // one pinned rotation per queue); past that budget everything left is pinned.
        let mut budget = (self.small.len() + self.main.len()) * (S3_MAX_FREQ as usize + 3) + 8;
        while budget > 0 && !self.entries.is_empty() {
            budget -= 1;
            let from_small = self.small_bytes >= self.small_target || self.main.is_empty();
            let step = if from_small {
                self.step_small(evictable)
                    .or_else(|| self.step_main(evictable))
            } else {
                self.step_main(evictable)
                    .or_else(|| self.step_small(evictable))
            };
            match step {
                Some(Some(victim)) => return Some(victim),
                Some(None) => continue,
                None => return None,
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(p: &mut dyn EvictionPolicy<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| p.pop_victim(&mut |_| true)).collect()
    }

    #[test]
    fn lru_evicts_least_recently_used_first() {
        let mut p = OrderedPolicy::lru();
        for k in ["a", "b", "c"] {
            p.on_insert(k, 1);
        }
        p.on_access(&"a");
        assert_eq!(drain(&mut p), ["b", "c", "a"]);
    }

    #[test]
    fn fifo_ignores_hits() {
        let mut p = OrderedPolicy::fifo();
        for k in ["a", "b", "c"] {
            p.on_insert(k, 1);
        }
        p.on_access(&"a");
        assert_eq!(drain(&mut p), ["a", "b", "c"]);
    }

    #[test]
    fn pinned_entries_are_skipped_and_removed_ones_forgotten() {
        for kind in [EvictionKind::Lru, EvictionKind::Fifo, EvictionKind::S3fifo] {
            let mut p = kind.build::<&'static str>(100);
            for k in ["a", "b", "c"] {
                p.on_insert(k, 1);
            }
            p.on_remove(&"b");
            assert_eq!(p.pop_victim(&mut |k| *k != "a"), Some("c"), "{kind:?}");
            assert_eq!(
                p.pop_victim(&mut |k| *k != "a"),
                None,
                "{kind:?}: only pinned left"
            );
            assert_eq!(p.len(), 1);
        }
    }

    #[test]
    fn s3fifo_evicts_one_hit_wonders_before_reused_entries() {
        // Capacity 100 bytes: the small queue targets 10 bytes.
        let mut p = S3Fifo::new(100);
        p.on_insert("hot", 10);
        p.on_access(&"hot");
        for k in ["x", "y", "z"] {
            p.on_insert(k, 10);
        }
        // "hot" was hit while in probation: it moves to main, the cold ones go first.
        assert_eq!(p.pop_victim(&mut |_| true), Some("x"));
        assert_eq!(p.pop_victim(&mut |_| true), Some("y"));
        assert_eq!(p.pop_victim(&mut |_| true), Some("z"));
        assert_eq!(p.pop_victim(&mut |_| true), Some("hot"));
    }

    #[test]
    fn s3fifo_ghost_hit_goes_straight_to_main() {
        let mut p = S3Fifo::new(100);
        p.on_insert("a", 10);
        assert_eq!(p.pop_victim(&mut |_| true), Some("a"));
        p.on_insert("a", 10); // ghost hit -> main
        p.on_insert("b", 10); // new -> small
        p.on_insert("c", 10); // new -> small (small now 20 bytes >= 10 target)
        assert_eq!(p.pop_victim(&mut |_| true), Some("b"));
        assert_eq!(p.pop_victim(&mut |_| true), Some("c"));
        assert_eq!(p.pop_victim(&mut |_| true), Some("a"));
    }

    #[test]
    fn s3fifo_main_gives_hit_entries_another_round() {
        let mut p = S3Fifo::new(100);
        // Route "a" and "b" into main through the ghost list.
        for k in ["a", "b"] {
            p.on_insert(k, 10);
            assert_eq!(p.pop_victim(&mut |_| true), Some(k));
            p.on_insert(k, 10);
        }
        p.on_access(&"a");
        // "a" is older but was hit: it is re-queued once, so "b" goes first.
        assert_eq!(drain(&mut p), ["b", "a"]);
    }

    #[test]
    fn kinds_parse() {
        assert_eq!(
            "S3-FIFO".parse::<EvictionKind>().unwrap(),
            EvictionKind::S3fifo
        );
        assert!("random".parse::<EvictionKind>().is_err());
    }
}
