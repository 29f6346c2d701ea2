//! `[write_behind] low_priority`: a pool built by `build_pool` writes to its lower tiers on the
//! process's low-priority threads (nice 19), or, with it off, on the pool's own runtime.

mod common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use kvpool_backends::background::{BACKGROUND_NICE, this_threads_nice};
use kvpool_backends::{BackendFactory, InMemoryConnector, TierRequest, register_scheme};
use kvpool_core::{BackendError, ByteSize, ConfigError, PoolConfig, RemoteConnector, TierConfig};

/// The nice value of each thread a `batch_put` ran on.
type PutNices = Arc<Mutex<Vec<Option<i32>>>>;

/// Process memory that records the priority of the thread each write runs on.
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

struct Factory(PutNices);

#[async_trait]
impl BackendFactory for Factory {
    fn example(&self) -> String {
        "putpriority://".into()
    }
    async fn open(&self, _: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        Ok(Box::new(RecordsPutPriority {
            store: InMemoryConnector::default(),
            nices: self.0.clone(),
        }))
    }
}

#[test]
fn write_behind_runs_on_low_priority_threads_unless_turned_off() {
    let nices = PutNices::default();
    register_scheme("putpriority", Factory(nices.clone())).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let pools_own = runtime.block_on(async { tokio::spawn(async { this_threads_nice() }).await });
    let pools_own = pools_own.unwrap();
    assert_ne!(
        pools_own,
        Some(BACKGROUND_NICE),
        "the test runs at the lowest priority"
    );
    for (low_priority, expected) in [(true, Some(BACKGROUND_NICE)), (false, pools_own)] {
        let mut config = PoolConfig::default();
        config.local_cpu.max_size = ByteSize::mib(16);
        config.layout = common::tiered::layout();
        config.chunking.chunk_size = common::tiered::CHUNK;
        config.tiers.push(TierConfig::new("putpriority://"));
        config.write_behind.low_priority = low_priority;
        runtime.block_on(async {
            let pool = kvpool_backends::build_pool(&config).await.unwrap();
            let tokens: Vec<u32> = (0..32).map(|i| i * 7 + u32::from(low_priority)).collect();
            let slots: Vec<i64> = (0..32).collect();
            let kv = common::filled_cache(common::tiered::layout(), 8, 1);
            let report = pool.engine.store(&tokens, None, &kv, &slots).await.unwrap();
            assert_eq!(report.stored_chunks, 2);
            pool.engine.storage().flush().await.unwrap();
        });
        let seen = std::mem::take(&mut *nices.lock().unwrap());
        assert!(!seen.is_empty(), "the lower tier was written");
        if cfg!(target_os = "linux") {
            assert!(
                seen.iter().all(|&nice| nice == expected),
                "low_priority = {low_priority}: {seen:?}"
            );
        }
    }
}
