//! `kvpool._native.Scheduler`: the scheduler half inside vLLM's EngineCore process. It asks
//! the worker ranks' pools over their lookup sockets (a worker in this process without it)
//! and builds each step's metadata.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorOutput, ConnectorScheduler, EngineRequest,
    ScheduledRequest, SocketLookup,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// How the Python side describes one scheduled request: id, position of the first new token,
/// new token ids, block update kind (0 unchanged, 1 append, 2 replace), block ids, tokens
/// computed after the step.
pub type ScheduledTuple = (String, usize, Vec<u32>, u8, Vec<u32>, usize);

/// Connects to the worker ranks and makes the Rust scheduler (one rank per socket). With
/// `answer_in_process`, ranks whose worker runs in this process are asked without their socket
/// ([`SocketLookup::answer_in_process`]).
pub fn connect_scheduler(
    socket_paths: &[PathBuf],
    config: ConnectorConfig,
    timeout: Duration,
    connect_deadline: Duration,
    answer_in_process: bool,
) -> Result<ConnectorScheduler, String> {
    let block_size = config.block_size;
    let (lookup, info) = SocketLookup::connect(socket_paths, timeout, connect_deadline)
        .map_err(|e| e.to_string())?;
    let lookup = if answer_in_process {
        lookup.answer_in_process()
    } else {
        lookup
    };
    let chunk_size = info.chunk_size as usize;
    if chunk_size == 0 || !chunk_size.is_multiple_of(block_size) {
        return Err(format!(
            "the workers' chunk size {chunk_size} is not a multiple of the block size {block_size}"
        ));
    }
    Ok(ConnectorScheduler::with_lookup(
        Box::new(lookup),
        chunk_size,
        info.hash_algorithm,
        info.probe_hash,
        ConnectorConfig {
            num_ranks: socket_paths.len() as u32,
            ..config
        },
    ))
}

/// Turns the Python tuples into scheduled requests.
pub fn scheduled_requests(items: Vec<ScheduledTuple>) -> Result<Vec<ScheduledRequest>, String> {
    items
        .into_iter()
        .map(
            |(req_id, new_tokens_start, new_token_ids, kind, blocks, computed)| {
                let blocks = match kind {
                    0 => BlockUpdate::Unchanged,
                    1 => BlockUpdate::Append(blocks),
                    2 => BlockUpdate::Replace(blocks),
                    other => return Err(format!("unknown block update kind {other}")),
                };
                Ok(ScheduledRequest {
                    req_id,
                    new_tokens_start,
                    new_token_ids,
                    blocks,
                    num_computed_tokens_after_step: computed,
                })
            },
        )
        .collect()
}

/// The scheduler half of the vLLM connector.
#[pyclass(name = "Scheduler", module = "kvpool._native")]
pub struct PyScheduler {
    inner: Mutex<ConnectorScheduler>,
}

fn guard(s: &PyScheduler) -> PyResult<std::sync::MutexGuard<'_, ConnectorScheduler>> {
    crate::lock(&s.inner)
}

#[pymethods]
impl PyScheduler {
    /// Connects to every worker rank's lookup socket (waiting up to `connect_timeout_ms` for
    /// them to listen); a lookup then takes at most `timeout_ms`, all ranks together, and
    /// counts as a miss past it. `load_timing`: `"auto"` (synchronous for chunks leased in
    /// memory and when no other request runs), `"leased"` (only for chunks leased in memory),
    /// `"always"` (every load asynchronous: when vLLM schedules asynchronously)
    /// or `"never"` (every load before the forward pass); `async_scheduling`: vLLM schedules
    /// asynchronously (a step's saves then always wait for the scheduler's commit); `loads`:
    /// false for an engine that never loads (vLLM's `kv_producer` role: no lookup is made).
    #[new]
    #[pyo3(signature = (*, socket_paths, block_size, save_decode_tokens=false, load_timing="auto", async_scheduling=false, timeout_ms=5000, connect_timeout_ms=120000, loads=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        socket_paths: Vec<String>,
        block_size: usize,
        save_decode_tokens: bool,
        load_timing: &str,
        async_scheduling: bool,
        timeout_ms: u64,
        connect_timeout_ms: u64,
        loads: bool,
    ) -> PyResult<Self> {
        let paths: Vec<PathBuf> = socket_paths.into_iter().map(PathBuf::from).collect();
        let load_timing = match load_timing {
            "auto" => kvpool_connector::LoadTiming::Auto,
            "leased" => kvpool_connector::LoadTiming::Leased,
            "always" => kvpool_connector::LoadTiming::Always,
            "never" => kvpool_connector::LoadTiming::Never,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown load timing `{other}` (expected auto, leased, always or never)"
                )));
            }
        };
        let config = ConnectorConfig {
            save_decode_tokens,
            load_timing,
            async_scheduling,
            loads,
            ..ConnectorConfig::new(block_size)
        };
        let sched = py
            .detach(|| {
                // vLLM's EngineCore holds its worker when `tensor_parallel_size` is 1: asked
                // in this process, without the socket.
                connect_scheduler(
                    &paths,
                    config,
                    Duration::from_millis(timeout_ms),
                    Duration::from_millis(connect_timeout_ms),
                    true,
                )
            })
            .map_err(PyRuntimeError::new_err)?;
        Ok(PyScheduler {
            inner: Mutex::new(sched),
        })
    }

    /// Tokens per chunk (from the workers).
    fn chunk_size(&self) -> PyResult<usize> {
        Ok(guard(self)?.chunk_size())
    }

    /// How this engine derives keys (`ConnectorScheduler::scope_digest`): engines whose
    /// digests differ never share a key (a hand-off names it).
    fn scope_digest(&self) -> PyResult<String> {
        Ok(guard(self)?.scope_digest())
    }

    /// vLLM `get_num_new_matched_tokens`: tokens beyond `num_computed_tokens` to load, and
    /// whether the load is asynchronous.
    #[pyo3(signature = (req_id, prompt_token_ids, extra_keys, num_computed_tokens, skip_save=false))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        req_id: String,
        prompt_token_ids: Vec<u32>,
        extra_keys: Vec<u8>,
        num_computed_tokens: usize,
        skip_save: bool,
    ) -> PyResult<(usize, bool)> {
        let request = EngineRequest {
            req_id,
            prompt_token_ids,
            skip_save,
            extra_keys,
        };
        py.detach(|| Ok(guard(self)?.get_num_new_matched_tokens(&request, num_computed_tokens)))
    }

    /// vLLM `update_state_after_alloc` with the request's full block list.
    fn update_state_after_alloc(
        &self,
        req_id: &str,
        block_ids: Vec<u32>,
        num_external_tokens: usize,
    ) -> PyResult<()> {
        guard(self)?.update_state_after_alloc(req_id, &block_ids, num_external_tokens);
        Ok(())
    }

    /// vLLM `build_connector_meta`: preempted requests first, then the scheduled ones (see
    /// [`ScheduledTuple`]); returns the encoded metadata for the workers.
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        scheduled: Vec<ScheduledTuple>,
        preempted: Vec<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let scheduled = scheduled_requests(scheduled).map_err(PyValueError::new_err)?;
        let bytes = {
            let mut s = guard(self)?;
            for id in &preempted {
                s.request_preempted(id);
            }
            s.build_connector_meta(&scheduled).encode()
        };
        Ok(PyBytes::new(py, &bytes))
    }

    /// The chained hashes of the request's full chunks so far (the keys its KV is stored
    /// under), one 16-byte string per chunk; empty for an unknown request.
    fn chunk_hashes<'py>(
        &self,
        py: Python<'py>,
        req_id: &str,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let s = guard(self)?;
        Ok(s.tracker(req_id)
            .map(|t| {
                t.hasher
                    .hashes()
                    .iter()
                    .map(|h| PyBytes::new(py, &h.0))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Whether every worker rank's pool holds each of `chunk_hashes` (16-byte strings), each
    /// on its own: a hybrid model's recurrent states, one value per boundary. Nothing is
    /// leased; a rank past the lookup timeout counts as not holding it.
    fn chunks_present(&self, py: Python<'_>, chunk_hashes: Vec<Vec<u8>>) -> PyResult<Vec<bool>> {
        let hashes = chunk_hashes
            .iter()
            .map(|h| crate::chunk_hash_of(h))
            .collect::<PyResult<Vec<_>>>()?;
        py.detach(|| Ok(guard(self)?.chunks_present(&hashes)))
    }

    /// The keys of the request's prompt tail blocks (`ConnectorScheduler::prompt_tail_hashes`),
    /// one 16-byte string per block; empty for an unknown request or no such block.
    fn tail_block_hashes<'py>(
        &self,
        py: Python<'py>,
        req_id: &str,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(guard(self)?
            .prompt_tail_hashes(req_id)
            .iter()
            .map(|h| PyBytes::new(py, &h.0))
            .collect())
    }

    /// vLLM `update_connector_output`: blocks the workers failed to load, asynchronous loads
    /// that ended, and the steps the workers ran and copied (`(step, ranks)` pairs).
    #[pyo3(signature = (failed_block_ids, finished_recving=Vec::new(), executed_steps=Vec::new(), copied_steps=Vec::new()))]
    fn update_connector_output(
        &self,
        failed_block_ids: Vec<u32>,
        finished_recving: Vec<String>,
        executed_steps: Vec<(u64, u32)>,
        copied_steps: Vec<(u64, u32)>,
    ) -> PyResult<()> {
        guard(self)?.update_connector_output(&ConnectorOutput {
            failed_block_ids,
            finished_recving,
            executed_steps,
            copied_steps,
        });
        Ok(())
    }

    /// How many tokens of each request's sequence the scheduler knows (`None`: untracked):
    /// the engine sends the tokens from there on.
    fn token_counts(&self, req_ids: Vec<String>) -> PyResult<Vec<Option<usize>>> {
        let s = guard(self)?;
        Ok(req_ids.iter().map(|id| s.token_count(id)).collect())
    }

    /// vLLM `has_pending_push_work`: step reports still owed or decisions not yet shipped.
    fn has_pending_work(&self) -> PyResult<bool> {
        Ok(guard(self)?.has_pending_work())
    }

    /// Tokens of the request's prompt its saves so far cover (see
    /// `ConnectorScheduler::saved_prompt_tokens`); asked before `request_finished`.
    fn saved_prompt_tokens(&self, req_id: &str) -> PyResult<usize> {
        Ok(guard(self)?.saved_prompt_tokens(req_id))
    }

    /// vLLM `request_finished`: drops the request; returns whether the engine must hold its
    /// blocks until the workers report it in `finished_sending` (a save may still be copying).
    fn request_finished(&self, req_id: &str) -> PyResult<bool> {
        Ok(guard(self)?.request_finished(req_id, &[]))
    }

    /// vLLM `reset_cache`: forgets every request and makes everything stored so far
    /// unreachable (a fresh random salt in every later key).
    fn reset(&self) -> PyResult<()> {
        guard(self)?.reset();
        Ok(())
    }

    /// Scheduler counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = guard(self)?;
        let d = PyDict::new(py);
        d.set_item("tracked_requests", s.tracked_requests())?;
        d.set_item("trackers_dropped", s.trackers_dropped())?;
        d.set_item("broken_promises", s.broken_promises())?;
        d.set_item("steps_given_up", s.steps_given_up())?;
        let c = s.counters();
        d.set_item("lookup_breaker_misses", c.breaker_misses)?;
        d.set_item("lookup_breakers_open", c.breakers_open)?;
        d.set_item("lookups_in_process", c.lookups_in_process)?;
        d.set_item("lookups_over_sockets", c.lookups_over_sockets)?;
        Ok(d)
    }
}

#[cfg(test)]
mod tests;
