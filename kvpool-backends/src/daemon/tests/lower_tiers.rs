//! The daemon over its lower tiers: values written behind and read back after a restart,
//! no daemon as a lower tier, and a bad copy (shared memory's or a tier's) costing that copy
//! only.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_go_to_the_lower_tier_and_come_back_after_a_daemon_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let disk: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let run = start(&path, 16 * MIB, vec![disk.clone()]);
    let engine = client(&path);
    let (k, v) = chunk_value(4, &[4u8; 64 << 10]);
    engine
        .batch_put(vec![(k.clone(), v.clone())])
        .await
        .unwrap();
    for _ in 0..500 {
        if disk.exists(&k).await.unwrap() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        disk.exists(&k).await.unwrap(),
        "write-behind never reached the tier"
    );

    // The daemon dies: the engine's calls fail (misses), nothing panics.
    run.server.shutdown();
    drop(run.daemon);
    assert!(engine.batch_get(std::slice::from_ref(&k)).await.is_err());
    assert!(!path.exists(), "shutdown removes the socket");

    // A new daemon over the same lower tier: the engine attaches again by itself.
    let run = start(&path, 16 * MIB, vec![disk.clone()]);
    tokio::time::sleep(RECONNECT_INTERVAL + Duration::from_millis(100)).await;
    let got = engine.batch_get(std::slice::from_ref(&k)).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&v[..]));
    let stats = run.daemon.stats();
    assert_eq!(
        (stats.tier_hits, stats.memory_hits, stats.entries),
        (1, 0, 1),
        "promoted into memory, counted once"
    );
}

#[test]
fn a_daemon_refuses_another_daemon_as_its_lower_tier() {
    let mut config = kvpool_core::PoolConfig::default();
    config.tiers.push(kvpool_core::TierConfig::new(
        "kvpool+unix:///run/kvpool/kvpool.sock",
    ));
    let err = DaemonOptions::from_config(&config).err().unwrap();
    assert!(err.to_string().contains("is a pool daemon"), "{err}");
    config.tiers[0] = kvpool_core::TierConfig::new("memory://");
    assert!(DaemonOptions::from_config(&config).is_ok());
}

/// An engine that found shared memory's copy bad deletes it: only that copy goes. Before,
/// the daemon's `Delete` also removed the value from every lower tier, so a stray write or a
/// late DMA into the arena cost the durable copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_delete_drops_shared_memorys_copy_and_the_lower_tier_keeps_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let disk: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let run = start(&path, 16 * MIB, vec![disk.clone()]);
    let engine = client(&path);
    let (key, bytes) = chunk_value(1, &[5u8; 4096]);
    engine
        .batch_put(vec![(key.clone(), bytes.clone())])
        .await
        .unwrap();
    for _ in 0..500 {
        if disk.exists(&key).await.unwrap() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(disk.exists(&key).await.unwrap());
    assert_eq!(
        engine
            .batch_delete(std::slice::from_ref(&key))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        run.daemon.stats().entries,
        0,
        "shared memory's copy is gone"
    );
    assert!(
        disk.exists(&key).await.unwrap(),
        "the lower tier keeps its copy"
    );
    // The next read promotes the lower tier's (good) copy again.
    let got = engine.batch_get(std::slice::from_ref(&key)).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&bytes[..]));
}

/// A lower tier's value that fails its check (a flipped byte on disk) is a miss, is not
/// promoted, and is deleted from that tier only; a good value beside it is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_lower_tier_copy_is_a_miss_and_is_deleted_from_that_tier_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let first: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let second: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let (good_key, good) = chunk_value(2, &[6u8; 4096]);
    let (bad_key, bad) = chunk_value(3, &[7u8; 4096]);
    let mut flipped = bad.to_vec();
    *flipped.last_mut().unwrap() ^= 0x10;
    first
        .batch_put(vec![
            (good_key.clone(), good.clone()),
            (bad_key.clone(), Bytes::from(flipped)),
        ])
        .await
        .unwrap();
    second
        .batch_put(vec![(bad_key.clone(), bad.clone())])
        .await
        .unwrap();
    let run = start(&path, 16 * MIB, vec![first.clone(), second.clone()]);
    let engine = client(&path);
    let got = engine
        .batch_get(&[good_key.clone(), bad_key.clone()])
        .await
        .unwrap();
    assert_eq!(got[0].as_deref(), Some(&good[..]));
    // The first tier's copy failed: the second tier's good copy is what the engine gets.
    assert_eq!(got[1].as_deref(), Some(&bad[..]));
    assert!(
        !first.exists(&bad_key).await.unwrap(),
        "the bad copy is deleted"
    );
    assert!(
        second.exists(&bad_key).await.unwrap(),
        "the good copy stays"
    );
    assert!(first.exists(&good_key).await.unwrap());
    assert_eq!(run.daemon.stats().entries, 2);
}
