//! `RemoteBackend` over a tier that reads node memory: one-copy reads and writes
//! (`batch_copy_out`, `batch_copy_in`), and the checks every other tier's values get.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;

use crate::error::BackendError;
use crate::format::chunk_format::{ChunkCodec, ChunkMeta, Compression};
use crate::keys::cache_key::{CacheKey, KeyScope};
use crate::keys::chunk_hash::ChunkHash;
use crate::layout::Dtype;
use crate::memory::SharedMapping;
use crate::memory::pool::MemoryObj;
use crate::storage::backend::{Chunk, NodeMemoryBackend, StorageBackend};
use crate::storage::node_memory::PinnedBytes;
use crate::storage::remote::{
    CopyIn, CopyOut, NodeMemoryConnector, RemoteBackend, RemoteConnector,
};
use crate::storage::save_slot::LentBytes;

/// A store in this process's memory that says (or not) that it reads node memory, and logs
/// which of its calls were made.
#[derive(Default)]
struct LoggingStore {
    node_memory: bool,
    /// Where the node memory lends its values (`batch_pin`), how long past now each pin
    /// stays usable (negative: already past it); `None`: it lends nothing.
    pin_lease_secs: Option<i64>,
    values: Mutex<HashMap<String, Vec<u8>>>,
    calls: Mutex<Vec<&'static str>>,
    /// A value another writer stores right after the next read has read.
    written_after_next_read: Mutex<Option<(String, Vec<u8>)>>,
}

impl LoggingStore {
    fn log(&self, call: &'static str) {
        self.calls.lock().push(call);
    }
    fn calls(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.calls.lock())
    }
    fn a_read_ended(&self) {
        if let Some((key, value)) = self.written_after_next_read.lock().take() {
            self.values.lock().insert(key, value);
        }
    }
}

#[async_trait]
impl RemoteConnector for Arc<LoggingStore> {
    fn name(&self) -> &str {
        "logging"
    }
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        self.node_memory.then_some(self as &dyn NodeMemoryConnector)
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        let values = self.values.lock();
        Ok(keys.iter().map(|k| values.contains_key(k)).collect())
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.log("batch_get");
        let read = {
            let values = self.values.lock();
            keys.iter()
                .map(|k| values.get(k).map(|v| Bytes::copy_from_slice(v)))
                .collect()
        };
        self.a_read_ended();
        Ok(read)
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.log("batch_put");
        let mut values = self.values.lock();
        for (k, v) in entries {
            values.insert(k, v.to_vec());
        }
        Ok(())
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let mut values = self.values.lock();
        Ok(keys.iter().filter(|k| values.remove(*k).is_some()).count())
    }
    async fn close(&self) -> Result<(), BackendError> {
        Ok(())
    }
}

/// The tier's node memory is this process's: no pins, no loans.
#[async_trait]
impl NodeMemoryConnector for Arc<LoggingStore> {
    fn lends(&self) -> bool {
        self.pin_lease_secs.is_some()
    }
    fn node_memory_mapping(&self) -> Option<Arc<SharedMapping>> {
        None
    }
    /// Lends a copy of each value, which its pin owns (so it stays put while lent).
    async fn batch_pin(&self, keys: &[String]) -> Result<Vec<Option<PinnedBytes>>, BackendError> {
        self.log("batch_pin");
        let Some(lease) = self.pin_lease_secs else {
            return Ok(keys.iter().map(|_| None).collect());
        };
        let now = Instant::now();
        let usable_until = if lease >= 0 {
            now + Duration::from_secs(lease as u64)
        } else {
            now - Duration::from_secs(lease.unsigned_abs())
        };
        let values = self.values.lock();
        Ok(keys
            .iter()
            .map(|k| {
                let lent: Box<[u8]> = values.get(k)?.clone().into_boxed_slice();
                // SAFETY: the boxed bytes are the pin, so they stay where they are while it
                // lives.
                Some(unsafe {
                    PinnedBytes::new(lent.as_ptr(), lent.len(), usable_until, Box::new(lent))
                })
            })
            .collect())
    }
    async fn batch_lend(&self, lens: &[usize]) -> Result<Vec<Option<LentBytes>>, BackendError> {
        Ok(lens.iter().map(|_| None).collect())
    }
    async fn batch_commit_lent(
        &self,
        entries: Vec<(String, LentBytes)>,
    ) -> Result<usize, BackendError> {
        drop(entries);
        Ok(0)
    }
    /// Reads in place: the copy-out sees the stored bytes themselves.
    async fn batch_copy_out(
        &self,
        keys: &[String],
        resident_only: bool,
        copy_out: CopyOut,
    ) -> Result<(), BackendError> {
        self.log(if resident_only {
            "batch_copy_out(resident)"
        } else {
            "batch_copy_out"
        });
        {
            let values = self.values.lock();
            for (i, k) in keys.iter().enumerate() {
                if let Some(v) = values.get(k) {
                    copy_out(i, v);
                }
            }
        }
        self.a_read_ended();
        Ok(())
    }
    /// Writes in place: the copy-in fills the stored bytes themselves, over what was there.
    async fn batch_copy_in(
        &self,
        entries: Vec<(String, usize)>,
        copy_in: CopyIn,
    ) -> Result<(), BackendError> {
        self.log("batch_copy_in");
        let mut values = self.values.lock();
        for (i, (k, len)) in entries.into_iter().enumerate() {
            let mut value = vec![0xEE; len];
            copy_in(i, &mut value);
            values.insert(k, value);
        }
        Ok(())
    }
}

fn keys(n: u8) -> Vec<CacheKey> {
    let scope = Arc::new(KeyScope::new("m", 1, 0, 0, 9).unwrap());
    (0..n)
        .map(|i| CacheKey::new(scope.clone(), ChunkHash([i; 16])))
        .collect()
}

fn chunk(byte: u8) -> Chunk {
    Chunk {
        meta: ChunkMeta {
            layout_fingerprint: 9,
            dtype: Dtype::Bf16,
            token_count: 4,
        },
        data: MemoryObj::from_vec(vec![byte; 4096]),
    }
}

fn tier(
    node_memory: bool,
    codec: ChunkCodec,
) -> (Arc<LoggingStore>, RemoteBackend<Arc<LoggingStore>>) {
    let store = Arc::new(LoggingStore {
        node_memory,
        ..Default::default()
    });
    (store.clone(), RemoteBackend::new(store, codec, 1 << 20))
}

#[tokio::test]
async fn a_node_memory_tier_is_read_and_written_in_place_and_still_checked() {
    let (store, backend) = tier(true, ChunkCodec::default());
    let keys = keys(3);
    let entries = keys
        .iter()
        .zip([1, 2, 3])
        .map(|(k, b)| (k.clone(), chunk(b)));
    backend.put(entries.collect()).await.unwrap();
    assert_eq!(store.calls(), ["batch_copy_in"]);

    let got = backend.get(&keys).await.unwrap();
    assert_eq!(store.calls(), ["batch_copy_out"]);
    for (chunk, byte) in got.iter().zip([1u8, 2, 3]) {
        let chunk = chunk.as_ref().expect("stored");
        assert_eq!(chunk.data.as_slice(), &[byte; 4096][..]);
        assert_eq!(chunk.meta.token_count, 4);
    }
    let node_memory = backend.node_memory().expect("a tier in node memory");
    // It reads and writes in place but lends nothing: chunks are not pinned where they lie.
    assert!(!node_memory.lends_node_memory());
    let got = node_memory.get_node_memory(&keys[..1]).await.unwrap();
    assert_eq!(store.calls(), ["batch_copy_out(resident)"]);
    assert!(got[0].is_some());

    // A value changed where it lies, and one filed under another key, are misses: dropped
    // from the store and counted corrupt.
    let names: Vec<String> = keys.iter().map(ToString::to_string).collect();
    {
        let mut values = store.values.lock();
        values.get_mut(&names[0]).unwrap()[100] ^= 1;
        let misfiled = values[&names[2]].clone();
        values.insert(names[1].clone(), misfiled);
    }
    let got = backend.get(&keys).await.unwrap();
    assert!(
        got[0].is_none() && got[1].is_none(),
        "a bad value was returned"
    );
    assert!(got[2].is_some());
    assert_eq!(backend.stats().corrupt, 2);
    assert_eq!(
        backend.contains(&keys).await.unwrap(),
        [false, false, true],
        "the bad values were not deleted"
    );
}

#[tokio::test]
async fn other_tiers_and_compressing_codecs_keep_the_buffered_path() {
    let (store, backend) = tier(false, ChunkCodec::default());
    let keys = keys(1);
    backend
        .put(vec![(keys[0].clone(), chunk(4))])
        .await
        .unwrap();
    let got = backend.get(&keys).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap().data.as_slice(), &[4u8; 4096][..]);
    assert_eq!(store.calls(), ["batch_put", "batch_get"]);

    // A compressed value's length is known only once encoded: it is stored from a buffer,
    // and still read in place.
    let zstd = ChunkCodec {
        compression: Compression::Zstd { level: 1 },
        ..ChunkCodec::default()
    };
    let (store, backend) = tier(true, zstd);
    backend
        .put(vec![(keys[0].clone(), chunk(5))])
        .await
        .unwrap();
    let got = backend.get(&keys).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap().data.as_slice(), &[5u8; 4096][..]);
    assert_eq!(store.calls(), ["batch_put", "batch_copy_out"]);
}

/// How a test reads a tier: `get` or `get_each`.
#[derive(Clone, Copy, Debug)]
enum Read {
    Get,
    GetEach,
}

/// Which of `keys` the read found good.
async fn found(
    backend: &RemoteBackend<Arc<LoggingStore>>,
    keys: &[CacheKey],
    read: Read,
) -> Vec<bool> {
    match read {
        Read::Get => backend
            .get(keys)
            .await
            .unwrap()
            .iter()
            .map(Option::is_some)
            .collect(),
        Read::GetEach => backend
            .get_each(keys, Arc::new(|_, _, _| {}))
            .await
            .unwrap(),
    }
}

#[tokio::test]
async fn a_bad_read_deletes_the_bad_value_but_not_a_good_one_written_since() {
    for (node_memory, read) in [
        (false, Read::Get),
        (false, Read::GetEach),
        (true, Read::Get),
    ] {
        let case = format!("node memory {node_memory}, {read:?}");
        let (store, backend) = tier(node_memory, ChunkCodec::default());
        let keys = keys(2);
        let entries = keys.iter().zip([1, 2]).map(|(k, b)| (k.clone(), chunk(b)));
        backend.put(entries.collect()).await.unwrap();
        let names: Vec<String> = keys.iter().map(ToString::to_string).collect();
        let good = store.values.lock()[&names[0]].clone();
        // Both values changed where they lie; a save stores key 0's good value again just
        // after the read has read the bad one.
        for name in &names {
            store.values.lock().get_mut(name).unwrap()[100] ^= 1;
        }
        *store.written_after_next_read.lock() = Some((names[0].clone(), good));
        store.calls();

        assert_eq!(
            found(&backend, &keys, read).await,
            [false, false],
            "{case}: a bad value was returned"
        );
        // The re-read before the delete asks only what node memory holds: the storage
        // behind it (the daemon's disk, a network tier) is never read for it.
        let reads: &[&str] = if node_memory {
            &["batch_copy_out", "batch_copy_out(resident)"]
        } else {
            &["batch_get", "batch_get"]
        };
        assert_eq!(store.calls(), reads, "{case}");
        assert_eq!(
            backend.contains(&keys).await.unwrap(),
            [true, false],
            "{case}: the good value written since the read was deleted, or the bad one kept"
        );
        let again = backend.get(&keys[..1]).await.unwrap();
        assert_eq!(
            again[0].as_ref().expect("the good value").data.as_slice(),
            &[1u8; 4096][..],
            "{case}"
        );
    }
}

/// A value lent where it lies whose header fails is deleted while the pin still vouches for
/// the bytes digested; past its lease the memory may hold anything, and nothing is deleted.
#[tokio::test]
async fn a_lent_value_whose_header_fails_is_deleted_only_while_its_pin_is_usable() {
    for (lease, deleted) in [(60, true), (-1, false)] {
        let store = Arc::new(LoggingStore {
            node_memory: true,
            pin_lease_secs: Some(lease),
            ..Default::default()
        });
        let backend = RemoteBackend::new(store.clone(), ChunkCodec::default(), 1 << 20);
        let keys = keys(1);
        backend
            .put(vec![(keys[0].clone(), chunk(1))])
            .await
            .unwrap();
        let name = keys[0].to_string();
        store.values.lock().get_mut(&name).unwrap()[0] ^= 0xff;
        store.calls();

        let pinned = backend.pin_node_memory(&keys).await.unwrap();
        assert!(
            pinned[0].is_none(),
            "lease {lease}: a bad header was lent on"
        );
        let expect_calls: &[&str] = if deleted {
            &["batch_pin", "batch_copy_out(resident)"]
        } else {
            &["batch_pin"]
        };
        assert_eq!(store.calls(), expect_calls, "lease {lease}");
        assert_eq!(
            store.values.lock().contains_key(&name),
            !deleted,
            "lease {lease}"
        );
    }
}
