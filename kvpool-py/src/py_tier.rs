//! `kvpool._native.OffloadTier`: kvpool as a secondary tier of vLLM's native offloading, for
//! `kvpool.vllm.tier.KvpoolTier` (the Rust side is `kvpool_connector::vllm_tier`).

use kvpool_connector::opaque_values::ValueScope;
use kvpool_connector::vllm_tier::{OffloadTier, PrimaryRegion, TierLookup};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// One finished job: (job id, success, leading keys loaded (loads only), bytes, seconds).
type FinishedJob = (u64, bool, Option<usize>, u64, f64);

/// kvpool's tiers behind vLLM's CPU primary region: lookups, store and load jobs by row id.
#[pyclass(name = "OffloadTier", module = "kvpool._native", frozen)]
pub struct PyOffloadTier {
    tier: OffloadTier,
    tier_names: Vec<String>,
}

#[pymethods]
impl PyOffloadTier {
    /// Builds the pool from the user's config fitted to the region (`rows` rows of
    /// `row_bytes` at address `base`) and the key scope `model_scope` / `world_size`.
    ///
    /// Only `kvpool.vllm.tier` constructs this: it passes the address of vLLM's primary
    /// memoryview and keeps the view alive for the tier's life, and vLLM pins a job's rows
    /// until the job is reported finished.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config_text: &str,
        config_format: &str,
        model_scope: &str,
        world_size: u32,
        base: usize,
        rows: usize,
        row_bytes: usize,
        tokens_per_row: u32,
    ) -> PyResult<Self> {
        if base == 0 || rows == 0 {
            return Err(PyValueError::new_err(
                "kvpool: vLLM's primary region is empty (no address or no rows)",
            ));
        }
        // SAFETY: see this constructor's doc: the caller keeps the region alive and vLLM pins
        // a job's rows until it is reported.
        let region = unsafe { PrimaryRegion::new(base, rows, row_bytes) }
            .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))?;
        py.detach(|| {
            let built = crate::ValuePool::build(
                config_text,
                config_format,
                ValueScope {
                    model: model_scope,
                    world_size,
                    rank: 0,
                    pp_rank: 0,
                },
                row_bytes,
                "vLLM's primary rows",
                "kvpool-tier",
            )?;
            let tier_names = built.storage.tier_names();
            tracing::info!(scope = %built.config.model.name, tiers = ?tier_names, rows, row_bytes, "kvpool offload tier ready");
            Ok(PyOffloadTier {
                tier: OffloadTier::new(
                    built.storage,
                    built.runtime,
                    built.scope,
                    region,
                    tokens_per_row,
                    built.config.chunking.hash_algorithm,
                ),
                tier_names,
            })
        })
    }

    /// 0 miss, 1 hit, 2 retry (a lower tier is being asked).
    fn lookup(&self, py: Python<'_>, key: &[u8]) -> u8 {
        let key = key.to_vec();
        match py.detach(|| self.tier.lookup(&key)) {
            TierLookup::Miss => 0,
            TierLookup::Hit => 1,
            TierLookup::Retry => 2,
        }
    }

    /// Starts storing rows `rows[i]` under `keys[i]`; returns at once.
    fn submit_store(&self, job_id: u64, keys: Vec<Vec<u8>>, rows: Vec<usize>) {
        self.tier.submit_store(job_id, keys, rows);
    }

    /// Starts loading `keys[i]` into rows `rows[i]`; returns at once.
    fn submit_load(&self, job_id: u64, keys: Vec<Vec<u8>>, rows: Vec<usize>) {
        self.tier.submit_load(job_id, keys, rows);
    }

    /// Jobs finished since the last call.
    fn finished(&self) -> Vec<FinishedJob> {
        self.tier
            .finished()
            .into_iter()
            .map(|r| (r.job_id, r.success, r.loaded, r.bytes, r.seconds))
            .collect()
    }

    /// Jobs submitted and not yet finished.
    fn in_flight(&self) -> usize {
        self.tier.in_flight()
    }

    /// Blocks until no job is in flight.
    fn drain(&self, py: Python<'_>) {
        py.detach(|| self.tier.drain());
    }

    /// vLLM's `reset_cache`: drains, then nothing stored before is found again (a fresh key
    /// root; weights may have been pushed into the running engine).
    fn reset(&self, py: Python<'_>) {
        py.detach(|| self.tier.reset());
    }

    /// Refuses later jobs and lookups, drains, flushes write-behind and closes the tiers.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.tier.close())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// The pool's tiers, in lookup order.
    fn tier_names(&self) -> Vec<String> {
        self.tier_names.clone()
    }
}
