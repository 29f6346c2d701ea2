//! The worker's one transfer path, observed: loads submitted and waited per layer, stores
//! gathered only after the fence (what a GPU transfer engine relies on).

mod protocol_fixture;

use std::sync::{Arc, Mutex};

use kvpool_connector::BlockUpdate;
use kvpool_core::{
    EngineError, HostPagedKvCache, KvLayout, KvTransfer, LayerLoad, LayerwiseRetrieve,
    LayerwiseTransfer, TransferError, load_now,
};
use kvpool_sim::single_request::{model_compute, model_mismatches};
use protocol_fixture::*;

/// A host cache that records what the worker asks of its transfer path, in order.
struct Recording {
    kv: HostPagedKvCache,
    log: Arc<Mutex<Vec<String>>>,
    fence_fails: bool,
}

impl Recording {
    fn note(&self, what: String) {
        self.log.lock().unwrap().push(what);
    }
}

impl KvTransfer for Recording {
    fn layout(&self) -> &KvLayout {
        self.kv.layout()
    }

    fn gather_layer(
        &self,
        layer: usize,
        slots: &[i64],
        chunk: &mut [u8],
    ) -> Result<(), TransferError> {
        self.note(format!("gather {layer}"));
        self.kv.gather_layer(layer, slots, chunk)
    }

    fn scatter_layer(
        &mut self,
        layer: usize,
        chunk: &[u8],
        chunk_tokens: usize,
        token_offset: usize,
        slots: &[i64],
    ) -> Result<(), TransferError> {
        self.note(format!("scatter {layer}"));
        self.kv
            .scatter_layer(layer, chunk, chunk_tokens, token_offset, slots)
    }
}

/// What a GPU load looks like to the worker: waits are per layer and may come later.
struct RecordedLoad {
    tokens: usize,
    log: Arc<Mutex<Vec<String>>>,
}

impl LayerLoad for RecordedLoad {
    fn wait_layer(&self, layer: usize) -> Result<(), TransferError> {
        self.log.lock().unwrap().push(format!("wait {layer}"));
        Ok(())
    }

    fn loaded_tokens(&self) -> usize {
        self.tokens
    }
}

impl LayerwiseTransfer for Recording {
    fn submit_load(&mut self, plan: LayerwiseRetrieve) -> Result<Box<dyn LayerLoad>, EngineError> {
        self.note("submit".into());
        let tokens = load_now(self, plan)?.loaded_tokens();
        Ok(Box::new(RecordedLoad {
            tokens,
            log: self.log.clone(),
        }))
    }

    fn fence_before_store(&self) -> Result<(), TransferError> {
        self.note("fence".into());
        if self.fence_fails {
            return Err(TransferError::Device("the compute stream faulted".into()));
        }
        Ok(())
    }
}

/// Defect 7: the worker moves bytes through one layer-wise path (submit, then a wait per
/// layer) that GPU caches implement too, and no store gathers before the fence that orders it
/// after the engine's writes; a failed fence stores nothing.
#[test]
fn loads_are_submitted_and_waited_per_layer_and_stores_gather_only_after_the_fence() {
    let mut s = setup();
    let p = prompt(3 * CHUNK + 1, 9);
    s.seed_pool(&p[..2 * CHUNK]);
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut rec = Recording {
        kv: HostPagedKvCache::new(*s.engine.layout(), 64),
        log: log.clone(),
        fence_fails: false,
    };
    let blocks: Vec<u32> = (0..7).collect();
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("a", &p), 0),
        (2 * CHUNK, false)
    );
    s.sched.update_state_after_alloc("a", &blocks, 2 * CHUNK);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    s.worker.bind_connector_metadata(&meta.encode()).unwrap();
    s.worker.start_load_kv(&mut rec).unwrap();
    for layer in 0..2 {
        s.worker.wait_for_layer_load(layer).unwrap();
    }
    for layer in 0..2 {
        model_compute(&mut rec.kv, layer, &p, &blocks, 2 * CHUNK..p.len());
    }
    log.lock().unwrap().push("forward pass".into());
    s.worker.wait_for_save(&rec).unwrap();
    s.worker.clear_connector_metadata();
    assert_eq!(
        model_mismatches(&rec.kv, &p, &blocks),
        0,
        "loaded + computed KV"
    );
    let log = log.lock().unwrap().clone();
    let at = |what: &str| log.iter().position(|l| l == what);
    let submit = at("submit").expect("the load was submitted");
    assert!(at("wait 0").unwrap() > submit && at("wait 1").unwrap() > at("wait 0").unwrap());
    let forward = at("forward pass").unwrap();
    let fence = log[forward..]
        .iter()
        .position(|l| l == "fence")
        .map(|i| i + forward);
    let first_gather = log[forward..]
        .iter()
        .position(|l| l.starts_with("gather"))
        .map(|i| i + forward);
    assert!(
        fence.is_some() && first_gather.is_some() && fence < first_gather,
        "no gather before the fence: {log:?}"
    );
    assert_eq!(s.pool_hit(&p), 3 * CHUNK, "the third chunk was stored");

    // A fence that fails: nothing of that step is stored.
    let q = prompt(2 * CHUNK + 1, 10);
    let mut broken = Recording {
        kv: HostPagedKvCache::new(*s.engine.layout(), 64),
        log: Arc::new(Mutex::new(Vec::new())),
        fence_fails: true,
    };
    let qb: Vec<u32> = (10..15).collect();
    s.sched.get_num_new_matched_tokens(&request("b", &q), 0);
    s.sched.update_state_after_alloc("b", &qb, 0);
    let meta =
        s.sched
            .build_connector_meta(&[scheduled("b", BlockUpdate::Replace(qb.clone()), q.len())]);
    s.worker.bind_connector_metadata(&meta.encode()).unwrap();
    s.worker.start_load_kv(&mut broken).unwrap();
    s.worker.finish_loads().unwrap();
    for layer in 0..2 {
        model_compute(&mut broken.kv, layer, &q, &qb, 0..q.len());
    }
    let errors = s.worker.stats().save_errors;
    s.worker.wait_for_save(&broken).unwrap();
    assert_eq!(s.worker.stats().save_errors, errors + 1);
    assert!(
        !broken
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with("gather")),
        "nothing gathered after a failed fence"
    );
    assert_eq!(s.pool_hit(&q), 0, "nothing stored after a failed fence");
}
