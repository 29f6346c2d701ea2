//! A tenant's view of the daemon's lower tiers: every key it reads or writes lives under the
//! tenant's prefix (`tenant/<name>/`), so one tenant's engines can neither read, overwrite,
//! delete nor learn of another's values in a shared tier through the daemon. With the
//! tenant's secret, every value it writes carries an HMAC-SHA256 (over its key and bytes,
//! appended), checked on the way back: a value put in the shared tier by anyone without the
//! secret (another node, another program) is a miss, however consistent its header.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use kvpool_core::BackendError;
use kvpool_core::CopyOut;
use kvpool_core::storage::remote::{
    NodeMemoryConnector, RejectedValue, RemoteConnector, delete_rejected, one_answer,
    record_rejected, visit_each,
};
use kvpool_core::storage::tier_events::TierEventLog;
use sha2::Sha256;

/// Bytes of the tag appended to each value.
pub const MAC_BYTES: usize = 32;

/// See the module docs.
pub struct NamespacedConnector {
    inner: Arc<dyn RemoteConnector>,
    prefix: String,
    mac_key: Option<Vec<u8>>,
}

impl NamespacedConnector {
    /// `inner`'s keys under `prefix` (a tenant's `TenantConfig::namespace`).
    pub fn new(inner: Arc<dyn RemoteConnector>, prefix: String) -> Self {
        NamespacedConnector {
            inner,
            prefix,
            mac_key: None,
        }
    }

    /// The same, each value tagged with an HMAC-SHA256 under `key` (the tenant's secret).
    pub fn with_mac_key(mut self, key: Vec<u8>) -> Self {
        self.mac_key = Some(key);
        self
    }

    fn keys(&self, keys: &[String]) -> Vec<String> {
        keys.iter().map(|k| format!("{}{k}", self.prefix)).collect()
    }

    /// The tag of `value` under `key` (the key in the tier's namespace: a value moved to
    /// another key fails its check).
    fn tag(secret: &[u8], key: &str, value: &[u8]) -> [u8; MAC_BYTES] {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
        mac.update(&(key.len() as u64).to_le_bytes());
        mac.update(key.as_bytes());
        mac.update(value);
        mac.finalize().into_bytes().into()
    }

    /// `value` without its tag, if the tag is right.
    fn verified(secret: &[u8], key: &str, stored: Bytes) -> Option<Bytes> {
        let split = stored.len().checked_sub(MAC_BYTES)?;
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
        mac.update(&(key.len() as u64).to_le_bytes());
        mac.update(key.as_bytes());
        mac.update(&stored[..split]);
        // Constant time.
        mac.verify_slice(&stored[split..]).ok()?;
        Some(stored.slice(..split))
    }
}

/// Every method written out: each read goes through `batch_get` (the prefix and the MAC
/// check), each write through `batch_put` (the prefix and the tag), none straight to the
/// shared tier.
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl RemoteConnector for NamespacedConnector {
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// None, whatever the shared tier offers: its node-memory side would read and write
    /// outside the tenant's prefix, without the MAC.
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        None
    }

    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        one_answer(self.name(), self.batch_exists(&[key.to_string()]).await?)
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        one_answer(self.name(), self.batch_get(&[key.to_string()]).await?)
    }

    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.batch_put(vec![(key.to_string(), value)]).await
    }

    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.batch_delete(&[key.to_string()]).await? > 0)
    }

    /// Through [`NamespacedConnector::batch_get`], never the shared tier's own
    /// `batch_get_each`: a value is visited only once its MAC is checked and its tag cut off.
    async fn batch_get_each(&self, keys: &[String], visit: CopyOut) -> Result<(), BackendError> {
        visit_each(self.batch_get(keys).await?, visit);
        Ok(())
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.inner.batch_exists(&self.keys(keys)).await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let names = self.keys(keys);
        let values = self.inner.batch_get(&names).await?;
        let Some(secret) = &self.mac_key else {
            return Ok(values);
        };
        let mut forged = Vec::new();
        let out = names
            .iter()
            .zip(values)
            .map(|(name, value)| {
                let value = value?;
                let checked = Self::verified(secret, name, value.clone());
                if checked.is_none() {
                    record_rejected(self.inner.name(), name, &"without this tenant's MAC");
                    forged.push(RejectedValue::new(name.clone(), &value));
                }
                checked
            })
            .collect();
        // Deleted (each only if still the bytes read: a good value written since stays), so
        // that lookups stop promising it and a later save stores it again.
        delete_rejected(self.inner.as_ref(), forged).await;
        Ok(out)
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        let entries = entries
            .into_iter()
            .map(|(k, v)| {
                let name = format!("{}{k}", self.prefix);
                let value = match &self.mac_key {
                    Some(secret) => {
                        let tag = Self::tag(secret, &name, &v);
                        let mut tagged = Vec::with_capacity(v.len() + MAC_BYTES);
                        tagged.extend_from_slice(&v);
                        tagged.extend_from_slice(&tag);
                        Bytes::from(tagged)
                    }
                    None => v,
                };
                (name, value)
            })
            .collect();
        self.inner.batch_put(entries).await
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.inner.batch_delete(&self.keys(keys)).await
    }

    async fn close(&self) -> Result<(), BackendError> {
        // The tier is shared by every tenant: `kvpool serve` closes it once, itself.
        Ok(())
    }

    fn set_event_log(&self, events: Arc<TierEventLog>) {
        self.inner.set_event_log(events);
    }
}

#[cfg(test)]
mod tests {
    use parking_lot::Mutex;

    use super::*;
    use crate::memory::InMemoryConnector;

    /// A shared tier where another writer stores a value right after the next read has read.
    #[derive(Default)]
    struct WrittenAfterNextRead {
        inner: InMemoryConnector,
        pending: Mutex<Option<(String, Bytes)>>,
    }

    #[async_trait]
    impl RemoteConnector for WrittenAfterNextRead {
        fn name(&self) -> &str {
            "written-after-next-read"
        }
        async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
            self.inner.batch_exists(keys).await
        }
        async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
            let read = self.inner.batch_get(keys).await?;
            let pending = self.pending.lock().take();
            if let Some(entry) = pending {
                self.inner.batch_put(vec![entry]).await?;
            }
            Ok(read)
        }
        async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
            self.inner.batch_put(entries).await
        }
        async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
            self.inner.batch_delete(keys).await
        }
        async fn close(&self) -> Result<(), BackendError> {
            Ok(())
        }
    }

    /// A guard for the written-out methods: a forwarding `batch_get_each` or `get`, or the
    /// shared tier's node-memory side, would hand out a forged value or read outside the
    /// prefix.
    #[tokio::test]
    async fn every_read_of_a_tenant_checks_the_mac_and_none_reaches_the_shared_tier_directly() {
        let shared = crate::memory::InMemoryNodeMemory::default();
        let tenant = NamespacedConnector::new(Arc::new(shared.clone()), "tenant/a/".into())
            .with_mac_key(b"0123456789abcdef0123456789abcdef".to_vec());
        assert!(shared.node_memory().is_some());
        assert!(tenant.node_memory().is_none());
        tenant
            .put("good", Bytes::from_static(b"mine"))
            .await
            .unwrap();
        shared
            .put("tenant/a/forged", Bytes::from_static(b"not tagged"))
            .await
            .unwrap();
        let keys = ["forged".to_string(), "good".to_string()];
        let visited = Arc::new(Mutex::new(Vec::new()));
        let seen = visited.clone();
        tenant
            .batch_get_each(
                &keys,
                Arc::new(move |i, bytes: &[u8]| seen.lock().push((i, bytes.to_vec()))),
            )
            .await
            .unwrap();
        assert_eq!(*visited.lock(), [(1, b"mine".to_vec())]);
        assert_eq!(
            tenant.get("good").await.unwrap().as_deref(),
            Some(&b"mine"[..])
        );
        shared
            .put("tenant/a/forged", Bytes::from_static(b"not tagged"))
            .await
            .unwrap();
        assert_eq!(tenant.get("forged").await.unwrap(), None);
        assert!(tenant.exists("good").await.unwrap());
        assert!(tenant.delete("good").await.unwrap());
        assert!(!shared.exists("tenant/a/good").await.unwrap());
    }

    #[tokio::test]
    async fn a_value_without_the_mac_is_deleted_but_a_tagged_one_written_since_stays() {
        let shared = Arc::new(WrittenAfterNextRead::default());
        let tenant = NamespacedConnector::new(shared.clone(), "tenant/a/".into())
            .with_mac_key(b"0123456789abcdef0123456789abcdef".to_vec());
        let keys = ["k1".to_string(), "k2".to_string()];
        tenant
            .batch_put(vec![
                (keys[0].clone(), Bytes::from_static(b"first")),
                (keys[1].clone(), Bytes::from_static(b"second")),
            ])
            .await
            .unwrap();
        let names = ["tenant/a/k1".to_string(), "tenant/a/k2".to_string()];
        let tagged = shared.inner.batch_get(&names[..1]).await.unwrap()[0]
            .clone()
            .unwrap();
        // Both values forged below the tenant; the tenant's own tagged value is written again
        // under k1 just after the read has read the forged one.
        shared
            .batch_put(vec![
                (names[0].clone(), Bytes::from_static(b"forged-1")),
                (names[1].clone(), Bytes::from_static(b"forged-2")),
            ])
            .await
            .unwrap();
        *shared.pending.lock() = Some((names[0].clone(), tagged));

        assert_eq!(tenant.batch_get(&keys).await.unwrap(), [None, None]);
        assert_eq!(
            shared.batch_exists(&names).await.unwrap(),
            [true, false],
            "the tagged value written since the read was deleted, or the forged one kept"
        );
        assert_eq!(
            tenant.batch_get(&keys[..1]).await.unwrap()[0].as_deref(),
            Some(&b"first"[..])
        );
    }
}
