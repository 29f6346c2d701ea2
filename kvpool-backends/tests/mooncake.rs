//! Mooncake Store tier against a real `mooncake_master` and a separate segment-holder process:
//! the conformance kit, tier URLs and Mooncake's JSON config, bad configuration, and the master
//! killed and restarted under load. `cargo xtask matrix` installs the wheel and sets
//! KVPOOL_TEST_MOONCAKE_VENV; without it these tests skip.
#![cfg(feature = "mooncake")]

mod common;
mod servers;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::remote_tier::{assert_outage_then_recovery, assert_passes_the_kit};
use common::{StoredPrompt, engine_over, small_layout, store_prompt};
use kvpool_backends::mooncake::{MooncakeConfig, MooncakeConnector};
use kvpool_backends::registry::open_tier;
use kvpool_core::{ChunkCodec, RemoteConnector, TierConfig};
use servers::{MooncakeCluster, free_port, server_url};

/// The venv with Mooncake's wheel (`KVPOOL_TEST_MOONCAKE_VENV`, a virtualenv with
/// `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` and Debian's libibverbs1;
/// `cargo xtask matrix` sets one up and runs these tests).
fn venv() -> String {
    server_url("KVPOOL_TEST_MOONCAKE_VENV")
}

fn config_for(cluster: &MooncakeCluster) -> MooncakeConfig {
    MooncakeConfig {
        master_server_address: cluster.master_address(),
        python_path: vec![cluster.site_packages().unwrap()],
        staging_bytes: 160 << 20,
        ..MooncakeConfig::default()
    }
}

const SEGMENT_BYTES: u64 = 768 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn mooncake_passes_the_kit() {
    let venv = venv();
    let cluster = MooncakeCluster::start(std::path::Path::new(&venv), SEGMENT_BYTES, None).unwrap();
    let config = config_for(&cluster);
    assert_passes_the_kit("mooncake", || {
        let config = config.clone();
        async move { MooncakeConnector::connect(&config).await.unwrap() }
    })
    .await;
}

/// Bytes written by this process are read back from the holder's segment, byte for byte, and
/// batches larger than the staging arena go through in rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn batches_larger_than_staging_round_trip_exactly() {
    let venv = venv();
    let cluster = MooncakeCluster::start(std::path::Path::new(&venv), SEGMENT_BYTES, None).unwrap();
    let config = MooncakeConfig {
        staging_bytes: 8 << 20,
        ..config_for(&cluster)
    };
    let c = MooncakeConnector::connect(&config).await.unwrap();
    // 24 values of 1 MiB (3x the staging arena), sizes differing so a stale size hint shows.
    let entries: Vec<(String, Bytes)> = (0..24u32)
        .map(|i| {
            let len = (1 << 20) - i as usize * 4096;
            let bytes: Vec<u8> = (0..len)
                .map(|j| (j as u32).wrapping_mul(2_654_435_761).wrapping_add(i) as u8)
                .collect();
            (
                format!("kvpool-rounds-{}-{i}", std::process::id()),
                Bytes::from(bytes),
            )
        })
        .collect();
    c.batch_put(entries.clone()).await.unwrap();
    let mut keys: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
    keys.push("kvpool-never-stored".into());
    let got = c.batch_get(&keys).await.unwrap();
    for ((key, want), got) in entries.iter().zip(&got) {
        assert_eq!(got.as_deref(), Some(&want[..]), "{key}");
    }
    assert!(got[24].is_none());
    // A larger value than any before: the size hint is too small and the exact size is used.
    let big = Bytes::from(vec![0xA5u8; 3 << 20]);
    c.put("kvpool-rounds-big", big.clone()).await.unwrap();
    assert_eq!(c.get("kvpool-rounds-big").await.unwrap(), Some(big));
    assert_eq!(c.batch_delete(&keys).await.unwrap(), 24);
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn opens_from_a_tier_url_or_mooncake_json() {
    let venv = venv();
    let cluster = MooncakeCluster::start(std::path::Path::new(&venv), SEGMENT_BYTES, None).unwrap();
    let site = cluster.site_packages().unwrap().display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("mooncake.json");
    std::fs::write(
        &json,
        format!(
            r#"{{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "{}", "protocol": "tcp", "device_name": "",
                "global_segment_size": 0, "local_buffer_size": "16mb"}}"#,
            cluster.master_address()
        ),
    )
    .unwrap();
    let urls = [
        format!(
            "mooncakestore://{}?protocol=tcp&python_path={site}",
            cluster.master_address()
        ),
        format!(
            "mooncakestore://?config={}&python_path={site}",
            json.display()
        ),
    ];
    for url in urls {
        let tier = open_tier(
            &TierConfig::new(url.clone()),
            ChunkCodec::default(),
            1 << 20,
        )
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
        let engine = engine_over(tier, "mooncake-url");
        let StoredPrompt { tokens, slots, kv } = store_prompt(&engine, 64, 7).await;
        let mut dst = kvpool_core::HostPagedKvCache::new(small_layout(), 32);
        let mask = engine
            .retrieve(&tokens, None, &mut dst, &slots)
            .await
            .unwrap();
        assert!(mask.iter().all(|m| *m), "{url}");
        common::assert_rows_equal(&kv, &slots, &dst, &slots, &mask);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn bad_configuration_is_a_clear_error() {
    let venv = venv();
    let site = MooncakeCluster::site_packages_of(std::path::Path::new(&venv)).unwrap();
    // Nothing listens on this port: setup fails, bounded by the connect timeout.
    let config = MooncakeConfig {
        master_server_address: format!("127.0.0.1:{}", free_port()),
        python_path: vec![site],
        connect_timeout: Duration::from_secs(5),
        ..MooncakeConfig::default()
    };
    let started = Instant::now();
    let err = MooncakeConnector::connect(&config).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(6));
    let text = err.to_string();
    assert!(
        text.contains("mooncake_master") || text.contains("timed out"),
        "{text}"
    );
    for (url, needle) in [
        ("mooncakestore://", "no Mooncake master"),
        ("mooncakestore://10.0.0.1", "needs a port"),
        ("mooncakestore://h:1?protocol=rdma", "needs device_name"),
        (
            "mooncakestore://h:1?protocol=carrier-pigeon",
            "supports tcp and rdma",
        ),
        ("mooncakestore://h:1?colour=blue", "unknown mooncake option"),
        ("mooncakestore://h:1?replica_num=0", "replica_num"),
    ] {
        let err = open_tier(&TierConfig::new(url), ChunkCodec::default(), 1 << 20)
            .await
            .err()
            .unwrap_or_else(|| panic!("{url} was accepted"));
        assert!(err.to_string().contains(needle), "{url}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs its server: `cargo xtask matrix` starts it and runs this test"]
async fn killed_master_turns_into_misses_and_dropped_writes_then_recovers() {
    let venv = venv();
    let cluster = std::cell::RefCell::new(
        MooncakeCluster::start(std::path::Path::new(&venv), SEGMENT_BYTES, None).unwrap(),
    );
    let config = config_for(&cluster.borrow());
    let mooncake = MooncakeConnector::connect(&config).await.unwrap();
    let bounded = kvpool_backends::TimeoutConnector::new(mooncake, Duration::from_millis(1500));
    // A restarted master starts empty; the holder remounts its segment and writes work again.
    assert_outage_then_recovery(
        bounded,
        "mooncake-fault",
        || cluster.borrow_mut().kill_master(),
        Duration::from_secs(30),
        || cluster.borrow_mut().start_master().unwrap(),
    )
    .await;
}
