//! The chunk tail: a prompt's whole blocks in the chunk its last token falls in, keyed one block
//! at a time (`HashAlgorithm::chain_tail_blocks`, chained on the chunk before them), so an
//! exact repeat is served to its last whole block as vLLM's own prefix cache would
//! (docs/keys.md).

use kvpool_core::{ChunkHash, HashAlgorithm};

use super::{ConnectorScheduler, RequestTracker};

impl ConnectorScheduler {
    /// What the pool holds of a request's first `limit` tokens, in tokens: the leading whole
    /// chunks, then, past the last one found, the tail blocks of the next chunk (blocks keyed
    /// one by one, stored for prompts whose last token fell in that chunk). Returns the hit, how much
    /// of it is leased in memory, and the tail-block keys the hit includes. A second lookup
    /// runs only when a whole chunk before the last is missing (a longer prompt over an
    /// earlier, shorter one).
    pub(super) fn lookup_prompt(
        &mut self,
        req_id: &str,
        limit: usize,
    ) -> (usize, usize, Vec<[u8; 16]>) {
        let (cs, bs) = (self.chunk_size, self.config.block_size.max(1));
        let t = &self.trackers[req_id];
        let full = (limit / cs).min(t.hasher.hashes().len());
        let chunk_hashes: Vec<ChunkHash> = t.hasher.hashes()[..full].to_vec();
        // Loading the daemon's chunks at lookup pays only where leasing them makes the load
        // synchronous.
        let load_node_memory = matches!(
            self.config.load_timing,
            crate::LoadTiming::Auto | crate::LoadTiming::Leased
        );
        let mut run = |chunks: usize| -> (crate::vllm::leases::LookupAnswer, Vec<ChunkHash>) {
            let tail = self.tail_hashes(req_id, chunks, limit);
            let mut hashes = chunk_hashes[..chunks].to_vec();
            hashes.extend_from_slice(&tail);
            (self.lookup.lookup(req_id, &hashes, load_node_memory), tail)
        };
        let (mut answer, mut tail) = run(full);
        let mut chunks = full;
        if answer.chunks < full && cs > bs {
            // A whole chunk is missing: an earlier prompt may have ended inside it.
            chunks = answer.chunks;
            (answer, tail) = run(chunks);
        }
        let tokens =
            |entries: usize| entries.min(chunks) * cs + entries.saturating_sub(chunks) * bs;
        let tail_hit = answer.chunks.saturating_sub(chunks).min(tail.len());
        (
            tokens(answer.chunks),
            tokens(answer.leased),
            tail[..tail_hit].iter().map(|h| h.0).collect(),
        )
    }

    /// The tail-block keys of chunk `chunk` of a request's tokens: one per whole block of the
    /// chunk below token `limit` (never the whole chunk), chained on chunk `chunk - 1`.
    fn tail_hashes(&self, req_id: &str, chunk: usize, limit: usize) -> Vec<ChunkHash> {
        let (cs, bs) = (self.chunk_size, self.config.block_size.max(1));
        let Some(t) = self.trackers.get(req_id) else {
            return Vec::new();
        };
        let start = chunk * cs;
        let end = limit.min(t.token_ids.len()).min(start + cs - 1);
        if end <= start || cs <= bs {
            return Vec::new();
        }
        self.hash_algorithm
            .chain_tail_blocks(&t.chunk_before(chunk), &t.token_ids[start..end], bs)
    }
}

impl RequestTracker {
    /// The hash chunk `chunk`'s keys are chained on: the request's root for the first chunk,
    /// else the hash of the chunk before it.
    fn chunk_before(&self, chunk: usize) -> ChunkHash {
        match chunk {
            0 => self.hasher.root(),
            c => self.hasher.hashes()[c - 1],
        }
    }

    /// The prompt's tail-block keys to save in this step, or none: once the prompt is computed
    /// up to its last tail block (`computed`), every whole chunk before the tail is saved by
    /// the end of this step (`saved_after`), and the tail was not saved before. The keys'
    /// blocks start at [`prompt_tail_range`]'s start.
    pub(super) fn tail_to_save(
        &self,
        hash_algorithm: &HashAlgorithm,
        chunk_size: usize,
        block_size: usize,
        saved_after: usize,
        computed: usize,
    ) -> Vec<[u8; 16]> {
        let (tail_start, tail_end) = prompt_tail_range(self.prompt_len, chunk_size, block_size);
        if self.skip_save
            || self.tail_saved
            || tail_end <= tail_start
            || saved_after < tail_start
            || computed < tail_end
        {
            return Vec::new();
        }
        self.prompt_tail_hashes(hash_algorithm, chunk_size, block_size)
            .iter()
            .map(|h| h.0)
            .collect()
    }

    /// The keys of the prompt's tail blocks ([`prompt_tail_range`]), one per block, in order;
    /// empty when the range holds no whole block.
    pub(crate) fn prompt_tail_hashes(
        &self,
        hash_algorithm: &HashAlgorithm,
        chunk_size: usize,
        block_size: usize,
    ) -> Vec<ChunkHash> {
        let (tail_start, tail_end) = prompt_tail_range(self.prompt_len, chunk_size, block_size);
        if tail_end <= tail_start {
            return Vec::new();
        }
        hash_algorithm.chain_tail_blocks(
            &self.chunk_before(tail_start / chunk_size),
            &self.token_ids[tail_start..tail_end],
            block_size,
        )
    }
}

/// The tokens of a `prompt_len`-token prompt keyed block by block (its tail): the whole
/// blocks of the chunk its last token falls in, but never that chunk's last block (a chunk
/// that whole is stored as a chunk). For a prompt that ends inside a chunk, its whole blocks
/// past its last whole chunk; for one that ends on a chunk boundary, its last chunk's blocks
/// but the last: a repeat of the prompt never loads its last token, so its lookup stops
/// before that chunk and finds these blocks instead (vLLM's own prefix cache serves such a
/// repeat to the block before the last, and so does the pool). Returns `(start, end)`; empty
/// (`end <= start`) for an empty prompt or when a chunk is one block.
pub(crate) fn prompt_tail_range(
    prompt_len: usize,
    chunk_size: usize,
    block_size: usize,
) -> (usize, usize) {
    if prompt_len == 0 || chunk_size <= block_size {
        return (0, 0);
    }
    let start = (prompt_len - 1) / chunk_size * chunk_size;
    let end = (prompt_len / block_size * block_size).min(start + chunk_size - block_size);
    (start, end)
}

#[cfg(test)]
mod tests {
    use super::prompt_tail_range;

    #[test]
    fn the_tail_is_the_whole_blocks_of_the_chunk_the_last_token_falls_in() {
        // Chunks of 16 tokens, blocks of 4.
        assert_eq!(prompt_tail_range(0, 16, 4), (0, 0));
        assert_eq!(prompt_tail_range(3, 16, 4), (0, 0));
        assert_eq!(prompt_tail_range(9, 16, 4), (0, 8));
        assert_eq!(prompt_tail_range(15, 16, 4), (0, 12));
        // Ending on a chunk boundary: that chunk's blocks but its last.
        assert_eq!(prompt_tail_range(16, 16, 4), (0, 12));
        assert_eq!(prompt_tail_range(48, 16, 4), (32, 44));
        // Past a boundary: the blocks after it.
        assert_eq!(prompt_tail_range(17, 16, 4), (16, 16));
        assert_eq!(prompt_tail_range(40, 16, 4), (32, 40));
        // One block per chunk: no tail.
        assert_eq!(prompt_tail_range(40, 4, 4), (0, 0));
    }
}
