//! The simulated engine's KV blocks: a prefix-caching block pool, as vLLM's (blocks cached by
//! their chain hash at allocation, free blocks stay cached until reused, least recently freed
//! first).

use std::collections::{HashMap, VecDeque};

use super::model::SimRequest;

/// The block pool.
pub(super) struct Gpu {
    free: VecDeque<u32>,
    refs: Vec<u32>,
    cached: HashMap<u64, u32>,
    hash_of: Vec<Option<u64>>,
    block_size: usize,
}

impl Gpu {
    pub(super) fn new(blocks: usize, block_size: usize) -> Self {
        Gpu {
            free: (0..blocks as u32).collect(),
            refs: vec![0; blocks],
            cached: HashMap::new(),
            hash_of: vec![None; blocks],
            block_size,
        }
    }

    fn block_hashes(&self, states: &[u64], upto: usize) -> Vec<u64> {
        (0..upto / self.block_size)
            .map(|b| states[(b + 1) * self.block_size - 1])
            .collect()
    }

    /// Cached blocks of the longest prefix of full blocks of `tokens[..n-1]`, pinned.
    pub(super) fn lookup(&mut self, req: &SimRequest) -> Vec<u32> {
        let mut hit = Vec::new();
        for h in self.block_hashes(&req.states, req.prompt_len - 1) {
            let Some(&b) = self.cached.get(&h) else { break };
            if self.refs[b as usize] == 0 {
                self.free.retain(|&f| f != b);
            }
            self.refs[b as usize] += 1;
            hit.push(b);
        }
        hit
    }

    pub(super) fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let blocks: Vec<u32> = self.free.drain(..n).collect();
        for &b in &blocks {
            if let Some(h) = self.hash_of[b as usize].take() {
                self.cached.remove(&h);
            }
            self.refs[b as usize] = 1;
        }
        Some(blocks)
    }

    /// Caches the request's full blocks of `tokens[..upto]` (vLLM does so at allocation, or
    /// for an asynchronous load once it ended).
    pub(super) fn cache(&mut self, req: &SimRequest, upto: usize) {
        for (h, &b) in self
            .block_hashes(&req.states, upto.min(req.prompt_len))
            .iter()
            .zip(&req.blocks)
        {
            if self.hash_of[b as usize].is_none() && !self.cached.contains_key(h) {
                self.cached.insert(*h, b);
                self.hash_of[b as usize] = Some(*h);
            }
        }
    }

    pub(super) fn uncache(&mut self, b: u32) {
        if let Some(h) = self.hash_of[b as usize].take() {
            self.cached.remove(&h);
        }
    }

    pub(super) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push_back(b);
            }
        }
    }
}
