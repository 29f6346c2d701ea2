//! `CopyJob`: one batch of block copies between the engine's KV blocks and kvpool's host
//! chunks, the only thing the engine side executes (with torch in the Python connector, on
//! CPU or CUDA tensors alike; with [`crate::host_blocks`] in tests and the simulator).
//!
//! A chunk's bytes are its blocks, plane by plane: for engine plane `p` (every layer's planes
//! in layer order; one per layer for vLLM's CPU blocks, K and V for a flash-attention layer)
//! and block `b` of a chunk of `n` blocks, the `plane_block_bytes` of that block sit at
//! `(p * n + b) * plane_block_bytes`. Chunks of one job may hold different numbers of blocks
//! (whole chunks, then a prompt's tail blocks, one block each). A job covers whole chunks; a
//! load may skip the leading blocks of its first chunk (blocks the engine already holds).

use kvpool_core::{MemoryObjMut, SaveSlot};

use super::node_copies::LoadSource;

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// kvpool's chunks into the engine's blocks.
    Load,
    /// The engine's blocks into kvpool's chunks.
    Save,
}

/// What the engine side must copy, and where (addresses stay valid until the job is reported
/// done through [`crate::ConnectorWorker::copy_done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyJob {
    /// The job's id, to report it done.
    pub id: u64,
    /// Load or save.
    pub direction: CopyDirection,
    /// The request it serves.
    pub req_id: String,
    /// Engine block ids, one per chunk block from `skip_blocks` on, in chunk order (the
    /// blocks of chunk 0 from `skip_blocks`, then all of chunk 1's, and so on). A save may
    /// name a block twice (a tail block repeating a chunk's block); a load never does.
    pub block_ids: Vec<u32>,
    /// Leading blocks of the first chunk the job does not copy.
    pub skip_blocks: usize,
    /// Blocks in each chunk (one entry per chunk, as `chunk_ptrs`).
    pub chunk_blocks: Vec<usize>,
    /// Bytes of one block of a chunk, every plane: a chunk of `n` blocks is `n * block_bytes`.
    pub block_bytes: usize,
    /// Address of each chunk's host buffer (read for a load, written for a save).
    pub chunk_ptrs: Vec<usize>,
    /// Staged copies, one entry per chunk (or none at all): 0, or the address of a buffer of
    /// the chunk's bytes (`chunk_bytes(c)`) of the worker's, for a chunk whose host buffer
    /// lies in memory other processes can write (node memory), which the worker must not
    /// hash. The engine side fills it with the very bytes the chunk's copy moves, by the
    /// time the job is reported done:
    /// - a load reads such a chunk once: copied into the buffer first, the blocks then filled
    ///   from the buffer (kvpool-cuda's plans, CPU or GPU, and the torch path on CPU); on the
    ///   torch path on a GPU, copied to the device once, the blocks filled from that device
    ///   copy, which is then copied back into the buffer. The worker checks the buffer: a
    ///   chunk whose copy fails is reported as failed blocks, never KV;
    /// - a save gathers the chunk once: into the buffer, then copied from there into the
    ///   chunk's host buffer (the torch path on a GPU: into a device buffer, copied from there
    ///   into both). The worker hashes the chunk's checksum from the buffer.
    pub check_copy_ptrs: Vec<usize>,
    /// A load the engine runs in the background (the request waits until the worker reports
    /// it finished, after its checks): the engine side need not wait for its staged copies
    /// before the step's results leave the worker, as it must for a load the step's forward
    /// pass reads.
    pub asynchronous: bool,
}

impl CopyJob {
    /// Bytes the job moves.
    pub fn bytes(&self) -> usize {
        self.block_ids.len() * self.block_bytes
    }

    /// Bytes of chunk `c`'s host buffer.
    pub fn chunk_bytes(&self, c: usize) -> usize {
        self.chunk_blocks.get(c).copied().unwrap_or(0) * self.block_bytes
    }
}

/// The host memory a job's addresses point into, owned by the worker until the job is done.
pub(crate) enum JobMemory {
    /// A load's source chunks (read-only; those lent by node memory stay pinned until the
    /// copy is checked).
    Load(Vec<LoadSource>),
    /// A save's destinations (written by the engine side).
    Save(Vec<SaveDestination>),
}

/// Where a save copies one chunk.
#[derive(Debug)]
pub(crate) enum SaveDestination {
    /// A buffer of this process (L1's pool), stored through L1 once its step is committed.
    Memory(MemoryObjMut),
    /// A place node memory lends (the pool daemon's arena): sealed once copied, with a
    /// checksum hashed from the engine's blocks, or from the staged copy of the chunk (when
    /// the worker cannot read the blocks: see [`CopyJob::check_copy_ptrs`]), and committed
    /// there with its step.
    Slot(SaveSlot, Option<MemoryObjMut>),
}

impl JobMemory {
    /// Whether every place node memory lent the job may still be written (always, for memory
    /// of this process).
    pub(crate) fn lent_memory_usable(&self) -> bool {
        match self {
            JobMemory::Load(_) => true,
            JobMemory::Save(destinations) => destinations.iter().all(|d| match d {
                SaveDestination::Memory(_) => true,
                SaveDestination::Slot(slot, _) => slot.usable(),
            }),
        }
    }

    pub(crate) fn pointers(&mut self) -> Vec<usize> {
        match self {
            JobMemory::Load(chunks) => chunks.iter().map(LoadSource::address).collect(),
            JobMemory::Save(destinations) => destinations
                .iter_mut()
                .map(|d| match d {
                    SaveDestination::Memory(b) => b.as_mut_slice().as_mut_ptr() as usize,
                    SaveDestination::Slot(slot, _) => slot.payload_ptr(),
                })
                .collect(),
        }
    }

    /// A save's staged copies' addresses, one per chunk (0 where there is none); none at
    /// all when no chunk has one. A load's are planned with its checks.
    pub(crate) fn staged_save_pointers(&mut self) -> Vec<usize> {
        let JobMemory::Save(destinations) = self else {
            return Vec::new();
        };
        let pointers: Vec<usize> = destinations
            .iter_mut()
            .map(|d| match d {
                SaveDestination::Slot(_, Some(copy)) => copy.as_mut_slice().as_mut_ptr() as usize,
                _ => 0,
            })
            .collect();
        if pointers.iter().all(|&p| p == 0) {
            return Vec::new();
        }
        pointers
    }
}
