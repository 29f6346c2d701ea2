//! The worker side: binds each step's metadata, loads layer by layer, saves, reports failures.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use kvpool_core::{CacheEngine, KvLayout, KvTransfer, LayerwiseRetrieve};
use tokio::runtime::Runtime;
use tracing::warn;

use crate::ConnectorError;
use crate::metadata::{ConnectorMetadata, MetadataError};

/// The worker side of the connector (one per GPU worker / TP rank).
pub struct ConnectorWorker {
    engine: Arc<CacheEngine>,
    runtime: Arc<Runtime>,
    block_size: usize,
    probe_hash: [u8; 16],
    registered: bool,
    meta: Option<ConnectorMetadata>,
    loads: Vec<LayerwiseRetrieve>,
    /// Per request: the first token whose load failed this step (saves stop before it).
    failed_from: HashMap<String, usize>,
    saved_layers: usize,
    finished_sending: Vec<String>,
    load_errors: BTreeSet<u32>,
    kv_events: Vec<KvEvent>,
}

/// An event for the engine's KV-event stream (vLLM `get_kv_connector_kv_cache_events`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KvEvent {
    /// Chunks the pool stored in this step, exactly those written.
    ChunksStored {
        /// The request, or `evict-N` for a lazy-offload eviction.
        req_id: String,
        /// Their chained chunk hashes, in order.
        chunk_hashes: Vec<[u8; 16]>,
    },
}

impl ConnectorWorker {
    /// A worker over `engine`; `block_size` is the engine's page size in tokens.
    pub fn new(engine: Arc<CacheEngine>, runtime: Arc<Runtime>, block_size: usize) -> Self {
        let probe_hash = crate::probe_hash(&engine);
        ConnectorWorker {
            engine,
            runtime,
            block_size,
            probe_hash,
            registered: false,
            meta: None,
            loads: Vec::new(),
            failed_from: HashMap::new(),
            saved_layers: 0,
            finished_sending: Vec::new(),
            load_errors: BTreeSet::new(),
            kv_events: Vec::new(),
        }
    }

    /// vLLM `register_kv_caches`: checks the engine's paged KV layout matches the pool's.
    pub fn register_kv_caches(&mut self, layout: &KvLayout) -> Result<(), ConnectorError> {
        let ours = self.engine.layout();
        if layout.fingerprint() != ours.fingerprint() || layout.block_size != self.block_size {
            return Err(ConnectorError::Layout(format!(
                "engine KV cache {layout:?} does not match the pool's {ours:?} with block size {}",
                self.block_size
            )));
        }
        self.registered = true;
        Ok(())
    }

    /// vLLM `bind_connector_metadata`: decodes (never panics) and checks key agreement.
    pub fn bind_connector_metadata(&mut self, bytes: &[u8]) -> Result<(), ConnectorError> {
        if !self.registered {
            return Err(ConnectorError::Usage(
                "register_kv_caches must come before bind_connector_metadata".into(),
            ));
        }
        let meta = ConnectorMetadata::decode(bytes)?;
        if meta.probe_hash != self.probe_hash {
            return Err(MetadataError::ProbeMismatch {
                scheduler: hex(&meta.probe_hash),
                worker: hex(&self.probe_hash),
            }
            .into());
        }
        self.meta = Some(meta);
        self.loads.clear();
        self.failed_from.clear();
        self.saved_layers = 0;
        Ok(())
    }

    /// vLLM `clear_connector_metadata`.
    pub fn clear_connector_metadata(&mut self) {
        self.meta = None;
        self.loads.clear();
    }

    fn meta(&self) -> Result<&ConnectorMetadata, ConnectorError> {
        self.meta.as_ref().ok_or_else(|| {
            ConnectorError::Usage("no connector metadata bound for this step".into())
        })
    }

    /// vLLM `start_load_kv`: fetches and verifies every chunk to load this step. Tokens that
    /// will not arrive are recorded now, by GPU block, for
    /// [`ConnectorWorker::get_block_ids_with_load_errors`].
    ///
    /// Lazy-offload evictions are saved first, from `kv`, before any load writes their blocks.
    pub fn start_load_kv(&mut self, kv: &dyn KvTransfer) -> Result<(), ConnectorError> {
        let meta = self.meta()?.clone();
        for r in &meta.evictions {
            if let Some(save) = r.save {
                self.store_range(r, save.save_from as usize, save.save_until as usize, kv)?;
            }
        }
        for r in &meta.requests {
            let Some(load) = r.load else { continue };
            let (from, until) = (load.gpu_cached_tokens as usize, load.load_until as usize);
            let mask: Vec<bool> = (0..until).map(|i| i >= from).collect();
            let plan = self.runtime.block_on(self.engine.begin_retrieve_layerwise(
                &r.token_ids[..until],
                Some(&mask),
                &r.slot_mapping[..until],
            ))?;
            let loaded = plan.loaded_mask();
            if let Some(first) = (from..until).find(|&i| !loaded[i]) {
                warn!(req = %r.req_id, expected = until - from, loaded = plan.loaded_tokens(), "load incomplete; reporting failed blocks");
                self.failed_from.insert(r.req_id.clone(), first);
                for i in first..until {
                    self.load_errors
                        .insert((r.slot_mapping[i] as usize / self.block_size) as u32);
                }
            }
            self.loads.push(plan);
        }
        Ok(())
    }

    /// vLLM `wait_for_layer_load`: writes layer `layer` of every fetched chunk into `kv`.
    pub fn wait_for_layer_load(
        &mut self,
        layer: usize,
        kv: &mut dyn KvTransfer,
    ) -> Result<(), ConnectorError> {
        for plan in &mut self.loads {
            plan.load_layer(layer, kv)?;
        }
        // After the last layer, release the fetched chunks so L1 can evict them again.
        if layer + 1 == self.engine.layout().num_layers {
            self.loads.clear();
        }
        Ok(())
    }

    /// vLLM `save_kv_layer`: layer `layer` of this step is computed. Layers go in order; the
    /// copy out of the paged cache happens in [`ConnectorWorker::wait_for_save`].
    pub fn save_kv_layer(
        &mut self,
        layer: usize,
        _kv: &dyn KvTransfer,
    ) -> Result<(), ConnectorError> {
        if layer != self.saved_layers {
            return Err(ConnectorError::Usage(format!(
                "save_kv_layer expected layer {}, got {layer}",
                self.saved_layers
            )));
        }
        self.saved_layers += 1;
        Ok(())
    }

    /// vLLM `wait_for_save`: stores every request's new chunks. A request whose load failed
    /// this step saves nothing from its first failed chunk on: those GPU slots hold neither
    /// loaded nor computed KV.
    pub fn wait_for_save(&mut self, kv: &dyn KvTransfer) -> Result<(), ConnectorError> {
        let meta = self.meta()?.clone();
        let chunk = self.engine.token_database().chunk_size();
        let wanted_layers = self.engine.layout().num_layers;
        for r in &meta.requests {
            let Some(save) = r.save else { continue };
            if self.saved_layers != wanted_layers {
                return Err(ConnectorError::Usage(format!(
                    "wait_for_save after {} of {wanted_layers} save_kv_layer calls",
                    self.saved_layers
                )));
            }
            let from = save.save_from as usize;
            let mut until = save.save_until as usize;
            if let Some(&bad) = self.failed_from.get(&r.req_id) {
                until = until.min(bad / chunk * chunk);
            }
            self.store_range(r, from, until, kv)?;
            self.finished_sending.push(r.req_id.clone());
        }
        Ok(())
    }

    /// Stores the chunks of `r` covering tokens `from..until`, read from `kv`.
    fn store_range(
        &mut self,
        r: &crate::ReqMeta,
        from: usize,
        until: usize,
        kv: &dyn KvTransfer,
    ) -> Result<(), ConnectorError> {
        if until > from {
            let mask: Vec<bool> = (0..until).map(|i| i >= from).collect();
            let report = self.runtime.block_on(self.engine.store(
                &r.token_ids[..until],
                Some(&mask),
                kv,
                &r.slot_mapping[..until],
            ))?;
            if !report.stored_keys.is_empty() {
                self.kv_events.push(KvEvent::ChunksStored {
                    req_id: r.req_id.clone(),
                    chunk_hashes: report.stored_keys.iter().map(|k| k.hash.0).collect(),
                });
            }
        }
        Ok(())
    }

    /// vLLM `get_finished`: requests whose saves and (asynchronous) loads completed.
    pub fn get_finished(&mut self, _finished_req_ids: &[String]) -> (Vec<String>, Vec<String>) {
        (std::mem::take(&mut self.finished_sending), Vec::new())
    }

    /// vLLM `get_kv_connector_kv_cache_events`: what the pool stored since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.kv_events)
    }

    /// vLLM `get_block_ids_with_load_errors`: GPU blocks whose load failed since the last call.
    pub fn get_block_ids_with_load_errors(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.load_errors).into_iter().collect()
    }
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
