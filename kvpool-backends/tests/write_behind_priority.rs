//! Write-behind on the process's low-priority threads (nice 19): a lower tier added with
//! `lower_written_behind_on` is written there, another on the pool's own runtime; `build_pool`
//! puts a disk tier there under `[write_behind] low_priority` (unit tests in pool_builder.rs).

mod common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use kvpool_backends::InMemoryConnector;
use kvpool_backends::background::background_runtime;
use kvpool_backends::background::{BACKGROUND_NICE, this_threads_nice};
use kvpool_core::{
    BackendError, CacheEngine, ChunkCodec, ChunkedTokenDatabase, ChunkingConfig, KeyScope,
    RemoteBackend, RemoteConnector, StorageManager,
};

/// The nice value of each thread a `batch_put` ran on.
type PutNices = Arc<Mutex<Vec<Option<i32>>>>;

/// Process memory that records the priority of the thread each write runs on.
#[derive(Clone)]
struct RecordsPutPriority {
    store: InMemoryConnector,
    nices: PutNices,
}

#[async_trait]
impl RemoteConnector for RecordsPutPriority {
    fn name(&self) -> &str {
        "records-put-priority"
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.store.batch_exists(keys).await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.store.batch_get(keys).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.nices.lock().unwrap().push(this_threads_nice());
        self.store.batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.store.batch_delete(keys).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        Ok(())
    }
}

fn recorder() -> (Arc<RemoteBackend<RecordsPutPriority>>, PutNices) {
    let nices = PutNices::default();
    let connector = RecordsPutPriority {
        store: InMemoryConnector::default(),
        nices: nices.clone(),
    };
    (
        Arc::new(RemoteBackend::new(
            connector,
            ChunkCodec::default(),
            1 << 20,
        )),
        nices,
    )
}

#[test]
fn a_tier_written_behind_on_the_background_runtime_is_written_at_the_lowest_priority() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let pools_own = runtime
        .block_on(async { tokio::spawn(async { this_threads_nice() }).await })
        .unwrap();
    assert_ne!(
        pools_own,
        Some(BACKGROUND_NICE),
        "run this test at a normal priority"
    );
    let (low, low_nices) = recorder();
    let (normal, normal_nices) = recorder();
    runtime.block_on(async {
        let manager = StorageManager::builder()
            .lower_written_behind_on(low, background_runtime().unwrap())
            .lower(normal)
            .build()
            .unwrap();
        let layout = common::tiered::layout();
        let scope = KeyScope::new("test-model", 1, 0, 0, layout.fingerprint()).unwrap();
        let chunking = ChunkingConfig {
            chunk_size: common::tiered::CHUNK,
            ..Default::default()
        };
        let db = ChunkedTokenDatabase::new(chunking, scope).unwrap();
        let engine = CacheEngine::new(layout, db, Arc::new(manager)).unwrap();
        let tokens = common::tiered::tokens(2 * common::tiered::CHUNK, 3);
        let (slots, _) = common::tiered::slots(tokens.len());
        let kv = common::filled_cache(layout, 100, 1);
        let report = engine.store(&tokens, None, &kv, &slots).await.unwrap();
        assert_eq!(report.stored_chunks, 2);
        engine.storage().flush().await.unwrap();
    });
    let low = std::mem::take(&mut *low_nices.lock().unwrap());
    let normal = std::mem::take(&mut *normal_nices.lock().unwrap());
    assert!(!low.is_empty() && !normal.is_empty(), "both tiers written");
    if cfg!(target_os = "linux") {
        assert!(low.iter().all(|&n| n == Some(BACKGROUND_NICE)), "{low:?}");
        assert!(normal.iter().all(|&n| n == pools_own), "{normal:?}");
    }
}
