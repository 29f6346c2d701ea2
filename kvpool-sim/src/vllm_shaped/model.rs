//! The simulated model: a token's KV row depends on its whole prefix (a chained state), and a
//! forward pass that reads a wrong row anywhere in the request's earlier positions (on any
//! rank: tensor-parallel attention is all-reduced) writes wrong rows, as attention does.
//!
//! Rows become wrong only where a load was due (a failed load leaves stale bytes) or where a
//! pass computed on wrong rows; those blocks are *suspect* per rank until a check finds every
//! row of the block right, so a pass checks only the few suspect blocks it reads.

use std::collections::BTreeSet;

use kvpool_core::{HostPagedKvCache, KvLayout};

/// One request of the simulated engine.
pub(super) struct SimRequest {
    pub(super) id: String,
    pub(super) prompt_len: usize,
    pub(super) tokens: Vec<u32>,
    /// `states[i]`: the model state after token `i` (KV of position `i` derives from it).
    pub(super) states: Vec<u64>,
    pub(super) blocks: Vec<u32>,
    /// Tokens whose KV is (believed) in the blocks.
    pub(super) computed: usize,
    pub(super) decode_left: usize,
    pub(super) new_blocks: Vec<u32>,
    pub(super) replace_blocks: bool,
    /// The step that last computed for it.
    pub(super) last_step: u64,
}

impl SimRequest {
    pub(super) fn new(id: String, decode_left: usize) -> Self {
        SimRequest {
            id,
            prompt_len: 0,
            tokens: Vec::new(),
            states: Vec::new(),
            blocks: Vec::new(),
            computed: 0,
            decode_left,
            new_blocks: Vec::new(),
            replace_blocks: true,
            last_step: 0,
        }
    }

    pub(super) fn push_token(&mut self, t: u32) {
        let prev = self.states.last().copied().unwrap_or(0x6b76706f6f6c);
        self.states.push(prefix_state(prev, t, self.tokens.len()));
        self.tokens.push(t);
    }
}

fn prefix_state(prev: u64, token: u32, pos: usize) -> u64 {
    xxhash_rust::xxh3::xxh3_64(
        &[
            prev.to_le_bytes(),
            (token as u64 | (pos as u64) << 32).to_le_bytes(),
        ]
        .concat(),
    )
}

/// What a pass that read wrong KV writes instead of the state's row.
const POISON: u64 = 0x9e37_79b9_7f4a_7c15;

fn model_row(state: u64, layer: usize, plane: usize, row: &mut [u8]) {
    let mut x = (state ^ ((layer as u64) << 40) ^ ((plane as u64) << 48)) | 1;
    for b in row.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// The model over every rank's KV cache.
pub(super) struct Model {
    layout: KvLayout,
    /// Per rank, blocks whose rows may be wrong.
    suspect: Vec<BTreeSet<u32>>,
    row: Vec<u8>,
    got: Vec<u8>,
}

impl Model {
    pub(super) fn new(layout: KvLayout, ranks: usize) -> Self {
        let n = layout.bytes_per_token_per_plane();
        Model {
            layout,
            suspect: vec![BTreeSet::new(); ranks],
            row: vec![0; n],
            got: vec![0; n],
        }
    }

    /// Blocks a load was due to write: suspect on every rank until checked.
    pub(super) fn loads_due(&mut self, blocks: &[u32]) {
        for s in &mut self.suspect {
            s.extend(blocks);
        }
    }

    fn slot(&self, req: &SimRequest, pos: usize) -> usize {
        let bs = self.layout.block_size;
        req.blocks[pos / bs] as usize * bs + pos % bs
    }

    /// Whether position `pos` of `req` holds the right row on `kv`.
    fn row_right(&mut self, kv: &HostPagedKvCache, req: &SimRequest, pos: usize) -> bool {
        let slot = self.slot(req, pos);
        for layer in 0..self.layout.num_layers {
            for plane in 0..self.layout.kind.planes() {
                model_row(req.states[pos], layer, plane, &mut self.row);
                self.got.copy_from_slice(kv.row(layer, plane, slot));
                if self.got != self.row {
                    return false;
                }
            }
        }
        true
    }

    /// Whether every row of `req`'s positions `0..upto` is right on every rank, checking
    /// only suspect blocks (a block found right is cleared).
    fn prefix_right(&mut self, kvs: &[&HostPagedKvCache], req: &SimRequest, upto: usize) -> bool {
        let bs = self.layout.block_size;
        let mut right = true;
        for (rank, kv) in kvs.iter().enumerate() {
            for (b, &block) in req.blocks.iter().enumerate().take(upto.div_ceil(bs)) {
                if !self.suspect[rank].contains(&block) {
                    continue;
                }
                let end = ((b + 1) * bs).min(upto);
                let ok = (b * bs..end).all(|pos| self.row_right(kv, req, pos));
                if ok && end == (b + 1) * bs {
                    self.suspect[rank].remove(&block);
                }
                right &= ok;
            }
        }
        right
    }

    /// The forward pass of `req` over positions `from..to` on every rank: right rows if every
    /// earlier row is right, else poisoned rows (and the blocks become suspect).
    pub(super) fn compute(
        &mut self,
        kvs: &mut [&mut HostPagedKvCache],
        req: &SimRequest,
        from: usize,
        to: usize,
    ) {
        let poisoned = {
            let views: Vec<&HostPagedKvCache> = kvs.iter().map(|k| &**k).collect();
            !self.prefix_right(&views, req, from)
        };
        let bs = self.layout.block_size;
        for pos in from..to {
            let slot = self.slot(req, pos);
            let state = if poisoned {
                req.states[pos] ^ POISON
            } else {
                req.states[pos]
            };
            for kv in kvs.iter_mut() {
                for layer in 0..self.layout.num_layers {
                    for plane in 0..self.layout.kind.planes() {
                        model_row(state, layer, plane, &mut self.row);
                        kv.row_mut(layer, plane, slot).copy_from_slice(&self.row);
                    }
                }
            }
            if poisoned {
                let block = req.blocks[pos / bs];
                for s in &mut self.suspect {
                    s.insert(block);
                }
            }
        }
    }

    /// Positions of `req` (of `0..upto`) whose row is wrong on some rank.
    pub(super) fn wrong_positions(
        &mut self,
        kvs: &[&HostPagedKvCache],
        req: &SimRequest,
        upto: usize,
    ) -> usize {
        (0..upto)
            .filter(|&pos| !kvs.iter().all(|kv| self.row_right(kv, req, pos)))
            .count()
    }
}
