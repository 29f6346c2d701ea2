//! The worker half without Python (`WorkerCore`): the pool it builds or shares, the
//! connector's worker, and the lookup server answering the scheduler; `py_worker.rs` is its
//! Python face.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvpool_connector::vllm::leases::DEFAULT_LEASE_TTL;
use kvpool_connector::vllm::{VllmEngineFacts, pool_config_for_vllm};
use kvpool_connector::{ConnectorWorker, LeaseTable, LoadLimits, LookupServer};
use kvpool_core::KvLayout;

/// Everything a worker needs, as the Python connector gathers it from vLLM.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// The pool config text and its format (see [`crate::parse_pool_config`]).
    pub config_text: String,
    /// `toml`, `json` or `default`.
    pub config_format: String,
    /// The engine facts (model, ranks, layout, block format).
    pub facts: VllmEngineFacts,
    /// Where to answer the scheduler's lookups (`None`: no lookup server, e.g. in tests).
    pub socket_path: Option<PathBuf>,
}

/// A worker's pool, as another worker over it shares it.
pub struct PoolHandles {
    engine: Arc<kvpool_core::CacheEngine>,
    runtime: Arc<tokio::runtime::Runtime>,
    l1_bytes: usize,
}

/// The worker without Python: pool, connector worker, lookup server.
pub struct WorkerCore {
    /// The connector's worker half.
    pub worker: ConnectorWorker,
    /// kvpool's runtime in this process (the pool's tiers and background work run on it).
    pub(crate) runtime: Arc<tokio::runtime::Runtime>,
    _server: Option<LookupServer>,
    /// Whether this core built the pool (and closes it); `false` for a core sharing another's
    /// ([`WorkerCore::sharing_pool_of`]).
    owns_pool: bool,
    /// Bytes of L1 (bounds leases and asynchronous loads).
    l1_bytes: usize,
}

impl WorkerCore {
    /// Builds the pool and starts answering lookups.
    pub fn new(spec: &WorkerSpec) -> Result<Self, String> {
        let (config, layout) = Self::config_and_layout(spec)?;
        let runtime = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("kvpool-worker")
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start kvpool's runtime: {e}"))?,
        );
        let pool = runtime
            .block_on(kvpool_backends::build_pool(&config))
            .map_err(|e| e.to_string())?;
        // Leases and asynchronous loads each get at most a quarter of L1.
        let l1 = config.local_cpu.max_size.0 as usize;
        let leases = Arc::new(LeaseTable::new(l1 / 4, DEFAULT_LEASE_TTL));
        let core = Self::serve(spec, pool.engine.clone(), &layout, runtime, leases, l1, 1)?;
        tracing::info!(model = %config.model.name, tiers = ?pool.engine.storage().tier_names(), "kvpool worker ready");
        Ok(WorkerCore {
            owns_pool: true,
            ..core
        })
    }

    /// A worker for another part of the same engine's KV (one KV cache group of a hybrid
    /// model: its own layers, layout and key scope, `spec.facts.kv_format` naming the group)
    /// over `owner`'s pool: one L1, one set of tiers, one runtime; leases of its own. Its chunks
    /// must not be larger than the owner's (the tiers were opened for those). Asynchronous
    /// loads of each of the `parts` workers get an equal share of the owner's bound.
    pub fn sharing_pool_of(
        owner: &PoolHandles,
        spec: &WorkerSpec,
        parts: usize,
    ) -> Result<Self, String> {
        let (config, layout) = Self::config_and_layout(spec)?;
        let owner_engine = &owner.engine;
        let cs = config.chunking.chunk_size;
        if config.chunking != *owner_engine.token_database().config() {
            return Err("a worker sharing a pool must chunk as its owner does".into());
        }
        if layout.chunk_bytes(cs) > owner_engine.layout().chunk_bytes(cs) {
            return Err(format!(
                "a chunk of this part ({} bytes) is larger than the pool owner's ({} bytes): \
                 build the pool for the largest part",
                layout.chunk_bytes(cs),
                owner_engine.layout().chunk_bytes(cs)
            ));
        }
        let db = kvpool_core::ChunkedTokenDatabase::new(
            config.chunking,
            config.key_scope().map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
        let engine = Arc::new(
            kvpool_core::CacheEngine::new(layout, db, owner_engine.storage().clone())
                .map_err(|e| e.to_string())?,
        );
        Self::serve(
            spec,
            engine,
            &layout,
            owner.runtime.clone(),
            // Leases of its own: a lease is taken by request id and matched by chunk hash,
            // which every group of a request shares (a shared table would hand one group's
            // chunks to another's load).
            Arc::new(LeaseTable::new(
                owner.l1_bytes / 4 / parts.max(1),
                DEFAULT_LEASE_TTL,
            )),
            owner.l1_bytes,
            parts,
        )
    }

    /// What another worker needs to share this one's pool ([`WorkerCore::sharing_pool_of`]).
    pub fn pool_handles(&self) -> PoolHandles {
        PoolHandles {
            engine: self.worker.engine().clone(),
            runtime: self.runtime.clone(),
            l1_bytes: self.l1_bytes,
        }
    }

    /// Shares the bound on asynchronous loads equally among `parts` workers over this pool.
    pub fn share_load_bound(&mut self, parts: usize) {
        self.worker
            .set_load_limits(load_limits(self.l1_bytes, parts));
    }

    fn config_and_layout(spec: &WorkerSpec) -> Result<(kvpool_core::PoolConfig, KvLayout), String> {
        let base = crate::parse_pool_config(&spec.config_text, &spec.config_format)?;
        let config = pool_config_for_vllm(&base, &spec.facts).map_err(|e| e.to_string())?;
        let f = &spec.facts;
        let layout = KvLayout::new(
            f.num_layers,
            f.num_kv_heads,
            f.head_size,
            f.dtype,
            f.kind,
            f.block_size,
        )
        .map_err(|e| e.to_string())?;
        Ok((config, layout))
    }

    /// The connector worker over `engine` and its lookup server.
    fn serve(
        spec: &WorkerSpec,
        engine: Arc<kvpool_core::CacheEngine>,
        layout: &KvLayout,
        runtime: Arc<tokio::runtime::Runtime>,
        leases: Arc<LeaseTable>,
        l1_bytes: usize,
        parts: usize,
    ) -> Result<Self, String> {
        let f = &spec.facts;
        let mut worker = ConnectorWorker::new(
            engine.clone(),
            runtime.clone(),
            f.block_size,
            leases.clone(),
        );
        worker.set_load_limits(load_limits(l1_bytes, parts));
        worker
            .register_kv_caches(layout)
            .map_err(|e| e.to_string())?;
        let server = match &spec.socket_path {
            Some(path) => Some(
                LookupServer::start(
                    path,
                    engine,
                    runtime.clone(),
                    leases,
                    f.tp_rank,
                    Duration::from_secs(3600),
                )
                .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?,
            ),
            None => None,
        };
        Ok(WorkerCore {
            worker,
            runtime,
            _server: server,
            owns_pool: false,
            l1_bytes,
        })
    }

    /// The chunk payloads the pool holds for `tokens` (whole chunks, in order, stopping at
    /// the first missing one): an inspection helper, not the data path.
    pub fn stored_chunks(&self, tokens: &[u32], extra_keys: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let engine = self.worker.engine();
        let spans = engine
            .token_database()
            .process_tokens_with_extra(tokens, None, extra_keys)
            .map_err(|e| e.to_string())?;
        let keys: Vec<_> = spans.iter().map(|s| s.key.clone()).collect();
        let chunks = self.runtime.block_on(engine.storage().get(&keys));
        Ok(chunks.iter().map(|c| c.data.as_slice().to_vec()).collect())
    }

    /// Flushes write-behind to lower tiers and closes them (the pool's owner only: a worker
    /// sharing another's pool leaves it to the owner).
    pub fn close(&self) -> Result<(), String> {
        if !self.owns_pool {
            return Ok(());
        }
        let engine = self.worker.engine().clone();
        self.runtime
            .block_on(engine.storage().close())
            .map_err(|e| e.to_string())
    }
}

/// Asynchronous loads of one of `parts` workers over a pool of `l1_bytes` of L1: an equal
/// share of a quarter of L1.
fn load_limits(l1_bytes: usize, parts: usize) -> LoadLimits {
    LoadLimits {
        max_bytes: (l1_bytes / 4 / parts.max(1)).max(1),
        ..LoadLimits::default()
    }
}
