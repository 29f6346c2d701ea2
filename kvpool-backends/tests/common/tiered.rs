//! The engine-level fixture: a cache engine over L1 (CPU) and a lower tier (the in-memory store
//! behind fault switches, through the chunk format), with helpers to store and retrieve.

use std::sync::Arc;

use super::{MapConnector, filled_cache};
use kvpool_backends::LocalCpuBackend;
use kvpool_core::storage::manager::StorageManagerConfig;
use kvpool_core::{
    CacheEngine, ChunkCodec, ChunkedTokenDatabase, ChunkingConfig, Compression, Dtype,
    EvictionKind, HostPagedKvCache, KeyScope, KvKind, KvLayout, RemoteBackend, StorageManager,
};

pub const CHUNK: usize = 16;

pub fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, 4).unwrap()
}

pub struct Setup {
    pub engine: CacheEngine,
    pub l1: Option<Arc<LocalCpuBackend>>,
    pub remote: MapConnector,
}

pub fn setup_with(
    l1_chunks: Option<usize>,
    save_unfull_chunk: bool,
    config: StorageManagerConfig,
) -> Setup {
    let layout = layout();
    let scope = KeyScope::new("test-model", 1, 0, 0, layout.fingerprint()).unwrap();
    let db = ChunkedTokenDatabase::new(
        ChunkingConfig {
            chunk_size: CHUNK,
            save_unfull_chunk,
            ..Default::default()
        },
        scope,
    )
    .unwrap();
    let remote = MapConnector::default();
    let codec = ChunkCodec {
        compression: Compression::Zstd { level: 1 },
        ..Default::default()
    };
    let lower = Arc::new(RemoteBackend::new(remote.clone(), codec, 1 << 20));
    let mut b = StorageManager::builder().config(config);
    let l1 = l1_chunks.map(|n| {
        let cpu = Arc::new(
            LocalCpuBackend::new(n * layout.chunk_bytes(CHUNK), EvictionKind::Lru).unwrap(),
        );
        b = std::mem::replace(&mut b, StorageManager::builder()).l1(cpu.clone(), cpu.clone());
        cpu
    });
    let manager = Arc::new(b.lower(lower).build().unwrap());
    Setup {
        engine: CacheEngine::new(layout, db, manager).unwrap(),
        l1,
        remote,
    }
}

/// A stored token sequence and where its KV came from / goes to.
pub struct Stored {
    pub toks: Vec<u32>,
    pub src_slots: Vec<i64>,
    pub dst_slots: Vec<i64>,
    pub src: HostPagedKvCache,
}

impl Setup {
    /// Stores `n` tokens (sequence `seed`) from a filled cache and waits for write-behind.
    pub async fn store_and_flush(&self, n: usize, seed: u32) -> Stored {
        let toks = tokens(n, seed);
        let (src_slots, dst_slots) = slots(n);
        let src = filled_cache(layout(), 100, seed + 1);
        self.engine
            .store(&toks, None, &src, &src_slots)
            .await
            .unwrap();
        self.engine.storage().flush().await.unwrap();
        Stored {
            toks,
            src_slots,
            dst_slots,
            src,
        }
    }

    /// Retrieves `toks` into a fresh cache; returns the loaded mask and the cache.
    pub async fn retrieve_all(
        &self,
        toks: &[u32],
        dst_slots: &[i64],
    ) -> (Vec<bool>, HostPagedKvCache) {
        let mut dst = HostPagedKvCache::new(layout(), 100);
        let mask = self
            .engine
            .retrieve(toks, None, &mut dst, dst_slots)
            .await
            .unwrap();
        (mask, dst)
    }
}

pub fn setup() -> Setup {
    setup_with(Some(64), false, StorageManagerConfig::default())
}

pub fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// Slots 0..n in the source cache; the same count, reversed, in a disjoint range of the destination.
pub fn slots(n: usize) -> (Vec<i64>, Vec<i64>) {
    let src: Vec<i64> = (0..n as i64).collect();
    let dst: Vec<i64> = (0..n as i64).map(|i| 200 + (n as i64 - 1 - i)).collect();
    (src, dst)
}
