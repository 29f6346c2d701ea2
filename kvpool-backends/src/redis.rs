//! `redis://`, `rediss://` (TLS) and `redis+cluster://`: Redis as a remote tier.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::try_join_all;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, Pipeline, RedisError};
use tracing::warn;

use kvpool_core::format::chunk_format::max_stored_len;
use kvpool_core::{BackendError, ConfigError, RemoteConnector};

use crate::backend_factory::{BackendFactory, TierRequest};

/// Settings of a Redis tier. Its `Debug` output hides the URL's password.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://[user:pass@]host:port[/db]`, `rediss://…` for TLS (append `#insecure` to accept
    /// a self-signed certificate; a private CA is trusted through `SSL_CERT_FILE`, which
    /// rustls-native-certs reads with the system's store),
    /// or `redis+cluster://[user:pass@]h1:p1,h2:p2,…` (`rediss+cluster://` for TLS).
    pub url: String,
    /// Expire stored chunks after this long (none by default).
    pub ttl: Option<Duration>,
    /// Bound on connecting and on every command.
    pub timeout: Duration,
    /// Largest value a read accepts: a longer one is never transferred (its length is asked
    /// first, in the same pipeline) and comes back as an empty value, which the chunk format
    /// rejects as corrupt. `None`: no bound.
    pub max_value_bytes: Option<u64>,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact(&self.url))
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .field("max_value_bytes", &self.max_value_bytes)
            .finish()
    }
}

impl RedisConfig {
    /// Defaults: no TTL, 2 s timeout.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            ttl: None,
            timeout: Duration::from_secs(2),
            max_value_bytes: None,
        }
    }
}

#[derive(Clone)]
enum Connection {
    /// One server, through a manager that reconnects after failures.
    Single(ConnectionManager),
    /// A cluster; commands are routed by key slot.
    Cluster(ClusterConnection),
}

/// A Redis (standalone or cluster) [`RemoteConnector`]. Batches are pipelined on a standalone
/// server; on a cluster each key is its own command, sent concurrently, since a pipeline must
/// stay within one slot.
#[derive(Clone)]
pub struct RedisConnector {
    connection: Connection,
    ttl_ms: Option<u64>,
    timeout: Duration,
    max_value_bytes: Option<u64>,
    closed: Arc<AtomicBool>,
}

fn unavailable(e: RedisError) -> BackendError {
    BackendError::Unavailable {
        backend: "redis".into(),
        reason: e.to_string(),
    }
}

/// Splits `redis+cluster://[auth@]h1:p1,h2:p2` into one `redis://[auth@]h:p` URL per node.
fn cluster_nodes(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = if let Some(r) = url.strip_prefix("redis+cluster://") {
        ("redis", r)
    } else if let Some(r) = url.strip_prefix("rediss+cluster://") {
        ("rediss", r)
    } else {
        return None;
    };
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((a, h)) => (format!("{a}@"), h),
        None => (String::new(), rest),
    };
    let (hosts, fragment) = match hosts.split_once('#') {
        Some((h, f)) => (h, format!("#{f}")),
        None => (hosts, String::new()),
    };
    Some(
        hosts
            .trim_end_matches('/')
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("{scheme}://{auth}{h}{fragment}"))
            .collect(),
    )
}

/// Why [`RedisConnector::connect_checked`] did not connect.
#[derive(Debug)]
pub enum ConnectFailure {
    /// No server answered (refused, timed out, dropped): the tier is down, not misconfigured.
    Unreachable(BackendError),
    /// A server answered and refused (a wrong password, a bad URL, an unexpected reply).
    Refused(BackendError),
}

impl ConnectFailure {
    /// The error, whichever kind.
    pub fn into_error(self) -> BackendError {
        match self {
            ConnectFailure::Unreachable(e) | ConnectFailure::Refused(e) => e,
        }
    }
}

/// Whether `e` means no server answered (rather than one that answered and refused).
fn no_answer(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped()
}

impl RedisConnector {
    /// Connects and checks the server answers (so a wrong address or password fails here, at
    /// pool build time, with the server's own message).
    pub async fn connect(config: &RedisConfig) -> Result<Self, BackendError> {
        Self::connect_checked(config)
            .await
            .map_err(ConnectFailure::into_error)
    }

    /// [`connect`](Self::connect), telling a server that did not answer from one that
    /// answered and refused.
    pub async fn connect_checked(config: &RedisConfig) -> Result<Self, ConnectFailure> {
        crate::tls::use_ring_for_tls();
        let t = config.timeout;
        let error = |what: &str, e: &dyn std::fmt::Display| BackendError::Unavailable {
            backend: "redis".into(),
            reason: format!("{what} `{}`: {e}", redact(&config.url)),
        };
        let fail = |what: &str, e: &dyn std::fmt::Display| ConnectFailure::Refused(error(what, e));
        let redis_fail = |what: &str, e: &RedisError| {
            if no_answer(e) {
                ConnectFailure::Unreachable(error(what, e))
            } else {
                ConnectFailure::Refused(error(what, e))
            }
        };
        let timed_out = || {
            ConnectFailure::Unreachable(BackendError::Timeout {
                backend: "redis".into(),
                op: "connect",
                millis: t.as_millis() as u64,
            })
        };
        let connection = if let Some(nodes) = cluster_nodes(&config.url) {
            if nodes.is_empty() {
                return Err(fail(
                    "no cluster nodes in",
                    &"expected redis+cluster://h1:p1,h2:p2",
                ));
            }
            let client = ClusterClientBuilder::new(nodes)
                .connection_timeout(t)
                .response_timeout(t)
                .build()
                .map_err(|e| fail("invalid cluster URL", &e))?;
            let conn = tokio::time::timeout(t, client.get_async_connection())
                .await
                .map_err(|_| timed_out())?
                .map_err(|e| redis_fail("cannot connect to cluster", &e))?;
            Connection::Cluster(conn)
        } else {
            let client = redis::Client::open(config.url.as_str())
                .map_err(|e| fail("invalid Redis URL", &e))?;
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(t))
                .set_response_timeout(Some(t))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let manager = tokio::time::timeout(
                2 * t,
                client.get_connection_manager_with_config(manager_config),
            )
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| redis_fail("cannot connect to", &e))?;
            Connection::Single(manager)
        };
        let connector = RedisConnector {
            connection,
            ttl_ms: config.ttl.map(|d| d.as_millis().max(1) as u64),
            timeout: t,
            max_value_bytes: config.max_value_bytes,
            closed: Arc::new(AtomicBool::new(false)),
        };
        let pong: String = connector.command(redis::cmd("PING")).await.map_err(|e| {
            // A server refusing us (a wrong password, no permission) is a configuration
            // error; any other failed PING (loading its dataset, a reset, a timeout, a
            // cluster down) is a server not ready yet.
            let text = e.to_string().to_ascii_uppercase();
            if [
                "NOAUTH",
                "WRONGPASS",
                "INVALID PASSWORD",
                "NOPERM",
                "AUTHENTICATION",
            ]
            .iter()
            .any(|w| text.contains(w))
            {
                fail("no answer to PING from", &e)
            } else {
                ConnectFailure::Unreachable(error("no answer to PING from", &e))
            }
        })?;
        if pong != "PONG" {
            return Err(fail("unexpected PING reply from", &pong));
        }
        Ok(connector)
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed("redis".into()));
        }
        Ok(())
    }

    async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, BackendError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(unavailable),
            Err(_) => Err({
                metrics::counter!(kvpool_core::telemetry::TIMEOUTS, "tier" => "redis".to_string())
                    .increment(1);
                BackendError::Timeout {
                    backend: "redis".into(),
                    op,
                    millis: self.timeout.as_millis() as u64,
                }
            }),
        }
    }

    async fn command<T: FromRedisValue>(&self, cmd: Cmd) -> Result<T, BackendError> {
        self.check()?;
        match self.connection.clone() {
            Connection::Single(mut c) => self.bounded("command", cmd.query_async(&mut c)).await,
            Connection::Cluster(mut c) => self.bounded("command", cmd.query_async(&mut c)).await,
        }
    }

    /// Runs one command per key: pipelined on a standalone server, concurrent on a cluster.
    async fn per_key<T: FromRedisValue + Send>(
        &self,
        cmds: Vec<Cmd>,
    ) -> Result<Vec<T>, BackendError> {
        self.check()?;
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        match self.connection.clone() {
            Connection::Single(mut c) => {
                let mut pipe = Pipeline::with_capacity(cmds.len());
                for cmd in cmds {
                    pipe.add_command(cmd);
                }
                self.bounded("pipeline", pipe.query_async(&mut c)).await
            }
            Connection::Cluster(c) => {
                let calls = cmds.into_iter().map(|cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<T>(&mut c).await }
                });
                self.bounded("cluster batch", try_join_all(calls)).await
            }
        }
    }
}

use kvpool_core::redact_url as redact;

#[async_trait]
impl RemoteConnector for RedisConnector {
    fn name(&self) -> &str {
        "redis"
    }

    async fn close(&self) -> Result<(), BackendError> {
        self.closed.store(true, Ordering::Release);
        Ok(())
    }

    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        let cmds = keys
            .iter()
            .map(|k| redis::cmd("EXISTS").arg(k).clone())
            .collect();
        let counts: Vec<i64> = self.per_key(cmds).await?;
        Ok(counts.into_iter().map(|n| n > 0).collect())
    }

    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        let Some(limit) = self.max_value_bytes else {
            let cmds = keys
                .iter()
                .map(|k| redis::cmd("GET").arg(k).clone())
                .collect();
            let values: Vec<Option<Vec<u8>>> = self.per_key(cmds).await?;
            return Ok(values.into_iter().map(|v| v.map(Bytes::from)).collect());
        };
        // Per key, in one round trip: its length, and at most `limit` bytes of it.
        let last = limit.saturating_sub(1).min(i64::MAX as u64) as i64;
        let cmds = keys
            .iter()
            .flat_map(|k| {
                [
                    redis::cmd("STRLEN").arg(k).clone(),
                    redis::cmd("GETRANGE").arg(k).arg(0).arg(last).clone(),
                ]
            })
            .collect();
        let mut values = self.per_key::<redis::Value>(cmds).await?.into_iter();
        let mut replies: Vec<(u64, Vec<u8>)> = Vec::with_capacity(keys.len());
        while let (Some(len), Some(bytes)) = (values.next(), values.next()) {
            replies.push((
                redis::from_redis_value::<u64>(len).unwrap_or(0),
                redis::from_redis_value::<Vec<u8>>(bytes).unwrap_or_default(),
            ));
        }
        Ok(keys
            .iter()
            .zip(replies)
            .map(|(key, (len, bytes))| match len {
                0 => None,
                n if n > limit => {
                    warn!(key = %key, bytes = n, limit, "redis value larger than any chunk; not read, rejected");
                    Some(Bytes::new())
                }
                _ => Some(Bytes::from(bytes)),
            })
            .collect())
    }

    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        let cmds = entries
            .iter()
            .map(|(k, v)| {
                let mut cmd = redis::cmd("SET");
                cmd.arg(k).arg(v.as_ref());
                if let Some(ms) = self.ttl_ms {
                    cmd.arg("PX").arg(ms);
                }
                cmd
            })
            .collect();
        let _: Vec<redis::Value> = self.per_key(cmds).await?;
        Ok(())
    }

    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        let cmds = keys
            .iter()
            .map(|k| redis::cmd("DEL").arg(k).clone())
            .collect();
        let counts: Vec<i64> = self.per_key(cmds).await?;
        Ok(counts.into_iter().filter(|n| *n > 0).count())
    }
}

/// The URL schemes the Redis tier opens.
pub const SCHEMES: &[&str] = &["redis", "rediss", "redis+cluster", "rediss+cluster"];

impl RedisConnector {
    /// Connects to the tier's URL with its `[[tier]]` options: `ttl_seconds`.
    pub async fn from_tier(tier: &TierRequest<'_>) -> Result<Self, ConfigError> {
        let mut config = RedisConfig::new(tier.url());
        let mut options = tier.options();
        config.ttl = options.u64("ttl_seconds")?.map(Duration::from_secs);
        options.finish()?;
        config.timeout = tier.timeout();
        config.max_value_bytes = Some(max_stored_len(tier.max_chunk_bytes));
        // Options are checked above: a server that does not answer now is a tier down (the
        // pool opens without it), one that refuses is a configuration error.
        RedisConnector::connect_checked(&config)
            .await
            .map_err(|failure| match failure {
                ConnectFailure::Unreachable(e) => ConfigError::Unreachable {
                    tier: redact(tier.url()),
                    reason: e.to_string(),
                },
                ConnectFailure::Refused(e) => ConfigError::Invalid {
                    field: "tier.url",
                    reason: e.to_string(),
                },
            })
    }
}

/// Registers [`SCHEMES`] with the scheme registry.
pub struct RedisFactory;

#[async_trait]
impl BackendFactory for RedisFactory {
    fn example(&self) -> String {
        "url = \"redis://[user:password@]127.0.0.1:6379[/db]\"  # or rediss:// (TLS), redis+cluster://h1:p1,h2:p2; ttl_seconds = 3600".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        Ok(Box::new(RedisConnector::from_tier(tier).await?))
    }

    fn name_before_open(&self, _scheme: &str) -> String {
        "redis".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_split_into_node_urls_keeping_auth_and_tls() {
        assert_eq!(
            cluster_nodes("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap(),
            ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
        );
        assert_eq!(
            cluster_nodes("rediss+cluster://u:p@h1:1,h2:2#insecure").unwrap(),
            ["rediss://u:p@h1:1#insecure", "rediss://u:p@h2:2#insecure"]
        );
        assert!(cluster_nodes("redis://h:1").is_none());
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://user:secret@h:6379"), "redis://***@h:6379");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }
}
