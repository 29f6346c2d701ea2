//! The single-request harness's GPU block pool: prefix caching by block hash, blocks freed
//! least recently used first, and the chunks an eviction hands over for lazy offload.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvpool_connector::EvictingChunk;
use kvpool_core::{ChunkHash, HashAlgorithm};

use thiserror::Error;

/// The GPU pool cannot hold a request.
#[derive(Debug, Error)]
#[error("request needs {needed} GPU blocks, {free} are free; raise gpu_blocks")]
pub struct GpuFull {
    /// Blocks needed.
    pub needed: usize,
    /// Blocks free.
    pub free: usize,
}

/// A cached prefix: its tokens (whole blocks), blocks and block hashes.
struct CachedPrefix {
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    hashes: Vec<ChunkHash>,
}

/// A prefix-caching GPU block pool.
pub(crate) struct GpuBlocks {
    free: VecDeque<u32>,
    refs: Vec<u32>,
    cached: HashMap<ChunkHash, u32>,
    hash_of: Vec<Option<ChunkHash>>,
    /// For a cached block: the prefix it was cached with, and its position in it.
    prefix_of: Vec<Option<(Arc<CachedPrefix>, usize)>>,
    block_size: usize,
    blocks_per_chunk: usize,
}

impl GpuBlocks {
    /// Blocks some request holds.
    pub(crate) fn blocks_in_use(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    pub(crate) fn new(n: usize, block_size: usize, chunk_size: usize) -> Self {
        GpuBlocks {
            free: (0..n as u32).collect(),
            refs: vec![0; n],
            cached: HashMap::new(),
            hash_of: vec![None; n],
            prefix_of: vec![None; n],
            block_size,
            blocks_per_chunk: (chunk_size / block_size).max(1),
        }
    }

    /// The chunk holding cached block `b`, if every block of that chunk still holds it.
    fn intact_chunk(&self, b: u32) -> Option<(Arc<CachedPrefix>, usize)> {
        let (prefix, pos) = self.prefix_of[b as usize].clone()?;
        let chunk = pos / self.blocks_per_chunk;
        let end = (chunk + 1) * self.blocks_per_chunk;
        if prefix.blocks.len() < end {
            return None; // a partial chunk is never saved
        }
        let intact = (chunk * self.blocks_per_chunk..end)
            .all(|j| self.hash_of[prefix.blocks[j] as usize] == Some(prefix.hashes[j]));
        intact.then_some((prefix, chunk))
    }

    fn block_hashes(&self, tokens: &[u32]) -> Vec<ChunkHash> {
        let algo = HashAlgorithm::Xxh3_128;
        let mut prev = algo.root();
        tokens
            .chunks_exact(self.block_size)
            .map(|b| {
                prev = algo.chain_tokens(&prev, b);
                prev
            })
            .collect()
    }

    /// Cached blocks of the longest prefix of full blocks, leaving at least one token to compute.
    pub(crate) fn lookup_and_pin(&mut self, tokens: &[u32]) -> Vec<u32> {
        let mut hit = Vec::new();
        for h in self.block_hashes(&tokens[..tokens.len() - 1]) {
            let Some(&b) = self.cached.get(&h) else { break };
            if self.refs[b as usize] == 0 {
                self.free.retain(|&f| f != b);
            }
            self.refs[b as usize] += 1;
            hit.push(b);
        }
        hit
    }

    /// Takes `n` free blocks, least recently freed first. Cached blocks among them leave the
    /// prefix cache; their intact chunks are returned so a lazy connector can save them first.
    pub(crate) fn allocate(&mut self, n: usize) -> Result<(Vec<u32>, Vec<EvictingChunk>), GpuFull> {
        if self.free.len() < n {
            return Err(GpuFull {
                needed: n,
                free: self.free.len(),
            });
        }
        let blocks: Vec<u32> = self.free.drain(..n).collect();
        // Check every chunk before any hash is cleared, so two blocks of one chunk evicted
        // together still find it intact (and it is saved once).
        let mut evicting = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for &b in &blocks {
            if let Some((prefix, chunk)) = self.intact_chunk(b)
                && seen.insert((Arc::as_ptr(&prefix), chunk))
            {
                let end = (chunk + 1) * self.blocks_per_chunk;
                evicting.push(EvictingChunk {
                    token_ids: prefix.tokens[..end * self.block_size].to_vec(),
                    block_ids: prefix.blocks[..end].to_vec(),
                });
            }
        }
        for &b in &blocks {
            if let Some(h) = self.hash_of[b as usize].take() {
                self.cached.remove(&h); // evicted from the GPU prefix cache
            }
            self.prefix_of[b as usize] = None;
            self.refs[b as usize] = 1;
        }
        Ok((blocks, evicting))
    }

    pub(crate) fn cache_full_blocks(&mut self, tokens: &[u32], blocks: &[u32]) {
        let hashes = self.block_hashes(tokens);
        let full = hashes.len();
        let prefix = Arc::new(CachedPrefix {
            tokens: tokens[..full * self.block_size].to_vec(),
            blocks: blocks[..full].to_vec(),
            hashes: hashes.clone(),
        });
        for (pos, (h, &b)) in hashes.into_iter().zip(blocks).enumerate() {
            if self.hash_of[b as usize].is_none() && !self.cached.contains_key(&h) {
                self.cached.insert(h, b);
                self.hash_of[b as usize] = Some(h);
                self.prefix_of[b as usize] = Some((prefix.clone(), pos));
            }
        }
    }

    pub(crate) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push_back(b);
            }
        }
    }

    pub(crate) fn evict_all(&mut self) {
        self.cached.clear();
        self.hash_of.iter_mut().for_each(|h| *h = None);
        self.prefix_of.iter_mut().for_each(|p| *p = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_intact_chunks_are_handed_over_at_eviction() {
        // 4-token blocks, 8-token chunks: a chunk is two blocks.
        let mut gpu = GpuBlocks::new(8, 4, 8);
        let tokens: Vec<u32> = (0..16).collect();
        let (blocks, none) = gpu.allocate(4).unwrap();
        assert!(none.is_empty());
        gpu.cache_full_blocks(&tokens, &blocks);
        gpu.release(&blocks);
        // Free order: the 4 unused blocks, then the prefix's blocks [0, 1, 2, 3].
        let (_, none) = gpu.allocate(4).unwrap();
        assert!(none.is_empty(), "never-cached blocks evict nothing");
        // Block 0 goes: chunk 0 (blocks 0 and 1) is still intact, so it is handed over.
        let (_, evicting) = gpu.allocate(1).unwrap();
        assert_eq!(evicting.len(), 1);
        assert_eq!(evicting[0].token_ids, (0..8).collect::<Vec<u32>>());
        assert_eq!(evicting[0].block_ids, vec![0, 1]);
        // Block 1 goes next: chunk 0 lost block 0 already, so it is not handed over again.
        let (_, evicting) = gpu.allocate(1).unwrap();
        assert!(
            evicting.is_empty(),
            "a chunk with a reused block must not be saved: {evicting:?}"
        );
        // Blocks 2 and 3 go together: chunk 1 is intact and handed over once.
        let (_, evicting) = gpu.allocate(2).unwrap();
        assert_eq!(evicting.len(), 1);
        assert_eq!(evicting[0].token_ids.len(), 16);
    }
}
