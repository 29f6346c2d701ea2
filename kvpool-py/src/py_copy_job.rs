//! `kvpool._native.CopyJob`: one job of block copies as Python sees it, named read-only
//! fields over kvpool-connector's `CopyJob`.

use kvpool_connector::{CopyDirection, CopyJob};
use pyo3::prelude::*;

/// One job of block copies for Python (`Worker.load_jobs` / `save_jobs`): kvpool-connector's
/// [`CopyJob`] with named, read-only fields, which `kvpool.transfer`'s torch path reads and
/// `CopyEngine.run` runs as it is (no conversion). Made in Python by tests and the GPU check.
#[pyclass(name = "CopyJob", module = "kvpool._native", frozen)]
pub struct PyCopyJob(pub(crate) CopyJob);

#[pymethods]
impl PyCopyJob {
    /// A job from its fields (keywords only), as the worker would plan it.
    #[new]
    #[pyo3(signature = (*, id, is_load, req_id, block_ids, skip_blocks, chunk_blocks,
        block_bytes, chunk_ptrs, check_copy_ptrs=Vec::new(), asynchronous=false))]
    #[allow(clippy::too_many_arguments)] // Python's keywords: the job's fields, named.
    fn new(
        id: u64,
        is_load: bool,
        req_id: String,
        block_ids: Vec<u32>,
        skip_blocks: usize,
        chunk_blocks: Vec<usize>,
        block_bytes: usize,
        chunk_ptrs: Vec<usize>,
        check_copy_ptrs: Vec<usize>,
        asynchronous: bool,
    ) -> Self {
        Self(CopyJob {
            id,
            direction: if is_load {
                CopyDirection::Load
            } else {
                CopyDirection::Save
            },
            req_id,
            block_ids,
            skip_blocks,
            chunk_blocks,
            block_bytes,
            chunk_ptrs,
            check_copy_ptrs,
            asynchronous,
        })
    }

    /// The job's id, to report it done (`Worker.copy_done`).
    #[getter]
    fn id(&self) -> u64 {
        self.0.id
    }

    /// Whether it copies kvpool's chunks into the engine's blocks (else the blocks out).
    #[getter]
    fn is_load(&self) -> bool {
        self.0.direction == CopyDirection::Load
    }

    /// The request it serves.
    #[getter]
    fn req_id(&self) -> &str {
        &self.0.req_id
    }

    /// Engine block ids, one per chunk block from `skip_blocks` on, in chunk order.
    #[getter]
    fn block_ids(&self) -> Vec<u32> {
        self.0.block_ids.clone()
    }

    /// Leading blocks of the first chunk the job does not copy (a load's blocks the engine
    /// already holds).
    #[getter]
    fn skip_blocks(&self) -> usize {
        self.0.skip_blocks
    }

    /// Blocks in each chunk, one entry per chunk.
    #[getter]
    fn chunk_blocks(&self) -> Vec<usize> {
        self.0.chunk_blocks.clone()
    }

    /// Bytes of one block of a chunk, every plane.
    #[getter]
    fn block_bytes(&self) -> usize {
        self.0.block_bytes
    }

    /// Address of each chunk's host buffer (read for a load, written for a save).
    #[getter]
    fn chunk_ptrs(&self) -> Vec<usize> {
        self.0.chunk_ptrs.clone()
    }

    /// Per chunk: 0, or the worker's buffer for the chunk's staged copy (a load's, checked;
    /// a save's, hashed for its seal). Empty when no chunk has one.
    #[getter]
    fn check_copy_ptrs(&self) -> Vec<usize> {
        self.0.check_copy_ptrs.clone()
    }

    /// A load the request waits for in the background (not read by this step's forward pass).
    #[getter]
    fn asynchronous(&self) -> bool {
        self.0.asynchronous
    }

    fn __repr__(&self) -> String {
        let j = &self.0;
        format!(
            "CopyJob(id={}, is_load={}, req_id={:?}, chunks={}, blocks={}, skip_blocks={}, \
             block_bytes={}, asynchronous={})",
            j.id,
            self.is_load(),
            j.req_id,
            j.chunk_ptrs.len(),
            j.block_ids.len(),
            j.skip_blocks,
            j.block_bytes,
            if j.asynchronous { "True" } else { "False" },
        )
    }
}
