//! `kvpool._native.Scheduler`: the scheduler half inside vLLM's EngineCore process. It asks
//! the worker ranks' pools over their lookup sockets and builds each step's metadata.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorOutput, ConnectorScheduler, EngineRequest, OffloadMode,
    ScheduledRequest, SocketLookup,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// How the Python side describes one scheduled request: id, new token ids, block update
/// kind (0 unchanged, 1 append, 2 replace), block ids, tokens computed after the step.
pub type ScheduledTuple = (String, Vec<u32>, u8, Vec<u32>, usize);

/// Connects to the worker ranks and makes the Rust scheduler.
pub fn connect_scheduler(
    socket_paths: &[PathBuf],
    block_size: usize,
    save_decode_tokens: bool,
    timeout: Duration,
    connect_deadline: Duration,
) -> Result<ConnectorScheduler, String> {
    let (lookup, info) = SocketLookup::connect(socket_paths, timeout, connect_deadline)
        .map_err(|e| e.to_string())?;
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
            block_size,
            save_unfull_chunk: false,
            save_decode_tokens,
            offload: OffloadMode::Eager,
        },
    ))
}

/// Turns the Python tuples into scheduled requests.
pub fn scheduled_requests(items: Vec<ScheduledTuple>) -> Result<Vec<ScheduledRequest>, String> {
    items
        .into_iter()
        .map(|(req_id, new_token_ids, kind, blocks, computed)| {
            let blocks = match kind {
                0 => BlockUpdate::Unchanged,
                1 => BlockUpdate::Append(blocks),
                2 => BlockUpdate::Replace(blocks),
                other => return Err(format!("unknown block update kind {other}")),
            };
            Ok(ScheduledRequest {
                req_id,
                new_token_ids,
                blocks,
                num_computed_tokens_after_step: computed,
            })
        })
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
    /// them to listen); lookups then time out after `timeout_ms` and count as misses.
    #[new]
    #[pyo3(signature = (*, socket_paths, block_size, save_decode_tokens=false, timeout_ms=5000, connect_timeout_ms=120000))]
    fn new(
        py: Python<'_>,
        socket_paths: Vec<String>,
        block_size: usize,
        save_decode_tokens: bool,
        timeout_ms: u64,
        connect_timeout_ms: u64,
    ) -> PyResult<Self> {
        let paths: Vec<PathBuf> = socket_paths.into_iter().map(PathBuf::from).collect();
        let sched = py
            .detach(|| {
                connect_scheduler(
                    &paths,
                    block_size,
                    save_decode_tokens,
                    Duration::from_millis(timeout_ms),
                    Duration::from_millis(connect_timeout_ms),
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

    /// vLLM `get_num_new_matched_tokens`: tokens beyond `num_computed_tokens` to load.
    #[pyo3(signature = (req_id, prompt_token_ids, extra_keys, num_computed_tokens, skip_save=false))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        req_id: String,
        prompt_token_ids: Vec<u32>,
        extra_keys: Vec<u8>,
        num_computed_tokens: usize,
        skip_save: bool,
    ) -> PyResult<usize> {
        let request = EngineRequest {
            req_id,
            prompt_token_ids,
            skip_save,
            extra_keys,
        };
        py.detach(|| {
            Ok(guard(self)?
                .get_num_new_matched_tokens(&request, num_computed_tokens)
                .0)
        })
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

    /// vLLM `update_connector_output`: blocks the workers failed to load.
    fn update_connector_output(&self, failed_block_ids: Vec<u32>) -> PyResult<()> {
        guard(self)?.update_connector_output(&ConnectorOutput {
            failed_block_ids,
            ..Default::default()
        });
        Ok(())
    }

    /// vLLM `request_finished`: drops the request; returns whether to delay the free (never).
    fn request_finished(&self, req_id: &str) -> PyResult<bool> {
        Ok(guard(self)?.request_finished(req_id, &[]).0)
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
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::py_worker::{WorkerCore, WorkerSpec};
    use kvpool_connector::vllm::VllmEngineFacts;
    use kvpool_core::Dtype;

    const BLOCK: usize = 4;
    const BLOCK_BYTES: usize = BLOCK * 2 * 2 * 4;

    fn spec_for_rank(
        layers: &mut [Vec<u8>],
        socket: PathBuf,
        tp_size: u32,
        tp_rank: u32,
    ) -> WorkerSpec {
        let mut s = spec(layers, socket);
        s.facts.tp_size = tp_size;
        s.facts.tp_rank = tp_rank;
        s
    }

    fn spec(layers: &mut [Vec<u8>], socket: PathBuf) -> WorkerSpec {
        WorkerSpec {
            config_text: "[chunking]\nchunk_size = 8\n[local_cpu]\nmax_size = \"1MiB\"\n".into(),
            config_format: "toml".into(),
            facts: VllmEngineFacts {
                model: "tiny".into(),
                tp_size: 1,
                tp_rank: 0,
                pp_rank: 0,
                block_size: BLOCK,
                num_layers: 2,
                num_kv_heads: 1,
                head_size: 2,
                dtype: Dtype::F32,
                kv_format: "test".into(),
            },
            layer_ptrs: layers.iter_mut().map(|l| l.as_mut_ptr() as usize).collect(),
            num_blocks: 16,
            block_stride_bytes: BLOCK_BYTES,
            socket_path: Some(socket),
        }
    }

    fn block(layers: &[Vec<u8>], layer: usize, b: usize) -> &[u8] {
        &layers[layer][b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES]
    }

    /// Scheduler and worker joined by the lookup socket, as in vLLM's two processes: a
    /// request's computed blocks are saved, and a second request with the same prefix in other
    /// blocks is told of the hit and gets exactly those bytes, block by block.
    #[test]
    fn second_request_loads_the_first_requests_blocks_through_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("w.sock");
        let mut layers: Vec<Vec<u8>> = (0..2)
            .map(|l| {
                (0..16 * BLOCK_BYTES)
                    .map(|i| ((i as u64 * 2654435761 + l as u64 * 97) >> 11) as u8)
                    .collect()
            })
            .collect();
        let s = spec(&mut layers, socket.clone());
        // SAFETY: `layers` outlives the worker (dropped at the end of the test).
        let mut worker = unsafe { WorkerCore::new(&s) }.unwrap();
        let mut sched = connect_scheduler(
            &[socket],
            BLOCK,
            false,
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .unwrap();
        let prompt: Vec<u32> = (100..117).collect(); // 17 tokens: two 8-token chunks + 1
        let a = EngineRequest {
            req_id: "a".into(),
            prompt_token_ids: prompt.clone(),
            skip_save: false,
            extra_keys: Vec::new(),
        };
        assert_eq!(sched.get_num_new_matched_tokens(&a, 0), (0, false));
        sched.update_state_after_alloc("a", &[1, 2, 3, 4, 5], 0);
        let meta = sched.build_connector_meta(
            &scheduled_requests(vec![("a".into(), vec![], 2, vec![1, 2, 3, 4, 5], 17)]).unwrap(),
        );
        worker.start_load(&meta.encode()).unwrap();
        worker.save().unwrap();
        assert_eq!(sched.request_finished("a", &[]), (false, None));

        // Same prompt under another LoRA adapter: no hit.
        let mut lora = a.clone();
        lora.req_id = "lora".into();
        lora.extra_keys = b"\x01\x01\x00\x00\x00x".to_vec();
        assert_eq!(sched.get_num_new_matched_tokens(&lora, 0), (0, false));
        sched.request_finished("lora", &[]);

        let mut b = a.clone();
        b.req_id = "b".into();
        assert_eq!(sched.get_num_new_matched_tokens(&b, 0), (16, false));
        sched.update_state_after_alloc("b", &[9, 10, 11, 12, 13], 16);
        let meta = sched.build_connector_meta(
            &scheduled_requests(vec![("b".into(), vec![], 2, vec![9, 10, 11, 12, 13], 17)])
                .unwrap(),
        );
        worker.start_load(&meta.encode()).unwrap();
        worker.save().unwrap();
        assert!(worker.failed_blocks().is_empty());
        drop(worker);
        for layer in 0..2 {
            for (src, dst) in [(1, 9), (2, 10), (3, 11), (4, 12)] {
                assert_eq!(block(&layers, layer, dst), block(&layers, layer, src));
            }
            assert_ne!(block(&layers, layer, 13), block(&layers, layer, 5));
        }
    }

    /// Tensor parallelism: the scheduler offers only what every rank can load.
    #[test]
    fn with_two_ranks_only_what_both_hold_is_offered() {
        let dir = tempfile::tempdir().unwrap();
        let sockets = [dir.path().join("tp0.sock"), dir.path().join("tp1.sock")];
        let mut layers: Vec<Vec<Vec<u8>>> = (0..2)
            .map(|_| (0..2).map(|_| vec![3u8; 16 * BLOCK_BYTES]).collect())
            .collect();
        let mut workers: Vec<WorkerCore> = layers
            .iter_mut()
            .enumerate()
            .map(|(rank, l)| {
                let s = spec_for_rank(l, sockets[rank].clone(), 2, rank as u32);
                // SAFETY: `layers` outlives the workers (dropped first, below).
                unsafe { WorkerCore::new(&s) }.unwrap()
            })
            .collect();
        let mut sched = connect_scheduler(
            &sockets,
            BLOCK,
            false,
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .unwrap();
        let prompt: Vec<u32> = (0..17).collect();
        let request = |id: &str| EngineRequest {
            req_id: id.into(),
            prompt_token_ids: prompt.clone(),
            skip_save: false,
            extra_keys: Vec::new(),
        };
        sched.get_num_new_matched_tokens(&request("a"), 0);
        sched.update_state_after_alloc("a", &[1, 2, 3, 4, 5], 0);
        let meta = sched
            .build_connector_meta(
                &scheduled_requests(vec![("a".into(), vec![], 2, vec![1, 2, 3, 4, 5], 17)])
                    .unwrap(),
            )
            .encode();
        // Only rank 0 saves (rank 1 missed the step, e.g. its store failed).
        workers[0].start_load(&meta).unwrap();
        workers[0].save().unwrap();
        sched.request_finished("a", &[]);
        assert_eq!(
            sched.get_num_new_matched_tokens(&request("b"), 0),
            (0, false)
        );
        workers[1].start_load(&meta).unwrap();
        workers[1].save().unwrap();
        sched.request_finished("b", &[]);
        assert_eq!(
            sched.get_num_new_matched_tokens(&request("c"), 0),
            (16, false)
        );
        drop(workers);
    }
}
