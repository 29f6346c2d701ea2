//! The daemon's writes to its lower tiers: a tier set apart (a disk tier under
//! `[write_behind] low_priority`) written on the low-priority threads, the others on the
//! daemon's runtime, and `close` waiting for both; each tier's quota its own.

use std::sync::Mutex;

use async_trait::async_trait;
use kvpool_core::BackendError;

use super::*;
use crate::background::{BACKGROUND_NICE, background_runtime, this_threads_nice};

/// Process memory whose writes take a while (300 ms, and each waits for a permit of `gate`)
/// and record the nice value of their thread.
#[derive(Clone)]
struct SlowRecordingTier {
    store: InMemoryConnector,
    put_nices: Arc<Mutex<Vec<Option<i32>>>>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Default for SlowRecordingTier {
    fn default() -> Self {
        SlowRecordingTier::gated(tokio::sync::Semaphore::MAX_PERMITS)
    }
}

impl SlowRecordingTier {
    /// A tier whose first `writes` writes may start; later ones wait for `gate` permits.
    fn gated(writes: usize) -> Self {
        SlowRecordingTier {
            store: InMemoryConnector::default(),
            put_nices: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(writes)),
        }
    }
}

#[async_trait]
impl RemoteConnector for SlowRecordingTier {
    fn name(&self) -> &str {
        "slow-recording"
    }
    async fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.store.batch_exists(keys).await
    }
    async fn batch_get(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.store.batch_get(keys).await
    }
    async fn batch_put(&self, entries: Vec<(String, Bytes)>) -> Result<(), BackendError> {
        self.put_nices.lock().unwrap().push(this_threads_nice());
        self.gate.acquire().await.unwrap().forget();
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.store.batch_put(entries).await
    }
    async fn batch_delete(&self, keys: &[String]) -> Result<usize, BackendError> {
        self.store.batch_delete(keys).await
    }
    async fn close(&self) -> Result<(), BackendError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_set_apart_is_written_at_the_lowest_priority_and_close_waits_for_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let (disk, redis) = (SlowRecordingTier::default(), SlowRecordingTier::default());
    let tiers: Vec<Arc<dyn RemoteConnector>> =
        vec![Arc::new(disk.clone()), Arc::new(redis.clone())];
    let daemon =
        PoolDaemon::with_tiers(options(16 * MIB), tiers, tokio::runtime::Handle::current())
            .unwrap()
            .write_tier_behind_on(0, background_runtime().unwrap());
    let daemon = Arc::new(daemon);
    let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
    let (key, bytes) = chunk_value(3, &[3u8; 4096]);
    client(&path)
        .batch_put(vec![(key.clone(), bytes.clone())])
        .await
        .unwrap();

    // The commit was admitted before its reply; both writes are still sleeping.
    server.shutdown();
    daemon.close(Duration::from_secs(30)).await;
    for tier in [&disk, &redis] {
        let held = tier
            .store
            .batch_get(std::slice::from_ref(&key))
            .await
            .unwrap();
        assert_eq!(
            held[0].as_deref(),
            Some(&bytes[..]),
            "written before close returned"
        );
    }
    assert_eq!(
        daemon.stats().tier_writes,
        2,
        "one per tier that accepted the value"
    );
    let (low, normal) = (
        disk.put_nices.lock().unwrap().clone(),
        redis.put_nices.lock().unwrap().clone(),
    );
    assert_eq!((low.len(), normal.len()), (1, 1), "one write to each tier");
    if cfg!(target_os = "linux") {
        assert_eq!(low[0], Some(BACKGROUND_NICE));
        assert_ne!(
            normal[0],
            Some(BACKGROUND_NICE),
            "the daemon's runtime keeps its priority"
        );
    }
}

/// Where the copy and check of committed values run: beside the tier's writes, at the lowest
/// priority, when every tier written has low-priority threads of its own (nothing of a write
/// behind to disk then competes with the engines' steps at the daemon's priority; before, the
/// copy ran on the daemon's runtime); on the daemon's runtime when some tier is written there,
/// and when the values would hold more than a quarter of the arena waiting for those threads.
/// (Off Linux, where threads have no nice value here, only the count of copies is checked.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_values_are_copied_at_the_lowest_priority_when_every_tier_is_written_there() {
    let dir = tempfile::tempdir().unwrap();
    let (disk, redis) = (SlowRecordingTier::default(), SlowRecordingTier::default());
    let disk_only: Vec<Arc<dyn RemoteConnector>> = vec![Arc::new(disk.clone())];
    let both: Vec<Arc<dyn RemoteConnector>> = vec![Arc::new(disk.clone()), Arc::new(redis.clone())];
    let mut nices = Vec::new();
    let small = vec![5u8; 4096];
    let past_a_quarter = vec![6u8; 4 * MIB + 1]; // of the 16 MiB arena
    for (name, tiers, payload) in [
        ("disk-only", disk_only.clone(), &small),
        ("both", both, &small),
        ("disk-only-large", disk_only, &past_a_quarter),
    ] {
        let path = dir.path().join(format!("{name}.sock"));
        let daemon = Arc::new(
            PoolDaemon::with_tiers(options(16 * MIB), tiers, tokio::runtime::Handle::current())
                .unwrap()
                .write_tier_behind_on(0, background_runtime().unwrap()),
        );
        let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
        let (key, bytes) = chunk_value(5, payload);
        client(&path).batch_put(vec![(key, bytes)]).await.unwrap();
        server.shutdown();
        daemon.close(Duration::from_secs(30)).await;
        nices.push(daemon.copying_thread_nices());
    }
    let [disk_only, both, large] = &nices[..] else {
        unreachable!()
    };
    assert_eq!(
        (disk_only.len(), both.len(), large.len()),
        (1, 1, 1),
        "one copy per commit"
    );
    if cfg!(target_os = "linux") {
        assert_eq!(
            disk_only[0],
            Some(BACKGROUND_NICE),
            "copied at low priority"
        );
        assert_ne!(
            both[0],
            Some(BACKGROUND_NICE),
            "a tier written on the daemon's runtime is not held behind low-priority threads"
        );
        assert_ne!(
            large[0],
            Some(BACKGROUND_NICE),
            "values past a quarter of the arena are not left waiting for low-priority threads"
        );
    }
}

/// Each lower tier has its own quota: while a slow tier (a disk tier at low priority under
/// load) holds its quota, another tier still takes the next values. Before, one quota over
/// every tier was held until the slowest tier's write ended, and the next value was written
/// to no tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tier_fills_only_its_own_quota() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let (stuck, quick) = (SlowRecordingTier::gated(0), SlowRecordingTier::default());
    let tiers: Vec<Arc<dyn RemoteConnector>> =
        vec![Arc::new(stuck.clone()), Arc::new(quick.clone())];
    let (first, first_bytes) = chunk_value(1, &[1u8; 4096]);
    let (second, second_bytes) = chunk_value(2, &[2u8; 4096]);
    let quota = first_bytes.len() + first_bytes.len() / 2; // one value in flight, not two
    let daemon = Arc::new(
        PoolDaemon::with_tiers(
            DaemonOptions {
                write_behind_quota: quota,
                ..options(16 * MIB)
            },
            tiers,
            tokio::runtime::Handle::current(),
        )
        .unwrap(),
    );
    let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
    let engine = client(&path);
    engine
        .batch_put(vec![(first.clone(), first_bytes.clone())])
        .await
        .unwrap();
    // The quick tier's write ended and gave its quota back: only the stuck tier's share of
    // the first value is in flight.
    for _ in 0..500 {
        if daemon.write_behind_bytes() == first_bytes.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(daemon.write_behind_bytes(), first_bytes.len());
    assert!(
        quick.store.exists(&first).await.unwrap(),
        "the quick tier wrote the first value"
    );
    engine
        .batch_put(vec![(second.clone(), second_bytes.clone())])
        .await
        .unwrap();
    stuck.gate.add_permits(2);
    server.shutdown();
    daemon.close(Duration::from_secs(30)).await;
    let held = |tier: &SlowRecordingTier, key: &String| {
        let store = tier.store.clone();
        let key = key.clone();
        async move { store.exists(&key).await.unwrap() }
    };
    assert!(
        held(&quick, &second).await,
        "the quick tier wrote the second value too"
    );
    assert!(held(&stuck, &first).await);
    assert!(!held(&stuck, &second).await, "past the stuck tier's quota");
    assert_eq!(
        daemon.write_behind_dropped(),
        1,
        "dropped for the stuck tier only"
    );
    assert_eq!(
        daemon.stats().tier_writes,
        3,
        "one per tier that accepted a value"
    );
}

/// Work on the low-priority threads gives the CPU back while other processes wait for one:
/// their nice value does not hold against an engine in another scheduling group (a systemd
/// service, another session). With the CPU always contested, the copy out of the arena and
/// the disk tier's writes pause between slices, and still write every value whole; with the
/// CPU free they never pause. Before, nothing paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn low_priority_work_pauses_while_the_cpu_is_contested_and_writes_every_value() {
    use crate::cpu_pressure::CpuPacer;
    use std::sync::atomic::{AtomicU64, Ordering};

    let dir = tempfile::tempdir().unwrap();
    let stalled = Arc::new(AtomicU64::new(0));
    let always_contested = {
        let stalled = stalled.clone();
        CpuPacer::over(Arc::new(move || {
            Some(stalled.fetch_add(1_000_000, Ordering::SeqCst))
        }))
    };
    let never_contested = CpuPacer::over(Arc::new(|| Some(7)));
    // Three values of 1 MiB: two slices of the copy and of the writes.
    let values: Vec<(String, Bytes)> = (1..=3u8).map(|i| chunk_value(i, &vec![i; MIB])).collect();
    for (name, pacer, pauses) in [
        ("contested", always_contested, true),
        ("free", never_contested, false),
    ] {
        let disk = SlowRecordingTier::default(); // its store outlives the daemon's close
        let tiers: Vec<Arc<dyn RemoteConnector>> = vec![Arc::new(disk.clone())];
        let daemon = Arc::new(
            PoolDaemon::with_tiers(options(16 * MIB), tiers, tokio::runtime::Handle::current())
                .unwrap()
                .write_tier_behind_on(0, background_runtime().unwrap())
                .paced_by(pacer),
        );
        let path = dir.path().join(format!("{name}.sock"));
        let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
        client(&path).batch_put(values.clone()).await.unwrap();
        server.shutdown();
        daemon.close(Duration::from_secs(30)).await;
        for (key, bytes) in &values {
            let held = disk.store.batch_get(std::slice::from_ref(key)).await;
            assert_eq!(
                held.unwrap()[0].as_deref(),
                Some(&bytes[..]),
                "{name}: written whole"
            );
        }
        assert_eq!(daemon.stats().tier_writes, 3, "{name}");
        assert_eq!(
            disk.put_nices.lock().unwrap().len(),
            2,
            "{name}: written in two slices"
        );
        assert_eq!(
            daemon.write_behind_paused() > Duration::ZERO,
            pauses,
            "{name}: paused {:?}",
            daemon.write_behind_paused()
        );
    }
}

/// A key committed again while its write to a tier is still in flight (an engine saving the
/// same prefix twice, two engines saving one prompt) is written once: the second commit is
/// counted as deduplicated (`kvpool_daemon_write_behind_deduplicated_total`), not queued
/// behind the first, and the tier ends up holding the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_committed_again_while_its_write_is_in_flight_is_written_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    // No write may start until the test lets it: the first one is in flight throughout.
    let disk = SlowRecordingTier::gated(0);
    let tiers: Vec<Arc<dyn RemoteConnector>> = vec![Arc::new(disk.clone())];
    let daemon = Arc::new(
        PoolDaemon::with_tiers(options(16 * MIB), tiers, tokio::runtime::Handle::current())
            .unwrap(),
    );
    let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
    let (key, bytes) = chunk_value(5, &[5u8; 4096]);
    let engine = client(&path);
    for _ in 0..2 {
        engine
            .batch_put(vec![(key.clone(), bytes.clone())])
            .await
            .unwrap();
    }
    disk.gate.add_permits(2); // enough for a second write, should there be one
    server.shutdown();
    daemon.close(Duration::from_secs(30)).await;
    assert_eq!(disk.put_nices.lock().unwrap().len(), 1, "written once");
    assert_eq!(daemon.write_behind_deduplicated(), 1);
    assert_eq!(daemon.stats().tier_writes, 1);
    let held = disk.store.batch_get(std::slice::from_ref(&key)).await;
    assert_eq!(held.unwrap()[0].as_deref(), Some(&bytes[..]));
}
