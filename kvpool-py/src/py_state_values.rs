//! `kvpool._native.StateValues`: a hybrid model's recurrent states, copied between vLLM's
//! state blocks (host memory) and the pool by the chunk hash of the prefix each follows.

use kvpool_connector::host_spans::{HostSpan, PageSpans};
use kvpool_connector::vllm::state_values::StateValues;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::py_worker::{PyWorker, core_guard};

/// `kvpool._native.StateValues`: a hybrid model's recurrent states (one KV cache group's)
/// read and written by the chunk hash of the prefix each follows
/// ([`kvpool_connector::vllm::state_values`]), over a state part's worker.
#[pyclass(name = "StateValues", module = "kvpool._native", frozen)]
pub struct PyStateValues {
    values: StateValues,
}

/// Host spans from Python's `(address, length)` pairs, each checked not to wrap.
fn host_spans(spans: Vec<(usize, usize)>) -> PyResult<PageSpans> {
    spans
        .into_iter()
        .map(|(addr, len)| {
            kvpool_connector::address_range::strided_range_end("a state block", addr, 1, 0, len)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            Ok(HostSpan { addr, len })
        })
        .collect()
}

#[pymethods]
impl PyStateValues {
    /// States of `value_bytes` (every layer of the group) in `worker`'s key scope and pool,
    /// which `owner` built (a state may not be larger than one of the owner's chunks: the
    /// tiers were opened for those); `block_size` is the engine's.
    #[new]
    fn new(
        worker: PyRef<'_, PyWorker>,
        owner: PyRef<'_, PyWorker>,
        value_bytes: usize,
        block_size: u32,
    ) -> PyResult<Self> {
        let (engine, runtime) = {
            let core = core_guard(&worker)?;
            (core.worker.engine().clone(), core.runtime.clone())
        };
        let max_value_bytes = {
            let owner = core_guard(&owner)?;
            let engine = owner.worker.engine();
            engine
                .layout()
                .chunk_bytes(engine.token_database().chunk_size())
        };
        let values = StateValues::new(engine, runtime, value_bytes, max_value_bytes, block_size)
            .map_err(PyValueError::new_err)?;
        Ok(Self { values })
    }

    /// Copies the state after the prefix `chunk_hash` names into `spans` (`(address, length)`
    /// pairs of the engine's state block, one per layer); false (logged) when no tier holds a
    /// value that fits.
    ///
    /// The caller guarantees the spans are the engine's own host memory, written by nothing
    /// else during the call (the block vLLM allocated for the load, before its forward pass).
    fn read(
        &self,
        py: Python<'_>,
        chunk_hash: &[u8],
        spans: Vec<(usize, usize)>,
    ) -> PyResult<bool> {
        let prefix = crate::chunk_hash_of(chunk_hash)?;
        let spans = host_spans(spans)?;
        // SAFETY: the Python side passes the spans of a state block vLLM allocated for this
        // load, valid host memory nothing else writes before the forward pass (see above).
        let read = py.detach(|| unsafe { self.values.read(prefix, &spans) });
        match read {
            Ok(()) => Ok(true),
            Err(e) => {
                tracing::warn!(error = %e, "kvpool: a recurrent state could not be loaded; its request is recomputed");
                Ok(false)
            }
        }
    }

    /// Stores the state in each block's `spans` under the prefix its chunk hash names (those
    /// some tier holds already are left); returns how many were stored anew.
    ///
    /// The caller guarantees the spans are the engine's own host memory, unchanged during the
    /// call (vLLM's worker calls it after the step's forward pass).
    fn write(
        &self,
        py: Python<'_>,
        chunk_hashes: Vec<Vec<u8>>,
        spans: Vec<Vec<(usize, usize)>>,
    ) -> PyResult<usize> {
        let states = chunk_hashes
            .iter()
            .zip(spans)
            .map(|(h, s)| Ok((crate::chunk_hash_of(h)?, host_spans(s)?)))
            .collect::<PyResult<Vec<_>>>()?;
        // SAFETY: the Python side passes the spans of the state blocks vLLM offered in this
        // step, valid host memory the forward pass is done with (see above).
        match py.detach(|| unsafe { self.values.write(&states) }) {
            Ok(stored) => Ok(stored),
            Err(e) => {
                tracing::warn!(error = %e, "kvpool: recurrent states were not stored");
                Ok(0)
            }
        }
    }
}
