//! Redis tier against real servers: standalone (with AUTH), cluster, TLS, TTL, bad
//! configuration, and a server killed and restarted under load. Servers come from
//! `cargo xtask matrix`, which sets the KVPOOL_TEST_REDIS_* variables.
#![cfg(feature = "redis")]

mod common;
mod servers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::remote_tier::{
    assert_outage_then_recovery, assert_passes_the_kit,
    assert_pool_opens_tier_and_rejects_a_bad_url,
};
use common::{StoredPrompt, engine_over, recovers, small_layout, store_prompt};
use kvpool_backends::redis::{RedisConfig, RedisConnector};
use kvpool_core::{ChunkCodec, RemoteBackend, RemoteConnector};
use servers::{free_port, server_url};

async fn kit(name: &str, url: &str) {
    assert_passes_the_kit(name, || async {
        RedisConnector::connect(&RedisConfig::new(url))
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn standalone_passes_the_kit() {
    let url = server_url("KVPOOL_TEST_REDIS_URL");
    kit("redis", &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn cluster_passes_the_kit() {
    let url = server_url("KVPOOL_TEST_REDIS_CLUSTER_URL");
    kit("redis-cluster", &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn tls_passes_the_kit() {
    let url = server_url("KVPOOL_TEST_REDIS_TLS_URL");
    kit("redis-tls", &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn ttl_expires_chunks() {
    let url = server_url("KVPOOL_TEST_REDIS_URL");
    let mut config = RedisConfig::new(url);
    config.ttl = Some(Duration::from_millis(300));
    let c = RedisConnector::connect(&config).await.unwrap();
    let key = format!("kvpool-ttl-test-{}", std::process::id());
    c.put(&key, Bytes::from_static(b"v")).await.unwrap();
    assert!(c.exists(&key).await.unwrap());
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!c.exists(&key).await.unwrap(), "expired after its TTL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn bad_configuration_fails_at_connect_with_a_clear_error() {
    let url = server_url("KVPOOL_TEST_REDIS_URL");
    // Wrong password on the real (password-protected) server.
    let wrong = match url.rfind('@') {
        Some(at) => format!("redis://:wrong-password@{}", &url[at + 1..]),
        None => panic!("the matrix's standalone server requires a password"),
    };
    let err = RedisConnector::connect(&RedisConfig::new(wrong.clone()))
        .await
        .err()
        .expect("wrong password rejected");
    let msg = err.to_string();
    assert!(msg.to_lowercase().contains("auth"), "{msg}");
    assert!(
        !msg.contains("wrong-password"),
        "password leaked into the error: {msg}"
    );
    // Nothing listening.
    let mut config = RedisConfig::new(format!("redis://127.0.0.1:{}", free_port()));
    config.timeout = Duration::from_millis(500);
    let started = Instant::now();
    let err = RedisConnector::connect(&config)
        .await
        .err()
        .expect("unreachable server rejected");
    assert!(started.elapsed() < Duration::from_secs(10), "connect hung");
    assert!(err.to_string().contains("127.0.0.1"), "{err}");
    // Not a URL at all.
    assert!(
        RedisConnector::connect(&RedisConfig::new("redis://:bad:port:x"))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn killed_server_turns_into_misses_dropped_writes_and_then_recovers() {
    let binary = server_url("KVPOOL_TEST_REDIS_SERVER");
    let port = free_port();
    let server = servers::redis(&binary, port);
    let mut config = RedisConfig::new(format!("redis://127.0.0.1:{port}"));
    config.timeout = Duration::from_millis(500);
    let redis = RedisConnector::connect(&config).await.unwrap();
    // Restarted on the same port, the server is reached again without rebuilding anything.
    let _server = assert_outage_then_recovery(
        redis,
        "redis-fault",
        || server.kill(),
        Duration::from_secs(20),
        || servers::redis(&binary, port),
    )
    .await;
}

/// Redis down when the pool is built: the pool opens anyway (the tier is a miss, its writes
/// dropped), and once a server answers on that address the tier is used, without rebuilding
/// anything. Before, `build_pool` failed and so did the engine's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn a_server_down_at_start_up_is_a_miss_and_is_used_once_it_answers() {
    let binary = server_url("KVPOOL_TEST_REDIS_SERVER");
    let port = free_port();
    let mut config = kvpool_core::PoolConfig::default();
    config.local_cpu.enabled = false;
    config.layout = small_layout();
    config.chunking.chunk_size = 16;
    let mut tier = kvpool_core::TierConfig::new(format!("redis://127.0.0.1:{port}"));
    tier.timeout_ms = 300;
    config.tiers.push(tier);
    let pool = kvpool_backends::build_pool(&config)
        .await
        .expect("a tier down at start-up is not a failed start");
    let engine = pool.engine.clone();
    assert_eq!(engine.storage().tier_names(), ["redis"]);
    let layout = small_layout();
    let tokens: Vec<u32> = (0..64).collect();
    let slots: Vec<i64> = (0..64).collect();
    let kv = common::filled_cache(layout, 32, 3);
    engine.store(&tokens, None, &kv, &slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    assert_eq!(engine.lookup(&tokens).await.unwrap(), 0, "down: a miss");
    let _server = servers::redis(&binary, port);
    assert!(
        recovers(&engine, &tokens, &kv, &slots).await,
        "the tier is used once the server answers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn pool_config_selects_redis_by_url_and_fails_fast_on_a_bad_one() {
    let url = server_url("KVPOOL_TEST_REDIS_URL");
    let at = url.rfind('@').unwrap();
    let wrong_password = format!("redis://:nope@{}", &url[at + 1..]);
    assert_pool_opens_tier_and_rejects_a_bad_url(
        kvpool_core::TierConfig::new(url.clone()),
        "redis",
        wrong_password,
        "auth",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn killed_cluster_node_turns_into_misses_and_then_recovers() {
    let (binary, cli) = (
        server_url("KVPOOL_TEST_REDIS_SERVER"),
        server_url("KVPOOL_TEST_REDIS_CLI"),
    );
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = servers::RedisCluster::start(&binary, &cli, dir.path()).unwrap();
    let layout = small_layout();
    let mut config = RedisConfig::new(cluster.url());
    config.timeout = Duration::from_millis(1000);
    let redis = RedisConnector::connect(&config).await.unwrap();
    let engine = engine_over(
        Arc::new(RemoteBackend::new(redis, ChunkCodec::default(), 64 << 20)),
        "redis-cluster-fault",
    );
    // 16 chunks: with 3 nodes, every node holds some of them.
    let StoredPrompt { tokens, slots, kv } = store_prompt(&engine, 256, 1).await;

    cluster.kill_node(1);
    let started = Instant::now();
    assert!(
        engine.lookup(&tokens).await.unwrap() < 256,
        "chunks on the dead node are misses"
    );
    let mut dst = kvpool_core::HostPagedKvCache::new(layout, 64);
    let mask = engine
        .retrieve(&tokens, None, &mut dst, &slots)
        .await
        .unwrap();
    assert!(mask.iter().filter(|m| **m).count() < 256);
    engine.store(&tokens, None, &kv, &slots).await.unwrap();
    engine.storage().flush().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "calls must time out, not hang"
    );

    cluster.restart_node(1).unwrap();
    cluster.wait_ok(&cli).unwrap();
    assert!(
        recovers(&engine, &tokens, &kv, &slots).await,
        "no recovery after the node came back"
    );
}

/// A value larger than any chunk is never transferred: its length is asked in the same
/// pipeline, and only then at most the bound is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn an_oversized_value_is_not_read_and_is_a_miss() {
    let url = server_url("KVPOOL_TEST_REDIS_URL");
    let raw = RedisConnector::connect(&RedisConfig::new(&url))
        .await
        .unwrap();
    let mut limited = RedisConfig::new(&url);
    limited.max_value_bytes = Some(1 << 20);
    let bounded = RedisConnector::connect(&limited).await.unwrap();
    common::assert_oversized_values_are_not_read(raw, bounded).await;
}
