//! The daemon's tier read in place: a read of node memory copies only what shared memory
//! holds, and bytes another process changes during a read are misses, never data.

use std::sync::Arc;

use bytes::Bytes;
use kvpool_core::storage::remote::{RemoteBackend, RemoteConnector, node_memory_of};
use kvpool_core::{ChunkCodec, CopyOut, NodeMemoryConnector, StorageBackend};

use super::*;

/// What a read of shared memory alone copies out for `keys`, as raw bytes (these tests'
/// values are not in the chunk format).
async fn read_resident(engine: &DaemonConnector, keys: &[String]) -> Vec<Option<Vec<u8>>> {
    let copied = Arc::new(parking_lot::Mutex::new(vec![None; keys.len()]));
    let into = copied.clone();
    let raw: CopyOut = Arc::new(move |i, bytes| into.lock()[i] = Some(bytes.to_vec()));
    node_memory_of(engine)
        .unwrap()
        .batch_copy_out(keys, true, raw)
        .await
        .unwrap();
    copied.lock().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_node_memory_answers_only_what_shared_memory_holds() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let disk: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let (below, below_value) = chunk_value(5, &[5u8; 4096]);
    disk.put(&below, below_value.clone()).await.unwrap();
    let run = start(&path, 16 * MIB, vec![disk]);
    let engine = client(&path);
    assert!(engine.node_memory().is_some_and(|tier| tier.lends()));
    engine
        .batch_put(vec![("resident".into(), value(6, 4096))])
        .await
        .unwrap();
    let keys = ["resident".to_string(), below.clone()];
    // What a lookup asks: shared memory only, the lower tier untouched.
    let got = read_resident(&engine, &keys).await;
    assert_eq!(got[0].as_deref(), Some(&vec![6u8; 4096][..]));
    assert!(got[1].is_none(), "read from the daemon's lower tier");
    assert_eq!(run.daemon.stats().tier_hits, 0);
    // A miss ends the run: nothing after it is pinned or copied.
    let got = read_resident(&engine, &[below.clone(), "resident".into()]).await;
    assert_eq!(got, [None, None]);
    // A plain get promotes it from the lower tier.
    let got = engine.batch_get(&keys).await.unwrap();
    assert_eq!(got[1].as_deref(), Some(&below_value[..]));
    assert_eq!(run.daemon.stats().tier_hits, 1);
    // Both leave nothing pinned.
    assert_eq!(wait_for(&run.daemon, |s| s.pins == 0).pins, 0);
}

/// The daemon's tier with deletes ignored, so a value found corrupt stays where it is and is
/// read again.
struct NeverDeletes(DaemonConnector);

#[async_trait::async_trait]
impl RemoteConnector for NeverDeletes {
    fn name(&self) -> &str {
        self.0.name()
    }
    /// The daemon tier's own side: deletes, the one thing this wrapper changes, are not on it.
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        self.0.node_memory()
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, kvpool_core::BackendError> {
        self.0.batch_exists(keys).await
    }
    async fn batch_get(
        &self,
        keys: &[String],
    ) -> Result<Vec<Option<Bytes>>, kvpool_core::BackendError> {
        self.0.batch_get(keys).await
    }
    async fn batch_put(
        &self,
        entries: Vec<(String, Bytes)>,
    ) -> Result<(), kvpool_core::BackendError> {
        self.0.batch_put(entries).await
    }
    async fn batch_delete(&self, _keys: &[String]) -> Result<usize, kvpool_core::BackendError> {
        Ok(0)
    }
    async fn close(&self) -> Result<(), kvpool_core::BackendError> {
        self.0.close().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_another_process_changes_while_an_engine_reads_them_are_misses_never_data() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use kvpool_core::{CacheKey, Chunk, ChunkHash, ChunkMeta, Dtype, KeyScope, MemoryObj};

    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let engine = RemoteBackend::new(NeverDeletes(client(&path)), ChunkCodec::default(), 4 << 20);
    let scope = Arc::new(KeyScope::new("m", 1, 0, 0, 7).unwrap());
    let key = CacheKey::new(scope, ChunkHash([3; 16]));
    let original: Vec<u8> = (0..MIB).map(|i| (i * 31 % 251) as u8).collect();
    let chunk = Chunk {
        meta: ChunkMeta {
            layout_fingerprint: 7,
            dtype: Dtype::Bf16,
            token_count: 16,
        },
        data: MemoryObj::from_vec(original.clone()),
    };
    engine.put(vec![(key.clone(), chunk)]).await.unwrap();

    // Another process (here a thread writing through the daemon's own mapping) keeps flipping
    // one byte of the stored payload while the engine reads the value.
    let session = run.daemon.new_session();
    let region = run.daemon.store.pin(session, &key.to_string()).unwrap();
    let arena = run.daemon.store.arena().clone();
    let at = (region.offset + region.len / 2) as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: `at` lies inside the pinned value, inside the mapping.
                unsafe {
                    let byte = arena.as_ptr().as_ptr().add(at);
                    std::ptr::write_volatile(byte, std::ptr::read_volatile(byte) ^ 0xFF);
                }
            }
        })
    };
    let (mut served, mut missed) = (0, 0);
    for _ in 0..300 {
        let got = engine.get(std::slice::from_ref(&key)).await.unwrap();
        match &got[0] {
            Some(chunk) => {
                assert!(
                    chunk.data.as_slice() == &original[..],
                    "bytes changed under the read were returned as data"
                );
                served += 1;
            }
            None => missed += 1,
        }
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
    // Both outcomes happened, so the reads did race the writer.
    assert!(missed > 0, "no read saw the byte flipped ({served} served)");
    assert!(served > 0, "no read saw the original ({missed} missed)");
    assert_eq!(engine.stats().corrupt, missed as u64);
}
