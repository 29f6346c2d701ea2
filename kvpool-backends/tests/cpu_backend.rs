//! The CPU (L1) backend: capacity bounds, eviction order, pinning, exact bytes.

use kvpool_backends::LocalCpuBackend;
use kvpool_core::memory::pool::REGION_ALIGN;
use kvpool_core::{
    CacheKey, Chunk, ChunkAllocator, ChunkHash, ChunkMeta, Dtype, EvictionKind, KeyScope,
    MemoryObj, StorageBackend,
};
use std::sync::Arc;

fn key(i: u8) -> CacheKey {
    CacheKey::new(
        Arc::new(KeyScope::new("m", 1, 0, 0, 1).unwrap()),
        ChunkHash([i; 16]),
    )
}

fn heap_chunk(len: usize, fill: u8) -> Chunk {
    Chunk {
        meta: ChunkMeta {
            layout_fingerprint: 1,
            dtype: Dtype::F16,
            token_count: 1,
        },
        data: MemoryObj::from_vec(vec![fill; len]),
    }
}

async fn present(b: &LocalCpuBackend, n: u8) -> Vec<u8> {
    let keys: Vec<_> = (0..n).map(key).collect();
    let found = b.contains(&keys).await.unwrap();
    (0..n).filter(|&i| found[i as usize]).collect()
}

#[tokio::test]
async fn capacity_is_never_exceeded_and_bytes_are_exact() {
    let cap = 10 * REGION_ALIGN;
    let b = LocalCpuBackend::new(cap, EvictionKind::Lru).unwrap();
    for i in 0..50u8 {
        let len = 1 + (i as usize * 37) % (3 * REGION_ALIGN);
        let out = b.put(vec![(key(i), heap_chunk(len, i))]).await.unwrap();
        assert_eq!(out.stored, 1);
        let st = b.stats();
        assert!(st.bytes <= cap as u64, "{st:?}");
        assert!(b.pool().stats().used <= cap);
        let got = b.get(&[key(i)]).await.unwrap().remove(0).unwrap();
        assert_eq!(got.data.as_slice(), vec![i; len].as_slice());
    }
    assert!(b.stats().evictions > 0);
}

#[tokio::test]
async fn lru_and_fifo_evict_in_their_orders() {
    for (kind, expect) in [
        (EvictionKind::Lru, vec![0u8, 2, 3]),
        (EvictionKind::Fifo, vec![1u8, 2, 3]),
    ] {
        let b = LocalCpuBackend::new(3 * REGION_ALIGN, kind).unwrap();
        for i in 0..3 {
            b.put(vec![(key(i), heap_chunk(REGION_ALIGN, i))])
                .await
                .unwrap();
        }
        b.get(&[key(0)]).await.unwrap(); // a hit on the oldest
        b.put(vec![(key(3), heap_chunk(REGION_ALIGN, 3))])
            .await
            .unwrap();
        assert_eq!(present(&b, 4).await, expect, "{kind:?}");
    }
}

#[tokio::test]
async fn chunks_in_use_are_not_evicted_and_a_full_pinned_pool_skips() {
    let b = LocalCpuBackend::new(2 * REGION_ALIGN, EvictionKind::Lru).unwrap();
    b.put(vec![(key(0), heap_chunk(REGION_ALIGN, 0))])
        .await
        .unwrap();
    b.put(vec![(key(1), heap_chunk(REGION_ALIGN, 1))])
        .await
        .unwrap();
    let held = b.get(&[key(0)]).await.unwrap().remove(0).unwrap(); // a reader holds chunk 0
    b.get(&[key(1)]).await.unwrap();
    // LRU would pick 0, but it is in use: 1 goes instead.
    b.put(vec![(key(2), heap_chunk(REGION_ALIGN, 2))])
        .await
        .unwrap();
    assert_eq!(present(&b, 3).await, vec![0, 2]);
    let held2 = b.get(&[key(2)]).await.unwrap().remove(0).unwrap();
    let out = b
        .put(vec![(key(3), heap_chunk(REGION_ALIGN, 3))])
        .await
        .unwrap();
    assert_eq!(
        (out.stored, out.skipped),
        (0, 1),
        "everything pinned: skip, don't exceed"
    );
    assert!(b.allocate(REGION_ALIGN).is_err());
    drop((held, held2));
    assert!(
        b.allocate(REGION_ALIGN).is_ok(),
        "eviction works again once readers are done"
    );
}

#[tokio::test]
async fn pooled_buffers_are_stored_without_copy_and_remove_frees_space() {
    let b = LocalCpuBackend::new(4 * REGION_ALIGN, EvictionKind::S3fifo).unwrap();
    let mut buf = b.allocate(100).unwrap();
    buf.as_mut_slice().fill(9);
    let data = buf.freeze();
    let ptr = data.as_slice().as_ptr();
    let chunk = Chunk {
        meta: heap_chunk(1, 0).meta,
        data,
    };
    b.put(vec![(key(7), chunk)]).await.unwrap();
    let got = b.get(&[key(7)]).await.unwrap().remove(0).unwrap();
    assert_eq!(got.data.as_slice().as_ptr(), ptr);
    drop(got);
    assert_eq!(b.remove(&[key(7), key(8)]).await.unwrap(), 1);
    assert_eq!(b.pool().stats().used, 0);
    assert_eq!(b.stats().entries, 0);
}

#[tokio::test]
async fn oversized_chunk_is_skipped_not_panicking() {
    let b = LocalCpuBackend::new(REGION_ALIGN, EvictionKind::Lru).unwrap();
    let out = b
        .put(vec![(key(0), heap_chunk(2 * REGION_ALIGN, 0))])
        .await
        .unwrap();
    assert_eq!((out.stored, out.skipped), (0, 1));
}

/// A guard attached to L1's arena through the storage manager (a GPU engine's page-locking of
/// it) is held by the arena and ends when the arena is freed: not before, while chunks may
/// still be copied through it, and not never.
#[tokio::test]
async fn a_guard_attached_to_l1s_memory_ends_when_that_memory_is_freed() {
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Guard(Arc<AtomicBool>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let cpu = Arc::new(LocalCpuBackend::new(64 * REGION_ALIGN, EvictionKind::Lru).unwrap());
    let manager = kvpool_core::StorageManager::builder()
        .l1(cpu.clone(), cpu.clone())
        .build()
        .unwrap();
    assert_eq!(manager.host_region(), cpu.host_region());
    let ended = Arc::new(AtomicBool::new(false));
    assert!(
        manager
            .attach_to_host_region(Box::new(Guard(ended.clone())))
            .is_ok(),
        "L1 holds the guard"
    );
    drop(manager);
    assert!(!ended.load(Ordering::SeqCst), "the arena is still alive");
    drop(cpu);
    assert!(ended.load(Ordering::SeqCst), "ended with the arena");
}
