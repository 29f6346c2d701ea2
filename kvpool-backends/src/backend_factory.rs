//! The contract a backend implements to be opened by URL: `BackendFactory` and what it is given
//! (`TierRequest`). Built-in and third-party backends implement the same trait; the scheme
//! registry (`registry.rs`) maps schemes to factories.

use std::time::Duration;

use async_trait::async_trait;

use kvpool_core::{ConfigError, RemoteConnector, TierConfig, TierOptionsReader};

/// What a backend is given to open one tier.
pub struct TierRequest<'a> {
    /// The tier's `[[tier]]` table.
    pub tier: &'a TierConfig,
    /// The largest decoded chunk the pool stores; a backend may refuse to read a value much
    /// larger than this (see `kvpool_core::format::chunk_format::max_stored_len`).
    pub max_chunk_bytes: u64,
}

impl TierRequest<'_> {
    /// The tier's URL (its scheme selected this backend).
    pub fn url(&self) -> &str {
        &self.tier.url
    }

    /// The bound on connecting and on every call.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.tier.timeout_ms)
    }

    /// A typed reader of the tier's options; call [`TierOptionsReader::finish`] once every
    /// option the backend knows has been read, so that a misspelt one is an error.
    pub fn options(&self) -> TierOptionsReader<'_> {
        self.tier.options_reader()
    }
}

/// Opens tiers of the schemes it is registered under.
#[async_trait]
pub trait BackendFactory: Send + Sync + 'static {
    /// An example `[[tier]]` body with the options this backend takes, as TOML (one line,
    /// options after `#`), for `kvpool config --schemes` and error messages.
    fn example(&self) -> String;

    /// Reads the tier's options (rejecting unknown ones), connects within
    /// [`TierRequest::timeout`] and returns the store. Errors say what to fix; a store that
    /// is configured correctly but cannot be reached now answers
    /// [`ConfigError::Unreachable`]: the pool then opens without it and keeps calling `open`
    /// in the background (the tier misses meanwhile).
    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError>;

    /// The name the store will have (its `RemoteConnector::name`), for a tier not reached
    /// yet: in logs and metrics until it is (default: the URL's scheme).
    fn name_before_open(&self, scheme: &str) -> String {
        scheme.to_string()
    }
}
