//! `kvpool._native.HiCacheStore`: kvpool as an SGLang HiCache L3 storage backend, for
//! `kvpool.sglang.KvpoolStorage` (the Rust side is `kvpool_connector::sglang`).

use kvpool_connector::host_spans::PageSpans;
use kvpool_connector::opaque_values::ValueScope;
use kvpool_connector::sglang::{CallSample, HiCacheStore};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The key scope of pages of `page_bytes` under `model_scope` in a pool fitted by `config`:
/// the scope `pool_config_for_values` gives values of exactly that size, whatever larger page
/// the pool was sized for (so a hybrid model's other host pools never change the KV pages'
/// keys).
fn page_scope(
    config: &kvpool_core::PoolConfig,
    model_scope: &str,
    page_bytes: usize,
) -> PyResult<kvpool_core::KeyScope> {
    let mut config = config.clone();
    config.model.name = model_scope.to_string();
    config.layout.head_size = page_bytes.div_ceil(2);
    config
        .key_scope()
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// One call's sample: (pages, bytes, seconds).
type Sample = (usize, u64, f64);

/// kvpool's tiers as one SGLang storage backend: pages by key, moved to and from host memory
/// by address.
#[pyclass(name = "HiCacheStore", module = "kvpool._native", frozen)]
pub struct PyHiCacheStore {
    store: HiCacheStore,
    tier_names: Vec<String>,
    /// The fitted pool config (a hybrid model's other host pools take their key scopes
    /// from it).
    config: kvpool_core::PoolConfig,
}

/// [`kvpool_connector::host_spans::page_spans`], refusals as Python's `ValueError`.
fn page_spans(pages: usize, addrs: &[usize], sizes: &[usize]) -> PyResult<Vec<PageSpans>> {
    kvpool_connector::host_spans::page_spans(pages, addrs, sizes)
        .map_err(|e| PyValueError::new_err(format!("kvpool: {e}")))
}

fn samples(calls: Vec<CallSample>) -> Vec<Sample> {
    calls
        .into_iter()
        .map(|c| (c.pages, c.bytes, c.seconds))
        .collect()
}

#[pymethods]
impl PyHiCacheStore {
    /// Builds the pool from the user's config fitted to pages of `page_bytes` (or of
    /// `max_page_bytes`, the largest page of any of SGLang's host pools, when larger), under
    /// the key scope `model_scope` / `world_size` / `rank` / `pp_rank`. `writer` is false on
    /// ranks whose pages another rank writes (MLA).
    #[new]
    #[pyo3(signature = (config_text, config_format, model_scope, world_size, rank, pp_rank, page_bytes, tokens_per_page, writer, max_page_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        config_text: &str,
        config_format: &str,
        model_scope: &str,
        world_size: u32,
        rank: u32,
        pp_rank: u32,
        page_bytes: usize,
        tokens_per_page: u32,
        writer: bool,
        max_page_bytes: usize,
    ) -> PyResult<Self> {
        py.detach(|| {
            let built = crate::ValuePool::build(
                config_text,
                config_format,
                ValueScope {
                    model: model_scope,
                    world_size,
                    rank,
                    pp_rank,
                },
                if max_page_bytes > page_bytes {
                    // The pool's values are even-sized (two-byte elements).
                    max_page_bytes.next_multiple_of(2)
                } else {
                    page_bytes
                },
                "SGLang's pages",
                "kvpool-sglang",
            )?;
            let tier_names = built.storage.tier_names();
            let scope = page_scope(&built.config, model_scope, page_bytes)?;
            tracing::info!(scope = %built.config.model.name, tiers = ?tier_names, page_bytes, writer, "kvpool SGLang storage ready");
            Ok(PyHiCacheStore {
                store: HiCacheStore::new(
                    built.storage,
                    built.runtime,
                    scope,
                    page_bytes,
                    tokens_per_page,
                    built.config.chunking.hash_algorithm,
                    writer,
                ),
                tier_names,
                config: built.config,
            })
        })
    }

    /// A store for another of SGLang's host pools (SGLang's `*_v2` calls: a hybrid model's
    /// Mamba states, sliding-window KV) over this store's tiers: pages of `page_bytes` holding
    /// `tokens_per_page` tokens under the key scope `model_scope` (this store's rank), written
    /// by every rank. Refused: pages larger than the pool was fitted to.
    fn sharing(
        &self,
        model_scope: &str,
        page_bytes: usize,
        tokens_per_page: u32,
    ) -> PyResult<Self> {
        let fitted = self
            .config
            .chunk_bytes()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        if page_bytes == 0 || page_bytes > fitted {
            return Err(PyValueError::new_err(format!(
                "kvpool: a page of {page_bytes} bytes does not fit the pool (fitted to pages of \
                 at most {fitted} bytes)"
            )));
        }
        let scope = page_scope(&self.config, model_scope, page_bytes)?;
        Ok(PyHiCacheStore {
            store: self.store.sharing(scope, page_bytes, tokens_per_page),
            tier_names: self.tier_names.clone(),
            config: self.config.clone(),
        })
    }

    /// Which of `keys` some tier holds, each on its own.
    fn presence(&self, py: Python<'_>, keys: Vec<String>) -> Vec<bool> {
        py.detach(|| self.store.presence(&keys))
    }

    /// How many leading pages of `keys` some tier holds.
    fn existing_prefix(&self, py: Python<'_>, keys: Vec<String>) -> usize {
        py.detach(|| self.store.existing_prefix(&keys))
    }

    /// Reads the longest stored prefix of `keys` into host memory: page `i` into the segments
    /// `addrs[i*n..(i+1)*n]` of `sizes[...]` bytes (`n = len(addrs) / len(keys)`).
    ///
    /// Only `kvpool.sglang` calls this, with addresses from SGLang's host pool for slots SGLang
    /// allocated to this read and keeps until it returns.
    fn read_pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        addrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        let pages = page_spans(keys.len(), &addrs, &sizes)?;
        // SAFETY: see this method's doc: the spans are SGLang's host slots for this read,
        // alive and untouched by others until it returns.
        Ok(py.detach(|| unsafe { self.store.read_pages(&keys, &pages) }))
    }

    /// Stores page `i` of `keys` from host memory (segments as in `read_pages`).
    ///
    /// Only `kvpool.sglang` calls this, with addresses from SGLang's host pool for slots it
    /// keeps unchanged until this returns.
    fn write_pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        addrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        let pages = page_spans(keys.len(), &addrs, &sizes)?;
        // SAFETY: see this method's doc: the spans are SGLang's host slots, unchanged until
        // this returns.
        Ok(py.detach(|| unsafe { self.store.write_pages(&keys, &pages) }))
    }

    /// Per-call samples since the last call: (reads, writes), each (pages, bytes, seconds).
    fn take_call_stats(&self) -> (Vec<Sample>, Vec<Sample>) {
        let stats = self.store.take_call_stats();
        (samples(stats.reads), samples(stats.writes))
    }

    /// Totals since start: (pages read, missed, written, refused).
    fn totals(&self) -> (u64, u64, u64, u64) {
        let t = self.store.totals();
        (
            t.pages_read,
            t.pages_missed,
            t.pages_written,
            t.pages_refused,
        )
    }

    /// Nothing stored before is found again by this store (a fresh key root).
    fn clear(&self) {
        self.store.clear();
    }

    /// Refuses later calls, flushes write-behind and closes the tiers.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.store.close())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Bytes per page.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.store.page_bytes()
    }

    /// The largest page the pool was fitted to (a [`PyHiCacheStore::sharing`] store's pages
    /// may be up to this size).
    #[getter]
    fn fitted_page_bytes(&self) -> PyResult<usize> {
        self.config
            .chunk_bytes()
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Whether this rank writes.
    #[getter]
    fn is_writer(&self) -> bool {
        self.store.is_writer()
    }

    /// The pool's tiers, in lookup order.
    fn tier_names(&self) -> Vec<String> {
        self.tier_names.clone()
    }
}
