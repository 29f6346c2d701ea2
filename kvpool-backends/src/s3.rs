//! `s3://bucket/prefix`: S3 and S3-compatible object stores (through `object_store`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt, stream};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{
    ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};

use kvpool_core::format::chunk_format::max_stored_len;
use kvpool_core::{BackendError, ConfigError, RemoteConnector};

use crate::backend_factory::{BackendFactory, TierRequest};
use tracing::warn;

/// Settings of an S3 tier. Credentials and anything not set here come from the standard
/// environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
/// `AWS_REGION`, `AWS_ENDPOINT_URL`, …).
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// `s3://bucket/optional/prefix`.
    pub url: String,
    /// Endpoint of an S3-compatible server (`http://127.0.0.1:9000`); path-style requests are
    /// used with it, and plain HTTP is allowed when it says `http://`.
    pub endpoint: Option<String>,
    /// Region (default from the environment, else `us-east-1`).
    pub region: Option<String>,
    /// Access key id and secret, overriding the environment's.
    pub credentials: Option<(String, String)>,
    /// Bound on every request.
    pub timeout: Duration,
    /// Requests in flight per batch.
    pub concurrency: usize,
    /// Values above this size are uploaded in parts of this size.
    pub multipart_part_bytes: usize,
    /// Largest object a read accepts: a larger one's body is never read (its size is in the
    /// response head) and it comes back as an empty value, which the chunk format rejects as
    /// corrupt. `None`: no bound.
    pub max_value_bytes: Option<u64>,
}

/// The secret access key prints as `***`.
impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("url", &self.url)
            .field(
                "endpoint",
                &self.endpoint.as_deref().map(kvpool_core::redact_url),
            )
            .field("region", &self.region)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|(id, _)| (id, "***")),
            )
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("multipart_part_bytes", &self.multipart_part_bytes)
            .field("max_value_bytes", &self.max_value_bytes)
            .finish()
    }
}

impl S3Config {
    /// Defaults: 10 s timeout, 8 requests in flight, 8 MiB parts.
    pub fn new(url: impl Into<String>) -> Self {
        S3Config {
            url: url.into(),
            endpoint: None,
            region: None,
            credentials: None,
            timeout: Duration::from_secs(10),
            concurrency: 8,
            multipart_part_bytes: 8 << 20,
            max_value_bytes: None,
        }
    }
}

/// An S3 bucket (under a prefix) as a [`RemoteConnector`]: HEAD for exists, concurrent GETs
/// and PUTs within a batch, multipart uploads for large values.
#[derive(Clone)]
pub struct S3Connector {
    store: Arc<AmazonS3>,
    prefix: Path,
    concurrency: usize,
    part_bytes: usize,
    max_value_bytes: Option<u64>,
    closed: Arc<AtomicBool>,
}

fn unavailable(e: object_store::Error) -> BackendError {
    BackendError::Unavailable {
        backend: "s3".into(),
        reason: e.to_string(),
    }
}

impl S3Connector {
    /// Builds the client and lists the prefix once, so a missing bucket, bad credentials or an
    /// unreachable endpoint fail here with the server's answer.
    pub async fn connect(config: &S3Config) -> Result<Self, BackendError> {
        crate::tls::use_ring_for_tls();
        let fail = |what: &str, e: &dyn std::fmt::Display| BackendError::Unavailable {
            backend: "s3".into(),
            reason: format!("{what} `{}`: {e}", kvpool_core::redact_url(&config.url)),
        };
        let rest = config
            .url
            .strip_prefix("s3://")
            .ok_or_else(|| fail("not an s3:// URL", &"use s3://bucket/prefix"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(fail("no bucket in", &"use s3://bucket/prefix"));
        }
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(config.timeout)
                    .with_connect_timeout(config.timeout),
            )
            .with_retry(RetryConfig {
                max_retries: 1,
                retry_timeout: config.timeout,
                ..RetryConfig::default()
            });
        if let Some(endpoint) = &config.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        if let Some(region) = &config.region {
            builder = builder.with_region(region);
        }
        if let Some((key, secret)) = &config.credentials {
            builder = builder
                .with_access_key_id(key)
                .with_secret_access_key(secret);
        }
        let store = builder
            .build()
            .map_err(|e| fail("invalid S3 settings for", &e))?;
        let connector = S3Connector {
            store: Arc::new(store),
            prefix: Path::from(prefix.trim_matches('/')),
            concurrency: config.concurrency.max(1),
            part_bytes: config.multipart_part_bytes.max(5 << 20),
            max_value_bytes: config.max_value_bytes,
            closed: Arc::new(AtomicBool::new(false)),
        };
        // One list request (the first page, at most one key read): it proves the endpoint,
        // the credentials and the bucket. Listing everything under the prefix, as
        // `list_with_delimiter` does, grows with the bucket: a full one timed out here.
        let probe = tokio::time::timeout(config.timeout * 2, async {
            connector.store.list(Some(&connector.prefix)).next().await
        });
        match probe.await {
            Ok(None | Some(Ok(_))) => Ok(connector),
            Ok(Some(Err(e))) => Err(fail("cannot list", &e)),
            Err(_) => Err(BackendError::Timeout {
                backend: "s3".into(),
                op: "connect",
                millis: (config.timeout * 2).as_millis() as u64,
            }),
        }
    }

    fn path(&self, key: &str) -> Path {
        self.prefix.clone().join(key)
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("s3".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl RemoteConnector for S3Connector {
    fn name(&self) -> &str {
        "s3"
    }

    async fn exists(&self, key: &str) -> Result<bool, BackendError> {
        self.check()?;
        match self.store.head(&self.path(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, BackendError> {
        self.check()?;
        match self.store.get(&self.path(key)).await {
            Ok(r)
                if self
                    .max_value_bytes
                    .is_some_and(|limit| r.meta.size > limit) =>
            {
                // The body is never read: dropping the response closes the stream.
                warn!(
                    key,
                    bytes = r.meta.size,
                    "S3 object larger than any chunk; not read, rejected"
                );
                Ok(Some(Bytes::new()))
            }
            Ok(r) => Ok(Some(r.bytes().await.map_err(unavailable)?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn put(&self, key: &str, value: Bytes) -> Result<(), BackendError> {
        self.check()?;
        let path = self.path(key);
        if value.len() <= self.part_bytes {
            self.store
                .put(&path, PutPayload::from(value))
                .await
                .map_err(unavailable)?;
            return Ok(());
        }
        let upload = self.store.put_multipart(&path).await.map_err(unavailable)?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.part_bytes);
        writer.put(value);
        writer.finish().await.map_err(unavailable)?;
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<bool, BackendError> {
        // S3 DELETE does not say whether the object existed; ask first.
        let existed = self.exists(key).await?;
        if existed {
            self.store
                .delete(&self.path(key))
                .await
                .map_err(unavailable)?;
        }
        Ok(existed)
    }

    async fn close(&self) -> Result<(), BackendError> {
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        stream::iter(keys.to_vec())
            .map(|k| async move { self.exists(&k).await })
            .buffered(self.concurrency)
            .try_collect()
            .await
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        stream::iter(keys.to_vec())
            .map(|k| async move { self.get(&k).await })
            .buffered(self.concurrency)
            .try_collect()
            .await
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        stream::iter(entries)
            .map(|(k, v)| async move { self.put(&k, v).await })
            .buffer_unordered(self.concurrency)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let existed: Vec<bool> = stream::iter(keys.to_vec())
            .map(|k| async move { self.delete(&k).await })
            .buffered(self.concurrency)
            .try_collect()
            .await?;
        Ok(existed.into_iter().filter(|e| *e).count())
    }
}

/// The URL schemes the S3 tier opens.
pub const SCHEMES: &[&str] = &["s3"];

impl S3Connector {
    /// Connects to `s3://bucket/prefix` with its `[[tier]]` options: `endpoint`, `region`,
    /// `access_key_id` and `secret_access_key` (both or neither; else from the environment).
    pub async fn from_tier(tier: &TierRequest<'_>) -> Result<Self, ConfigError> {
        let mut config = S3Config::new(tier.url());
        let mut options = tier.options();
        config.endpoint = options.string("endpoint")?;
        config.region = options.string("region")?;
        match (
            options.string("access_key_id")?,
            options.string("secret_access_key")?,
        ) {
            (Some(id), Some(secret)) => config.credentials = Some((id, secret)),
            (None, None) => {}
            (Some(_), None) => {
                return Err(options.invalid(
                    "access_key_id",
                    "set secret_access_key too, or neither (the environment's are used then)",
                ));
            }
            (None, Some(_)) => {
                return Err(options.invalid(
                    "secret_access_key",
                    "set access_key_id too, or neither (the environment's are used then)",
                ));
            }
        }
        options.finish()?;
        config.timeout = tier.timeout();
        config.max_value_bytes = Some(max_stored_len(tier.max_chunk_bytes));
        S3Connector::connect(&config)
            .await
            .map_err(|e| ConfigError::Invalid {
                field: "tier.url",
                reason: e.to_string(),
            })
    }
}

/// Registers [`SCHEMES`] with the scheme registry.
pub struct S3Factory;

#[async_trait]
impl BackendFactory for S3Factory {
    fn example(&self) -> String {
        "url = \"s3://bucket/prefix\"  # endpoint = \"http://127.0.0.1:9000\", region = \"us-east-1\", access_key_id, secret_access_key (default: AWS_* environment)".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        Ok(Box::new(S3Connector::from_tier(tier).await?))
    }
}
