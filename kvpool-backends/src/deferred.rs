//! A tier whose service could not be reached at start-up: the pool opens without it (every
//! call is a miss) while a background task keeps trying to open it, with backoff, and
//! delegates to it once it is up. The same outage a minute later is only a miss too.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};

use kvpool_core::storage::remote::NodeMemoryConnector;
use kvpool_core::storage::tier_events::TierEventLog;
use kvpool_core::{BackendError, ConfigError, RemoteConnector, TierConfig, redact_url};

use crate::backend_factory::{BackendFactory, TierRequest};
use crate::telemetry;

/// The first wait before trying again; doubled after each failure up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What the connector and its retry task share.
struct Shared {
    name: String,
    /// Set by `close`: a tier opened after it is closed at once, never used.
    closed: std::sync::atomic::AtomicBool,
    /// The tier once it opened.
    opened: RwLock<Option<Arc<dyn RemoteConnector>>>,
    /// Why it is not open (the last failure).
    reason: Mutex<String>,
    /// The event log to hand the tier once it opens.
    events: Mutex<Option<Arc<TierEventLog>>>,
}

/// See the module docs. It stands in for a store (values in, values out): `node_memory()`
/// is `None`, as the stores it defers have no node-memory side (the daemon's own tier
/// connects lazily and never defers).
pub struct DeferredConnector {
    shared: Arc<Shared>,
    retry: Option<tokio::task::JoinHandle<()>>,
}

impl DeferredConnector {
    /// A tier that `factory` could not open (`first_error`), tried again in the background on
    /// the current tokio runtime (none: it stays down).
    pub fn new(
        factory: Arc<dyn BackendFactory>,
        tier: TierConfig,
        max_chunk_bytes: u64,
        name: String,
        first_error: String,
    ) -> Self {
        let shared = Arc::new(Shared {
            name,
            closed: std::sync::atomic::AtomicBool::new(false),
            opened: RwLock::new(None),
            reason: Mutex::new(first_error),
            events: Mutex::new(None),
        });
        let url = redact_url(&tier.url);
        metrics::gauge!(telemetry::TIER_REACHABLE, "tier" => shared.name.clone()).set(0.0);
        tracing::warn!(
            tier = %url,
            "tier `{url}` cannot be reached at start-up ({}); it counts as a miss until it \
             can, and is tried again in the background",
            shared.reason.lock()
        );
        let retry = tokio::runtime::Handle::try_current()
            .ok()
            .map(|runtime| runtime.spawn(retry(shared.clone(), factory, tier, max_chunk_bytes)));
        if retry.is_none() {
            tracing::error!(tier = %url, "no runtime to retry tier `{url}` on: it stays down");
        }
        DeferredConnector { shared, retry }
    }

    /// Whether the tier has opened.
    pub fn is_open(&self) -> bool {
        self.shared.opened.read().is_some()
    }

    fn open(&self) -> Result<Arc<dyn RemoteConnector>, BackendError> {
        self.shared
            .opened
            .read()
            .clone()
            .ok_or_else(|| BackendError::Unavailable {
                backend: self.shared.name.clone(),
                reason: format!("not reached since start-up: {}", self.shared.reason.lock()),
            })
    }
}

/// Tries to open the tier, with backoff, until it opens or its configuration is refused.
async fn retry(
    shared: Arc<Shared>,
    factory: Arc<dyn BackendFactory>,
    tier: TierConfig,
    max_chunk_bytes: u64,
) {
    let url = redact_url(&tier.url);
    let mut wait = RETRY_FIRST;
    loop {
        tokio::time::sleep(wait).await;
        let request = TierRequest {
            tier: &tier,
            max_chunk_bytes,
        };
        let attempt = tokio::time::timeout(request.timeout(), factory.open(&request)).await;
        match attempt {
            Ok(Ok(connector)) => {
                let connector: Arc<dyn RemoteConnector> = Arc::from(connector);
                {
                    // Under the events lock: `set_event_log` cannot slip between the two;
                    // under the `opened` lock: `close` cannot either.
                    let events = shared.events.lock();
                    let mut opened = shared.opened.write();
                    if !shared.closed.load(std::sync::atomic::Ordering::Acquire) {
                        if let Some(events) = events.clone() {
                            connector.set_event_log(events);
                        }
                        *opened = Some(connector);
                        drop(opened);
                        drop(events);
                    } else {
                        drop(opened);
                        drop(events);
                        let _ = connector.close().await;
                        return;
                    }
                }
                metrics::gauge!(telemetry::TIER_REACHABLE, "tier" => shared.name.clone()).set(1.0);
                tracing::warn!(tier = %url, "tier `{url}` reached: in use from now on");
                return;
            }
            Ok(Err(ConfigError::Unreachable { reason, .. })) => {
                tracing::debug!(tier = %url, "tier `{url}` still cannot be reached: {reason}");
                *shared.reason.lock() = reason;
            }
            Ok(Err(e)) => {
                // Reached, and refused (a password changed, say): still down, tried again at
                // the longest interval; said loudly the first time.
                let reason = e.to_string();
                if *shared.reason.lock() != reason {
                    tracing::error!(tier = %url, "tier `{url}` reached but refused: {e}; it stays down and is tried again every {RETRY_MAX:?}");
                }
                *shared.reason.lock() = reason;
                wait = RETRY_MAX;
                continue;
            }
            Err(_) => {
                *shared.reason.lock() = format!("no answer within {:?}", request.timeout());
            }
        }
        wait = (wait * 2).min(RETRY_MAX);
    }
}

impl Drop for DeferredConnector {
    fn drop(&mut self) {
        if let Some(retry) = self.retry.take() {
            retry.abort();
        }
    }
}

/// Every method forwarded to the tier once it is open (an error, so a miss, before), but
/// `node_memory`.
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl RemoteConnector for DeferredConnector {
    fn name(&self) -> &str {
        &self.shared.name
    }

    /// None: the stores it defers have no node-memory side (see the type's docs).
    fn node_memory(&self) -> Option<&dyn NodeMemoryConnector> {
        None
    }

    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.open()?.exists(key).await
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.open()?.get(key).await
    }

    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.open()?.put(key, value).await
    }

    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        self.open()?.delete(key).await
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.open()?.batch_exists(keys).await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.open()?.batch_get(keys).await
    }

    async fn batch_get_each(
        &self,
        keys: &[String],
        visit: kvpool_core::CopyOut,
    ) -> Result<(), BackendError> {
        self.open()?.batch_get_each(keys, visit).await
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.open()?.batch_put(entries).await
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.open()?.batch_delete(keys).await
    }

    async fn close(&self) -> Result<(), BackendError> {
        if let Some(retry) = &self.retry {
            retry.abort();
        }
        let opened = {
            let mut opened = self.shared.opened.write();
            self.shared
                .closed
                .store(true, std::sync::atomic::Ordering::Release);
            opened.take()
        };
        match opened {
            Some(connector) => connector.close().await,
            None => Ok(()),
        }
    }

    fn set_event_log(&self, events: Arc<TierEventLog>) {
        let mut held = self.shared.events.lock();
        *held = Some(events.clone());
        if let Some(connector) = self.shared.opened.read().clone() {
            connector.set_event_log(events);
        }
    }
}
