//! S3 tier against a real S3-compatible server (moto, started by `cargo xtask matrix`, which
//! sets KVPOOL_TEST_S3_URL, KVPOOL_TEST_S3_ENDPOINT and the AWS_* credentials).
#![cfg(feature = "s3")]

mod common;
mod servers;

use std::time::{Duration, Instant};

use common::remote_tier::{
    assert_outage_then_recovery, assert_passes_the_kit,
    assert_pool_opens_tier_and_rejects_a_bad_url,
};
use kvpool_backends::s3::{S3Config, S3Connector};
use servers::{free_port, server_url};

fn config(url: &str, endpoint: &str) -> S3Config {
    let mut c = S3Config::new(url);
    c.endpoint = Some(endpoint.to_string());
    c.region = Some("us-east-1".into());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn s3_passes_the_kit() {
    let (url, endpoint) = (
        server_url("KVPOOL_TEST_S3_URL"),
        server_url("KVPOOL_TEST_S3_ENDPOINT"),
    );
    assert_passes_the_kit("s3", || async {
        S3Connector::connect(&config(&url, &endpoint))
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn bad_configuration_fails_at_connect_with_a_clear_error() {
    let endpoint = server_url("KVPOOL_TEST_S3_ENDPOINT");
    let err = S3Connector::connect(&config("s3://no-such-bucket-kvpool/x", &endpoint))
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("no-such-bucket-kvpool"), "{err}");
    let mut unreachable = config("s3://b/x", &format!("http://127.0.0.1:{}", free_port()));
    unreachable.timeout = Duration::from_millis(500);
    let started = Instant::now();
    assert!(S3Connector::connect(&unreachable).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(15), "connect hung");
    assert!(
        S3Connector::connect(&S3Config::new("s3:///nobucket"))
            .await
            .is_err()
    );
    assert!(
        S3Connector::connect(&S3Config::new("http://not-s3"))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn killed_server_turns_into_misses_and_then_recovers() {
    let binary = server_url("KVPOOL_TEST_MOTO_SERVER");
    let port = free_port();
    let server = servers::moto(&binary, port, "fault");
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut cfg = config("s3://fault/kv", &endpoint);
    cfg.timeout = Duration::from_millis(1000);
    let s3 = S3Connector::connect(&cfg).await.unwrap();
    // moto keeps everything in memory: the restarted server is empty, with the bucket re-made.
    let _server = assert_outage_then_recovery(
        s3,
        "s3-fault",
        || server.kill(),
        Duration::from_secs(30),
        || servers::moto(&binary, port, "fault"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn pool_config_selects_s3_by_url_and_fails_fast_on_a_missing_bucket() {
    let (url, endpoint) = (
        server_url("KVPOOL_TEST_S3_URL"),
        server_url("KVPOOL_TEST_S3_ENDPOINT"),
    );
    let tier = kvpool_core::TierConfig::new(url)
        .with_option("endpoint", endpoint)
        .with_option("region", "us-east-1")
        .with_option("access_key_id", "from-config")
        .with_option("secret_access_key", "from-config");
    assert_pool_opens_tier_and_rejects_a_bad_url(
        tier,
        "s3",
        "s3://kvpool-no-such-bucket/x".into(),
        "kvpool-no-such-bucket",
    )
    .await;
}

/// An object larger than any chunk is never downloaded (its size is in the response head).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn an_oversized_object_is_not_read_and_is_a_miss() {
    let (url, endpoint) = (
        server_url("KVPOOL_TEST_S3_URL"),
        server_url("KVPOOL_TEST_S3_ENDPOINT"),
    );
    let raw = S3Connector::connect(&config(&url, &endpoint))
        .await
        .unwrap();
    let mut limited = config(&url, &endpoint);
    limited.max_value_bytes = Some(1 << 20);
    let bounded = S3Connector::connect(&limited).await.unwrap();
    common::assert_oversized_values_are_not_read(raw, bounded).await;
}
