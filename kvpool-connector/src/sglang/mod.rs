//! kvpool as an SGLang HiCache L3 storage backend: SGLang's pages moved between its host
//! memory pool and kvpool's tiers by address, under keys made of SGLang's page hashes.
//!
//! SGLang's cache controller calls its storage backend synchronously from its prefetch and
//! backup threads: "how many leading pages exist", "read these pages into these host slots",
//! "write these host slots under these pages". A page is one value of `page_bytes`: the
//! concatenation of the host pool's buffer segments for that page, in the order SGLang's
//! `get_page_buffer_meta` lists them (K then V, per layer or whole-page). The Python side
//! (`kvpool.sglang.KvpoolStorage`) only forwards addresses and sizes: no KV byte becomes a
//! Python object.
//!
//! Keys chain SGLang's page hash from a root in a scope bound to the model's weights, the
//! TP/PP rank (for layouts that shard heads) and the host pool's page layout; lower tiers
//! verify a value's header (key, scope, layout fingerprint, checksum) and a read checks its
//! length, so a value that does not fit is a miss, never data. With MLA every rank holds the
//! same latent: one rank writes, every rank reads the same keys.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kvpool_core::{
    BackendError, CacheKey, Chunk, ChunkHash, ChunkMeta, ChunkVisit, Dtype, HashAlgorithm,
    KeyScope, StorageManager, telemetry,
};
use parking_lot::Mutex;
use tokio::runtime::Runtime;

use crate::host_spans::{PageSpans, gather, pages_fit, scatter};

/// At most this many per-call samples wait for [`HiCacheStore::take_call_stats`]; older ones
/// are dropped (SGLang drains them every scheduler step when its storage metrics are on).
pub const MAX_PENDING_CALL_STATS: usize = 4096;

/// One `batch_get` or `batch_set` call, as SGLang's `StorageMetrics` records it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallSample {
    /// Pages moved.
    pub pages: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds the call took.
    pub seconds: f64,
}

/// Per-call samples since the last [`HiCacheStore::take_call_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallStats {
    /// Reads (SGLang's prefetches).
    pub reads: Vec<CallSample>,
    /// Writes (SGLang's backups).
    pub writes: Vec<CallSample>,
}

/// Counters since the store started.
#[derive(Debug, Default)]
struct Totals {
    pages_read: AtomicU64,
    pages_missed: AtomicU64,
    pages_written: AtomicU64,
    pages_refused: AtomicU64,
}

/// Totals since the store started, for logs and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HiCacheTotals {
    /// Pages read into SGLang's host pool.
    pub pages_read: u64,
    /// Pages asked for and not read (absent, a value that failed a check, or host spans that
    /// do not add up to a page).
    pub pages_missed: u64,
    /// Pages written (or, on an MLA rank that does not write, accepted).
    pub pages_written: u64,
    /// Pages not written: host spans that do not add up to a page, kvpool memory full, or a
    /// tier that refused the value.
    pub pages_refused: u64,
}

/// kvpool's tiers as one SGLang storage backend; every call blocks its caller (SGLang's
/// storage threads) until the tiers answered, each tier call bounded by its timeout.
pub struct HiCacheStore {
    storage: Arc<StorageManager>,
    runtime: Arc<Runtime>,
    scope: Arc<KeyScope>,
    meta: ChunkMeta,
    hasher: HashAlgorithm,
    page_bytes: usize,
    writer: bool,
    /// Whether this store built `storage` and closes it (a hybrid model's other host pools'
    /// stores share the KV store's tiers: [`HiCacheStore::sharing`]).
    owns_storage: bool,
    /// What every key's hash chains from: the fixed root, or a random one after `clear`.
    root: Mutex<ChunkHash>,
    closed: AtomicBool,
    totals: Totals,
    calls: Mutex<(VecDeque<CallSample>, VecDeque<CallSample>)>,
}

impl std::fmt::Debug for HiCacheStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCacheStore")
            .field("scope", &self.scope)
            .field("page_bytes", &self.page_bytes)
            .field("writer", &self.writer)
            .finish()
    }
}

/// Writes the pages a read visits into their host spans, until it is closed: a tier call
/// given up on by its timeout may visit later, from a thread of its own, and must then find
/// the spans no longer ours.
struct PageWriter {
    pages: Vec<PageSpans>,
    page_bytes: usize,
    meta: ChunkMeta,
    /// Whether spans may be written, and which pages were; held across each page's copy, so
    /// that [`PageWriter::close`] waits for a copy under way.
    state: Mutex<(bool, Vec<bool>)>,
}

/// Closes its [`PageWriter`] when dropped, on every way out of the read.
struct OpenPageWriter(Arc<PageWriter>);

impl PageWriter {
    fn open(pages: Vec<PageSpans>, page_bytes: usize, meta: ChunkMeta) -> OpenPageWriter {
        let written = vec![false; pages.len()];
        OpenPageWriter(Arc::new(PageWriter {
            pages,
            page_bytes,
            meta,
            state: Mutex::new((true, written)),
        }))
    }

    /// Copies page `i` into its spans, if the writer is open and the chunk fits the page.
    fn write(&self, i: usize, meta: &ChunkMeta, bytes: &[u8]) {
        let mut state = self.state.lock();
        let (open, written) = &mut *state;
        let Some(spans) = self.pages.get(i) else {
            return;
        };
        if !*open {
            return;
        }
        if bytes.len() != self.page_bytes || meta.layout_fingerprint != self.meta.layout_fingerprint
        {
            tracing::warn!(
                len = bytes.len(),
                page_bytes = self.page_bytes,
                "sglang storage: a stored value does not fit the page; reading stops there"
            );
            return;
        }
        // SAFETY: while the writer is open, the caller of `read_pages` is still inside it
        // and guarantees each span is valid for writes of its length and ours alone;
        // `spans_fit` checked the lengths add up to a page, and `bytes` is one page long.
        unsafe { scatter(bytes, spans) };
        written[i] = true;
    }
}

impl OpenPageWriter {
    /// The writer, for the visitor.
    fn handle(&self) -> Arc<PageWriter> {
        self.0.clone()
    }

    /// Stops every later write (waiting for one under way); which pages were written.
    fn close(self) -> Vec<bool> {
        let mut state = self.0.state.lock();
        state.0 = false;
        std::mem::take(&mut state.1)
    }
}

impl Drop for OpenPageWriter {
    fn drop(&mut self) {
        self.0.state.lock().0 = false;
    }
}

impl HiCacheStore {
    /// A backend over `storage` (built from a config fitted by
    /// [`crate::opaque_values::pool_config_for_values`], whose key scope is `scope`) for pages
    /// of `page_bytes` holding `tokens_per_page` tokens. `writer` is false on ranks whose
    /// writes another rank makes (MLA: every rank holds the same latent): their writes are
    /// accepted and dropped.
    pub fn new(
        storage: Arc<StorageManager>,
        runtime: Arc<Runtime>,
        scope: KeyScope,
        page_bytes: usize,
        tokens_per_page: u32,
        hasher: HashAlgorithm,
        writer: bool,
    ) -> Self {
        let meta = ChunkMeta {
            layout_fingerprint: scope.layout_fingerprint,
            dtype: Dtype::F16,
            token_count: tokens_per_page.max(1),
        };
        Self {
            storage,
            runtime,
            scope: Arc::new(scope),
            meta,
            hasher,
            page_bytes,
            writer,
            owns_storage: true,
            root: Mutex::new(hasher.root()),
            closed: AtomicBool::new(false),
            totals: Totals::default(),
            calls: Mutex::new((VecDeque::new(), VecDeque::new())),
        }
    }

    /// A store for another of SGLang's host pools (a hybrid model's Mamba states or
    /// sliding-window KV: SGLang's `*_v2` calls) over this store's tiers and runtime: pages of
    /// `page_bytes` holding `tokens_per_page` tokens under `scope`, written by every rank
    /// (each holds its own shard). Closing it refuses its later calls; the tiers close with
    /// this store.
    pub fn sharing(&self, scope: KeyScope, page_bytes: usize, tokens_per_page: u32) -> Self {
        let mut store = Self::new(
            self.storage.clone(),
            self.runtime.clone(),
            scope,
            page_bytes,
            tokens_per_page,
            self.hasher,
            true,
        );
        store.owns_storage = false;
        store
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Whether this rank writes (false on MLA ranks other than the writer).
    pub fn is_writer(&self) -> bool {
        self.writer
    }

    /// The kvpool key of one of SGLang's page hashes.
    pub fn key_of(&self, page_key: &str) -> CacheKey {
        let root = *self.root.lock();
        let hash = self.hasher.chain_blocks(&root, &[page_key.as_bytes()]);
        CacheKey::new(self.scope.clone(), hash)
    }

    fn keys_of(&self, page_keys: &[String]) -> Vec<CacheKey> {
        page_keys.iter().map(|k| self.key_of(k)).collect()
    }

    /// How many leading pages some tier holds (SGLang's `batch_exists`). A lower tier answers
    /// by presence; its value is verified when read, so a corrupt page counted here is still
    /// a miss in [`HiCacheStore::read_pages`].
    pub fn existing_prefix(&self, page_keys: &[String]) -> usize {
        if self.closed.load(Ordering::Acquire) || page_keys.is_empty() {
            return 0;
        }
        let keys = self.keys_of(page_keys);
        self.runtime.block_on(self.storage.lookup(&keys)).len()
    }

    /// Which of `page_keys` some tier holds, each on its own (SGLang's `*_v2` hit policies
    /// ask about pages past a missing one: a Mamba state is stored at some pages only).
    pub fn presence(&self, page_keys: &[String]) -> Vec<bool> {
        if self.closed.load(Ordering::Acquire) || page_keys.is_empty() {
            return vec![false; page_keys.len()];
        }
        let keys = self.keys_of(page_keys);
        let lookups = keys
            .iter()
            .map(|key| self.storage.lookup(std::slice::from_ref(key)));
        self.runtime
            .block_on(futures::future::join_all(lookups))
            .into_iter()
            .map(|found| found.len() == 1)
            .collect()
    }

    /// Checks that `pages[i]` add up to one page ([`pages_fit`]); logs a refusal.
    fn spans_fit(&self, page_keys: &[String], pages: &[PageSpans]) -> bool {
        match pages_fit(self.page_bytes, page_keys.len(), pages) {
            Ok(()) => true,
            Err(reason) => {
                tracing::warn!(
                    keys = page_keys.len(),
                    page_bytes = self.page_bytes,
                    "sglang storage: call refused: {reason}"
                );
                false
            }
        }
    }

    /// Copies the longest stored prefix of `page_keys` into their host spans (SGLang's
    /// `batch_get_v1`); `true` for each page read. Pages past the first that is absent, fails
    /// a check or has another length are `false`; their spans may have been written (a page
    /// a later tier held), never with bytes that failed a check. Each page is copied from
    /// where the tier holds it once its checks passed ([`StorageManager::get_each`]); nothing
    /// is written into a span after this returns, even by a tier call cut short by its timeout
    /// that finishes in the background.
    ///
    /// # Safety
    ///
    /// Every span must be valid for writes of its length, and not read or written by anyone
    /// else until this returns (SGLang hands a prefetch its own freshly allocated host slots).
    pub unsafe fn read_pages(&self, page_keys: &[String], pages: &[PageSpans]) -> Vec<bool> {
        let started = Instant::now();
        let mut done = vec![false; page_keys.len()];
        if self.closed.load(Ordering::Acquire) {
            self.count("read", "missed", page_keys.len());
            return done;
        }
        if !self.spans_fit(page_keys, pages) {
            self.count("read", "refused", page_keys.len());
            return done;
        }
        let keys = self.keys_of(page_keys);
        let writer = PageWriter::open(pages.to_vec(), self.page_bytes, self.meta);
        let visit: ChunkVisit = {
            let writer = writer.handle();
            Arc::new(move |i, meta, bytes| writer.write(i, meta, bytes))
        };
        let prefix = self.runtime.block_on(self.storage.get_each(&keys, visit));
        let written = writer.close();
        let read = written[..prefix].iter().take_while(|&&w| w).count();
        done[..read].fill(true);
        self.count("read", "ok", read);
        self.count("read", "missed", page_keys.len() - read);
        self.record(
            true,
            CallSample {
                pages: read,
                bytes: (read * self.page_bytes) as u64,
                seconds: started.elapsed().as_secs_f64(),
            },
        );
        done
    }

    /// Copies each page's host spans into kvpool memory and stores it under its key (SGLang's
    /// `batch_set_v1`): into L1 before this returns, to the lower tiers behind. `true` for each
    /// page stored. On a rank that does not write (MLA), every page is accepted unread.
    ///
    /// # Safety
    ///
    /// Every span must be valid for reads of its length and not written by anyone until this
    /// returns (SGLang keeps a backup's host slots until the call ends).
    pub unsafe fn write_pages(&self, page_keys: &[String], pages: &[PageSpans]) -> Vec<bool> {
        let started = Instant::now();
        if self.closed.load(Ordering::Acquire) || !self.spans_fit(page_keys, pages) {
            self.count("write", "refused", page_keys.len());
            return vec![false; page_keys.len()];
        }
        if !self.writer {
            self.count("write", "ok", page_keys.len());
            return vec![true; page_keys.len()];
        }
        let keys = self.keys_of(page_keys);
        let mut entries = Vec::with_capacity(keys.len());
        for (key, spans) in keys.iter().zip(pages) {
            let Ok(mut buf) = self.storage.allocate(self.page_bytes) else {
                tracing::warn!(
                    "sglang storage: kvpool memory is full; the rest of the call is refused"
                );
                break;
            };
            // SAFETY: the caller guarantees each span is valid for reads of its length and
            // unchanged until this returns; `spans_fit` checked they add up to a page.
            unsafe { gather(spans, buf.as_mut_slice()) };
            entries.push((
                key.clone(),
                Chunk {
                    meta: self.meta,
                    data: buf.freeze(),
                },
            ));
        }
        let copied = entries.len();
        let stored = match self.runtime.block_on(self.storage.put(entries)) {
            Ok(outcome) if outcome.skipped == 0 => copied,
            Ok(outcome) => {
                tracing::warn!(
                    skipped = outcome.skipped,
                    "sglang storage: some pages were not stored"
                );
                0
            }
            Err(e) => {
                tracing::warn!(error = %e, "sglang storage: store failed");
                0
            }
        };
        let mut done = vec![false; page_keys.len()];
        done[..stored].fill(true);
        self.count("write", "ok", stored);
        self.count("write", "refused", page_keys.len() - stored);
        self.record(
            false,
            CallSample {
                pages: stored,
                bytes: (stored * self.page_bytes) as u64,
                seconds: started.elapsed().as_secs_f64(),
            },
        );
        done
    }

    /// Counts `pages` pages of `op` ("read", "write") with `outcome` ("ok", "missed",
    /// "refused"), in the totals and in kvpool's metrics.
    fn count(&self, op: &'static str, outcome: &'static str, pages: usize) {
        if pages == 0 {
            return;
        }
        let total = match (op, outcome) {
            ("read", "ok") => &self.totals.pages_read,
            ("read", _) => &self.totals.pages_missed,
            (_, "ok") => &self.totals.pages_written,
            _ => &self.totals.pages_refused,
        };
        total.fetch_add(pages as u64, Ordering::Relaxed);
        metrics::counter!(telemetry::SGLANG_PAGES, "op" => op, "outcome" => outcome)
            .increment(pages as u64);
    }

    fn record(&self, read: bool, sample: CallSample) {
        let mut calls = self.calls.lock();
        let queue = if read { &mut calls.0 } else { &mut calls.1 };
        if queue.len() == MAX_PENDING_CALL_STATS {
            queue.pop_front();
        }
        queue.push_back(sample);
    }

    /// Per-call samples since the last call (SGLang's `get_stats`).
    pub fn take_call_stats(&self) -> CallStats {
        let mut calls = self.calls.lock();
        CallStats {
            reads: calls.0.drain(..).collect(),
            writes: calls.1.drain(..).collect(),
        }
    }

    /// Totals since the store started.
    pub fn totals(&self) -> HiCacheTotals {
        HiCacheTotals {
            pages_read: self.totals.pages_read.load(Ordering::Relaxed),
            pages_missed: self.totals.pages_missed.load(Ordering::Relaxed),
            pages_written: self.totals.pages_written.load(Ordering::Relaxed),
            pages_refused: self.totals.pages_refused.load(Ordering::Relaxed),
        }
    }

    /// SGLang's `clear`: nothing stored before is found again by this store (later keys chain
    /// from a fresh random root). Other processes sharing the tiers keep their pages, and the
    /// old values age out of the tiers by their own eviction.
    pub fn clear(&self) {
        let salt: [u8; 16] = rand::random();
        *self.root.lock() = self.hasher.chain_extra(&self.hasher.root(), &salt);
    }

    /// Refuses later calls, then flushes write-behind and closes the tiers (the store that
    /// built them; a [`HiCacheStore::sharing`] store only refuses its later calls).
    pub fn close(&self) -> Result<(), BackendError> {
        if self.closed.swap(true, Ordering::AcqRel) || !self.owns_storage {
            return Ok(());
        }
        self.runtime.block_on(async {
            self.storage.flush().await?;
            self.storage.close().await
        })
    }
}

#[cfg(test)]
mod tests;
