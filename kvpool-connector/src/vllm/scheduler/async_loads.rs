//! Asynchronous loads the engine waits on: handed to the workers in the step after their
//! lookup while vLLM keeps the request out of its batches (`WAITING_FOR_REMOTE_KVS`); a
//! promised load the engine's blocks do not cover, reported as failed blocks; and a hit the
//! engine found no blocks for, dropped (it looks the request up again).

use std::collections::HashSet;

use super::{ConnectorScheduler, RequestTracker};
use crate::vllm::metadata::{LoadSpec, ReqMeta};

impl ConnectorScheduler {
    /// Drops the hits of requests the engine looked up and then found no blocks for (no
    /// `update_state_after_alloc` since the lookup; `listed` holds the requests scheduled in
    /// this step): vLLM leaves such a request waiting and looks it up again in a later step,
    /// so its hit promised nothing. Its lease stays until a later lookup replaces it, the
    /// request ends, or the lease's time to live runs out.
    pub(super) fn drop_hits_without_blocks(&mut self, listed: &HashSet<&str>) {
        for (id, t) in &mut self.trackers {
            if t.load_awaits_blocks && !listed.contains(id.as_str()) {
                tracing::debug!(req = %id, "no blocks for the request's hit this step; it is looked up again");
                t.load = None;
                t.load_tail.clear();
                t.load_awaits_blocks = false;
            }
        }
    }

    /// The asynchronous loads of requests the engine is not scheduling in this step (`listed`
    /// holds those it is), in request-id order. A load the request's blocks do not cover is
    /// not issued: its blocks go to `unloadable_blocks`, so the engine recomputes them.
    pub(super) fn waiting_async_loads(
        &mut self,
        listed: &HashSet<&str>,
        unloadable_blocks: &mut Vec<u32>,
    ) -> Vec<ReqMeta> {
        let (chunk, block_size) = (self.chunk_size, self.config.block_size);
        let mut waiting: Vec<String> = self
            .trackers
            .iter()
            .filter(|(id, t)| {
                !listed.contains(id.as_str()) && t.load.is_some_and(|l| l.asynchronous)
            })
            .map(|(id, _)| id.clone())
            .collect();
        waiting.sort();
        let mut requests = Vec::new();
        for id in waiting {
            let t = self.trackers.get_mut(&id).expect("listed above");
            let l = t.load.take().expect("filtered above");
            if !t.blocks_cover(&l, block_size) {
                t.fail_uncovered_load(&id, &l, block_size, unloadable_blocks);
                self.broken_promises += 1;
                continue;
            }
            t.load_in_flight = true;
            let needed = l.load_until as usize;
            requests.push(ReqMeta {
                chunk_hashes: t.chunk_hashes_until(needed, chunk),
                block_ids: t.block_ids[..needed.div_ceil(block_size)].to_vec(),
                load: Some(l),
                save: None,
                load_tail: std::mem::take(&mut t.load_tail),
                save_tail: Vec::new(),
                save_tail_start: 0,
                req_id: id,
            });
        }
        requests
    }
}

impl RequestTracker {
    /// Whether the request's blocks reach the end of a promised load.
    pub(super) fn blocks_cover(&self, load: &LoadSpec, block_size: usize) -> bool {
        self.block_ids.len() * block_size >= load.load_until as usize
    }

    /// Drops a promised load the engine's blocks do not cover (which vLLM never does, but an
    /// engine might): its blocks from the engine's cached prefix on are listed in
    /// `unloadable_blocks`, so the engine recomputes them instead of reading unwritten KV.
    pub(super) fn fail_uncovered_load(
        &mut self,
        req_id: &str,
        load: &LoadSpec,
        block_size: usize,
        unloadable_blocks: &mut Vec<u32>,
    ) {
        tracing::error!(req = %req_id, load_until = load.load_until, blocks = self.block_ids.len(), "the engine's blocks do not cover a promised load; reporting them as failed");
        let first = load.gpu_cached_tokens as usize / block_size;
        unloadable_blocks.extend(self.block_ids.iter().skip(first).copied());
        self.load_tail.clear();
    }
}
