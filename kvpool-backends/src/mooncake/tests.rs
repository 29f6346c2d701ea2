//! The Mooncake connector against an in-process stand-in for the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;

use kvpool_core::{BackendError, RemoteConnector};

use std::collections::HashMap;

use super::client::*;
use super::config::*;
use super::connector::*;

/// An in-process stand-in for Mooncake: checks that every buffer it is handed lies inside
/// registered memory, and can be told to fail like a cluster without a master.
#[derive(Default)]
struct FakeStore {
    objects: Mutex<HashMap<String, Vec<u8>>>,
    registered: Mutex<Vec<(usize, usize)>>,
    calls: AtomicUsize,
    master_down: AtomicBool,
    /// Puts of these keys fail once with "object not found" (a lost race).
    race_once: Mutex<Vec<String>>,
    /// How long each put takes.
    put_delay: Mutex<Duration>,
    /// How long each get takes (a master that stopped answering).
    get_delay: Mutex<Duration>,
    /// Keys being put now, and how often a put began on a key another put was still writing.
    putting: Mutex<Vec<String>>,
    overlapping_puts: AtomicUsize,
}

impl FakeStore {
    fn check_registered(&self, b: &RawBuffer) {
        let start = b.ptr as usize;
        assert!(
            self.registered
                .lock()
                .iter()
                .any(|(s, l)| start >= *s && start + b.len <= s + l),
            "a buffer outside registered memory was handed to Mooncake"
        );
    }

    fn enter(&self) -> Option<i64> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.master_down.load(Ordering::SeqCst).then_some(-900)
    }
}

impl MooncakeStoreClient for FakeStore {
    fn name(&self) -> &str {
        "fake"
    }
    unsafe fn register_buffer(&self, b: RawBuffer) -> Result<i64, String> {
        self.registered.lock().push((b.ptr as usize, b.len));
        Ok(0)
    }
    unsafe fn batch_upsert_from(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String> {
        if let Some(code) = self.enter() {
            return Ok(vec![code; keys.len()]);
        }
        let distinct: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(
            distinct.len(),
            keys.len(),
            "a key twice in one put: {keys:?}"
        );
        {
            let mut putting = self.putting.lock();
            if keys.iter().any(|k| putting.contains(k)) {
                self.overlapping_puts.fetch_add(1, Ordering::SeqCst);
            }
            putting.extend(keys.iter().cloned());
        }
        std::thread::sleep(*self.put_delay.lock());
        {
            let mut putting = self.putting.lock();
            for k in keys {
                let i = putting.iter().position(|p| p == k).unwrap();
                putting.swap_remove(i);
            }
        }
        // The master went away during the transfer.
        if self.master_down.load(Ordering::SeqCst) {
            return Ok(vec![-900; keys.len()]);
        }
        Ok(keys
            .iter()
            .zip(buffers)
            .map(|(k, b)| {
                self.check_registered(b);
                let mut race = self.race_once.lock();
                if let Some(i) = race.iter().position(|r| r == k) {
                    race.remove(i);
                    return OBJECT_NOT_FOUND;
                }
                // SAFETY: the connector promises readable registered buffers.
                let bytes = unsafe { std::slice::from_raw_parts(b.ptr, b.len) };
                self.objects.lock().insert(k.clone(), bytes.to_vec());
                OK
            })
            .collect())
    }
    unsafe fn batch_get_into(
        &self,
        keys: &[String],
        buffers: &[RawBuffer],
    ) -> Result<Vec<i64>, String> {
        if let Some(code) = self.enter() {
            return Ok(vec![code; keys.len()]);
        }
        std::thread::sleep(*self.get_delay.lock());
        // As Mooncake does, the buffers are addressed by key: of a key given twice, only the
        // last buffer is written, and both are reported filled.
        let last: HashMap<&String, &RawBuffer> = keys.iter().zip(buffers).collect();
        Ok(keys
            .iter()
            .map(|k| {
                let b = last[k];
                self.check_registered(b);
                match self.objects.lock().get(k) {
                    None => OBJECT_NOT_FOUND,
                    Some(v) if v.len() > b.len => BUFFER_TOO_SMALL,
                    Some(v) => {
                        // SAFETY: the connector promises writable registered buffers.
                        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), b.ptr, v.len()) };
                        v.len() as i64
                    }
                }
            })
            .collect())
    }
    fn get_size(&self, key: &str) -> Result<i64, String> {
        if let Some(code) = self.enter() {
            return Ok(code);
        }
        Ok(self
            .objects
            .lock()
            .get(key)
            .map_or(OBJECT_NOT_FOUND, |v| v.len() as i64))
    }
    fn batch_is_exist(&self, keys: &[String]) -> Result<Vec<i64>, String> {
        if let Some(code) = self.enter() {
            return Ok(vec![code; keys.len()]);
        }
        let objects = self.objects.lock();
        Ok(keys
            .iter()
            .map(|k| i64::from(objects.contains_key(k)))
            .collect())
    }
    fn batch_remove(&self, keys: &[String]) -> Result<Vec<i64>, String> {
        if let Some(code) = self.enter() {
            return Ok(vec![code; keys.len()]);
        }
        let mut objects = self.objects.lock();
        Ok(keys
            .iter()
            .map(|k| objects.remove(k).map_or(OBJECT_NOT_FOUND, |_| OK))
            .collect())
    }
    fn close(&self) -> Result<i64, String> {
        Ok(0)
    }
}

fn connector(staging: u64) -> (Arc<FakeStore>, MooncakeConnector) {
    let fake = Arc::new(FakeStore::default());
    let config = MooncakeConfig {
        master_server_address: "fake:1".into(),
        staging_bytes: staging,
        retry_after: Duration::from_millis(200),
        ..MooncakeConfig::default()
    };
    let c = MooncakeConnector::with_client(fake.clone(), &config).unwrap();
    (fake, c)
}

fn value(i: usize, len: usize) -> Bytes {
    (0..len)
        .map(|j| (j.wrapping_mul(31) ^ i) as u8)
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::test]
async fn batches_larger_than_staging_go_in_rounds_and_round_trip() {
    let (fake, c) = connector(2 << 20);
    let entries: Vec<(String, Bytes)> = (0..10)
        .map(|i| (format!("k{i}"), value(i, 700 << 10)))
        .collect();
    c.batch_put(entries.clone()).await.unwrap();
    assert!(
        fake.calls.load(Ordering::SeqCst) >= 4,
        "10 x 700 KiB in 2 MiB"
    );
    let mut keys: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
    keys.push("absent".into());
    let got = c.batch_get(&keys).await.unwrap();
    for ((_, want), got) in entries.iter().zip(&got) {
        assert_eq!(got.as_ref(), Some(want));
    }
    assert_eq!(got[10], None);
    assert_eq!(
        c.batch_exists(&keys).await.unwrap(),
        [vec![true; 10], vec![false]].concat()
    );
    assert_eq!(c.batch_delete(&keys).await.unwrap(), 10);
}

#[tokio::test]
async fn values_larger_than_the_size_hint_are_read_whole() {
    let (fake, c) = connector(8 << 20);
    c.put("small", value(1, 1000)).await.unwrap();
    assert_eq!(c.get("small").await.unwrap(), Some(value(1, 1000)));
    // Written by another client: larger than anything this connector has seen.
    fake.objects
        .lock()
        .insert("large".into(), value(2, 3 << 20).to_vec());
    assert_eq!(c.get("large").await.unwrap(), Some(value(2, 3 << 20)));
    let got = c
        .batch_get(&["small".into(), "large".into(), "absent".into()])
        .await
        .unwrap();
    assert_eq!(
        got,
        vec![Some(value(1, 1000)), Some(value(2, 3 << 20)), None]
    );
}

#[tokio::test]
async fn held_results_are_moved_out_of_staging_when_it_runs_out() {
    let (_fake, c) = connector(2 << 20);
    let entries: Vec<(String, Bytes)> = (0..6)
        .map(|i| (format!("k{i}"), value(i, 900 << 10)))
        .collect();
    c.batch_put(entries.clone()).await.unwrap();
    let keys: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
    // 6 x 900 KiB cannot all stay in a 2 MiB arena at once.
    let got = c.batch_get(&keys).await.unwrap();
    for ((_, want), got) in entries.iter().zip(&got) {
        assert_eq!(got.as_ref(), Some(want));
    }
    // Results held by the caller never block later calls for good.
    let held = got;
    assert_eq!(c.get("k0").await.unwrap().as_ref(), held[0].as_ref());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_connector_never_has_two_puts_of_a_key_in_flight() {
    // Mooncake's master lets a second upsert of a key in progress from the same client take
    // the first one's place; the first one's end may then publish the second's half-written
    // memory. Every call of a connector is one client, so the connector serialises them.
    let (fake, c) = connector(16 << 20);
    *fake.put_delay.lock() = Duration::from_millis(2);
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let c = c.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    c.batch_put(vec![
                        ("shared".into(), value(t, 4096)),
                        (format!("own{t}"), value(100 + t, 4096)),
                    ])
                    .await
                    .unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(fake.overlapping_puts.load(Ordering::SeqCst), 0);
    for t in 0..8 {
        assert_eq!(
            c.get(&format!("own{t}")).await.unwrap(),
            Some(value(100 + t, 4096))
        );
    }
    let shared = c.get("shared").await.unwrap().unwrap();
    assert!((0..8).any(|t| shared == value(t, 4096)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_waited_on_one_the_cluster_failed_fails_fast() {
    let (fake, c) = connector(4 << 20);
    *fake.put_delay.lock() = Duration::from_millis(300);
    let first = {
        let c = c.clone();
        tokio::spawn(async move { c.put("k", value(1, 4096)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = {
        let c = c.clone();
        tokio::spawn(async move { c.put("k", value(2, 4096)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    fake.master_down.store(true, Ordering::SeqCst);
    let first = first.await.unwrap();
    assert!(first.is_err(), "the master died during it: {first:?}");
    assert!(second.await.unwrap().is_err());
    assert_eq!(
        fake.calls.load(Ordering::SeqCst),
        1,
        "the put that waited did not try the failed cluster again"
    );
}

#[tokio::test]
async fn a_key_twice_in_one_call_is_read_and_written_once() {
    let (_fake, c) = connector(4 << 20);
    c.batch_put(vec![
        ("k".into(), value(1, 8192)),
        ("k".into(), value(2, 8192)),
    ])
    .await
    .unwrap();
    // Staging now holds other bytes, as it does in a process that has run a while.
    c.put("other", value(7, 8192)).await.unwrap();
    let got = c
        .batch_get(&["k".into(), "other".into(), "k".into()])
        .await
        .unwrap();
    // The later value of a key put twice, handed to every place that asked for it.
    let want = [value(2, 8192), value(7, 8192), value(2, 8192)];
    for (place, (got, want)) in got.iter().zip(&want).enumerate() {
        assert!(got.as_ref() == Some(want), "place {place} got other bytes");
    }
    assert_eq!(got.len(), 3);
}

#[tokio::test]
async fn a_put_that_lost_a_race_is_retried() {
    let (fake, c) = connector(4 << 20);
    fake.race_once.lock().push("contended".into());
    c.put("contended", value(3, 4096)).await.unwrap();
    assert_eq!(c.get("contended").await.unwrap(), Some(value(3, 4096)));
}

#[tokio::test]
async fn a_failed_cluster_pauses_calls_then_they_resume() {
    let (fake, c) = connector(4 << 20);
    c.put("k", value(4, 100)).await.unwrap();
    fake.master_down.store(true, Ordering::SeqCst);
    let err = c.get("k").await.unwrap_err().to_string();
    assert!(err.contains("-900"), "{err}");
    let calls = fake.calls.load(Ordering::SeqCst);
    for _ in 0..5 {
        let err = c.exists("k").await.unwrap_err().to_string();
        assert!(err.contains("failed a call moments ago"), "{err}");
    }
    assert_eq!(
        fake.calls.load(Ordering::SeqCst),
        calls,
        "paused calls do not reach the client"
    );
    fake.master_down.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(c.get("k").await.unwrap(), Some(value(4, 100)));
}

/// The defect: calls ran inline (`block_in_place`) with no deadline, so a call stuck inside
/// Mooncake held its caller until Mooncake gave up (the get here took its full 2 s and
/// succeeded), and every other call queued behind a stuck one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_stuck_inside_mooncake_times_out_and_later_calls_fail_fast_until_it_returns() {
    let fake = Arc::new(FakeStore::default());
    let config = MooncakeConfig {
        master_server_address: "fake:1".into(),
        staging_bytes: 4 << 20,
        call_timeout: Duration::from_millis(100),
        retry_after: Duration::from_millis(50),
        ..MooncakeConfig::default()
    };
    let c = MooncakeConnector::with_client(fake.clone(), &config).unwrap();
    c.put("k", value(5, 4096)).await.unwrap();
    *fake.get_delay.lock() = Duration::from_millis(1500);
    let started = std::time::Instant::now();
    let err = c.get("k").await.unwrap_err();
    assert!(
        matches!(err, BackendError::Timeout { .. }),
        "a stuck get is a timeout: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(1000),
        "the caller was held {:?}",
        started.elapsed()
    );
    // Past `retry_after` but with the late call still inside Mooncake: calls fail fast and
    // do not reach the client.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let calls = fake.calls.load(Ordering::SeqCst);
    let err = c.exists("k").await.unwrap_err().to_string();
    assert!(err.contains("past their deadline"), "{err}");
    assert_eq!(fake.calls.load(Ordering::SeqCst), calls);
    // Once it returns, calls go through again.
    *fake.get_delay.lock() = Duration::ZERO;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(c.get("k").await.unwrap(), Some(value(5, 4096)));
}

#[tokio::test]
async fn close_makes_every_call_an_error() {
    let (_fake, c) = connector(4 << 20);
    c.close().await.unwrap();
    assert!(matches!(
        c.get("k").await.unwrap_err(),
        BackendError::Closed(_)
    ));
    assert!(matches!(
        c.put("k", value(0, 1)).await.unwrap_err(),
        BackendError::Closed(_)
    ));
}

#[test]
fn urls_and_mooncake_json_combine() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("mooncake.json");
    std::fs::write(
        &json,
        r#"{"local_hostname": "node7", "metadata_server": "etcd://10.0.0.2:2379",
            "master_server_address": "10.0.0.5:50051", "protocol": "rdma",
            "device_name": "mlx5_0", "global_segment_size": "4gb",
            "local_buffer_size": 1073741824, "enable_ssd_offload": false}"#,
    )
    .unwrap();
    let c =
        MooncakeConfig::from_url(&format!("mooncakestore://?config={}", json.display())).unwrap();
    assert_eq!(c.master_server_address, "10.0.0.5:50051");
    assert_eq!(c.local_hostname, "node7");
    assert_eq!(c.metadata_server, "etcd://10.0.0.2:2379");
    assert_eq!(
        (c.protocol.as_str(), c.device_name.as_str()),
        ("rdma", "mlx5_0")
    );
    assert_eq!(c.global_segment_size, 4 << 30);
    assert_eq!(c.local_buffer_size, 1 << 30);
    // The URL overrides the file.
    let c = MooncakeConfig::from_url(&format!(
        "mooncakestore://10.0.0.9:6000?config={}&protocol=tcp&replica_num=2&staging_size=64MiB&global_segment_size=512MB",
        json.display()
    ))
    .unwrap();
    assert_eq!(c.master_server_address, "10.0.0.9:6000");
    assert_eq!(c.protocol, "tcp");
    assert_eq!(c.replica_num, 2);
    assert_eq!(c.staging_bytes, 64 << 20);
    assert_eq!(c.global_segment_size, 512 << 20);
    // Defaults.
    let c = MooncakeConfig::from_url("mooncakestore://m:50051").unwrap();
    assert_eq!(c.metadata_server, "P2PHANDSHAKE");
    assert_eq!((c.protocol.as_str(), c.global_segment_size), ("tcp", 0));
}

#[test]
fn bad_mooncake_configuration_says_what_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{not json").unwrap();
    for (url, needle) in [
        ("redis://h:1".to_string(), "not a Mooncake URL"),
        (
            "mooncakestore://h:1?staging_size=12parsecs".into(),
            "staging_size",
        ),
        ("mooncakestore://h:1?protocol".into(), "needs a value"),
        (
            format!("mooncakestore://h:1?config={}", broken.display()),
            "not Mooncake JSON",
        ),
        (
            "mooncakestore://h:1?config=/nonexistent.json".into(),
            "cannot read",
        ),
        (
            "mooncakestore://h:1?staging_size=4KiB".into(),
            "at least 1MiB",
        ),
    ] {
        let err = MooncakeConfig::from_url(&url).unwrap_err().to_string();
        assert!(err.contains(needle), "{url}: {err}");
    }
}

#[test]
fn codes_have_meanings() {
    assert_eq!(describe_code(-704), "object not found");
    assert!(is_cluster_failure(-900));
    assert!(!is_cluster_failure(OBJECT_NOT_FOUND));
}
