//! The disk tier's own unit tests: bounded calls, the index agreeing with RocksDB and the
//! value files, reads from memory and from files.

use super::*;

/// The defect: under `block_in_place` a stuck RocksDB call held the task, so the tier's
/// timeout could not fire (the timeout here returned the call's own result after 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_disk_call_does_not_hold_its_caller_past_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let stuck = disk.inner.blocking(|_| {
        std::thread::sleep(Duration::from_secs(2));
        Ok(())
    });
    let outcome = tokio::time::timeout(Duration::from_millis(50), stuck).await;
    assert!(outcome.is_err(), "the timeout did not fire: {outcome:?}");
}

/// Writes queued or running are bounded in bytes (`QUEUED_WRITE_BYTES`): a write given up
/// on by its caller's timeout while it waits for room never runs, so its values are not kept
/// queued behind the others (write-behind at low priority can wait past the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_given_up_on_while_waiting_for_room_is_never_queued() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    // The room taken, as by writes still running.
    let taken = disk
        .inner
        .queued_writes
        .clone()
        .acquire_many_owned(QUEUED_WRITE_BYTES)
        .await
        .unwrap();
    let put = disk.batch_put(vec![("late".to_string(), Bytes::from_static(b"value"))]);
    let outcome = tokio::time::timeout(Duration::from_millis(100), put).await;
    assert!(
        outcome.is_err(),
        "the write did not wait for room: {outcome:?}"
    );
    drop(taken);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        disk.batch_get(&["late".to_string()]).await.unwrap(),
        vec![None]
    );
    // With room, a write goes through and gives its room back.
    disk.batch_put(vec![("next".to_string(), Bytes::from_static(b"value"))])
        .await
        .unwrap();
    assert_eq!(
        disk.inner.queued_writes.available_permits(),
        QUEUED_WRITE_BYTES as usize
    );
}

/// The index and RocksDB agree after puts, evictions and deletes of the same few keys race
/// each other from several tasks: every indexed key is stored with its indexed size, every
/// stored key is indexed, and the byte count is the sum and within capacity. (The defect:
/// an eviction could delete a key from RocksDB after a racing put had re-indexed it.) The
/// races run in short rounds with a check after each, so that a disagreement is seen before
/// later writes of the same key paper over it: with the write lock of
/// `DiskInner::serialized` taken out, this fails within the first three rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_and_rocksdb_agree_after_racing_puts_evictions_and_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = DiskConfig::new(dir.path());
    config.capacity_bytes = 8 * 4096;
    // Values of 1-4 KiB: some in RocksDB, some in files, the same key moving between them.
    config.value_file_min_bytes = 3000;
    let disk = DiskConnector::open(config).unwrap();
    for round in 0..150u64 {
        let tasks: Vec<_> = (0..6u64)
            .map(|t| {
                let disk = disk.clone();
                tokio::spawn(async move {
                    let mut x = (round * 8 + t).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    for _ in 0..12 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let key = format!("k{}", x % 12);
                        if x % 5 == 0 {
                            disk.delete(&key).await.unwrap();
                        } else {
                            let len = 1024 + (x % 3072) as usize;
                            let batch = vec![
                                (key, Bytes::from(vec![t as u8; len])),
                                (format!("k{}", (x >> 8) % 12), Bytes::from(vec![1u8; 2048])),
                            ];
                            disk.batch_put(batch).await.unwrap();
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_index_matches_rocksdb(&disk.inner, round);
    }
}

/// Every indexed key is stored (in RocksDB or in its value file, not both) with its indexed
/// size, every stored key and every value file is indexed, and the byte count is the sum.
fn assert_index_matches_rocksdb(inner: &DiskInner, round: u64) {
    let db = inner.db().unwrap();
    let mut stored: HashMap<String, u64> = db
        .iterator(rocksdb::IteratorMode::Start)
        .map(|item| {
            let (k, v) = item.unwrap();
            (String::from_utf8(k.to_vec()).unwrap(), v.len() as u64)
        })
        .collect();
    let idx = inner.index.lock();
    let files = value_files(inner);
    for k in &idx.in_files {
        let size = files
            .get(&ValueFiles::file_name(k))
            .unwrap_or_else(|| panic!("{k} indexed in a file that is missing (round {round})"));
        let in_rocksdb = stored.insert(k.clone(), *size);
        assert_eq!(in_rocksdb, None, "{k} both in RocksDB and in a file");
    }
    assert_eq!(files.len(), idx.in_files.len(), "a value file not indexed");
    assert_eq!(
        idx.sizes, stored,
        "index and RocksDB disagree after round {round}"
    );
    assert_eq!(idx.bytes, stored.values().sum::<u64>());
    assert!(idx.bytes <= 8 * 4096, "over capacity: {}", idx.bytes);
}

/// The value files of `inner`: file name to length.
fn value_files(inner: &DiskInner) -> HashMap<String, u64> {
    std::fs::read_dir(inner.config.path.join("values"))
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            (name, entry.metadata().unwrap().len())
        })
        .collect()
}

/// Every value in RocksDB: the settings of the tests of RocksDB's own read paths.
fn in_rocksdb_only(dir: &std::path::Path) -> DiskConfig {
    let mut config = DiskConfig::new(dir);
    config.value_file_min_bytes = u64::MAX;
    config
}

/// Reads that memory answers stay on the caller's thread; one that needs a file does not.
/// A value still in the memtable is served inline; after a flush and a reopen (empty block
/// cache) the same read needs I/O, so `read_cached` declines it; once the blocking read has
/// brought its block into the cache, it is served inline again, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_read_is_served_from_memory_and_a_cold_one_needs_the_blocking_pool() {
    let dir = tempfile::tempdir().unwrap();
    let value = Bytes::from(
        (0..200_000u32)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    let keys = vec!["a".to_string(), "never-stored".to_string()];
    {
        let disk = DiskConnector::open(in_rocksdb_only(dir.path())).unwrap();
        disk.batch_put(vec![("a".into(), value.clone())])
            .await
            .unwrap();
        let in_memtable = disk
            .inner
            .read_cached(&keys)
            .expect("memtable read is inline");
        assert_eq!(in_memtable, vec![Some(value.clone()), None]);
        disk.persist().unwrap();
        disk.close().await.unwrap();
    }
    let disk = DiskConnector::open(in_rocksdb_only(dir.path())).unwrap();
    assert_eq!(
        disk.inner.read_cached(&keys),
        None,
        "a read from a file must go to the blocking pool"
    );
    assert_eq!(
        disk.batch_get(&keys).await.unwrap(),
        vec![Some(value.clone()), None]
    );
    let hot = disk
        .inner
        .read_cached(&keys)
        .expect("the block is cached now");
    assert_eq!(hot, vec![Some(value), None]);
}

/// Every file of values carries a bloom filter, so a read skips the files that cannot hold
/// its key instead of reading the (multi-MiB) block where the key would be in each. (The
/// defect: no filter; a fresh process's first 64 MiB hit read about twice its bytes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_of_values_carry_a_bloom_filter() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(in_rocksdb_only(dir.path())).unwrap();
    for file in 0..3u8 {
        let entries = (0..4u8)
            .map(|i| (format!("key-{file}-{i}"), Bytes::from(vec![i; 64 << 10])))
            .collect();
        disk.batch_put(entries).await.unwrap();
        disk.inner.db().unwrap().flush().unwrap();
    }
    let properties = disk
        .inner
        .db()
        .unwrap()
        .property_value("rocksdb.aggregated-table-properties")
        .unwrap()
        .unwrap();
    // Aggregated over the values' files: every value's key is in a filter.
    assert!(
        properties.contains("# entries for filter=12;"),
        "{properties}"
    );
    assert_eq!(
        disk.batch_get(&["key-0-1".to_string()]).await.unwrap()[0].as_deref(),
        Some(&[1u8; 64 << 10][..])
    );
}

/// `batch_get_each` visits each stored value with its index, skips what is absent, and reads
/// a value from a file without putting it in the block cache (one value's buffer alive at a
/// time). (The defect: every read filled the block cache, so a fresh engine's first loads
/// faulted in fresh memory for each value.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_read_one_at_a_time_are_visited_in_place_and_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(in_rocksdb_only(dir.path())).unwrap();
    let value = |i: u8| Bytes::from(vec![i; 1 << 20]);
    disk.batch_put(vec![("a".into(), value(1)), ("c".into(), value(3))])
        .await
        .unwrap();
    let db = disk.inner.db().unwrap();
    db.flush().unwrap();
    let cached = || {
        db.property_int_value("rocksdb.block-cache-usage")
            .unwrap()
            .unwrap()
    };
    let before = cached();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let visit: CopyOut = {
        let seen = seen.clone();
        Arc::new(move |i, bytes| seen.lock().push((i, bytes.to_vec())))
    };
    let keys: Vec<String> = ["a", "b", "c"].iter().map(|k| k.to_string()).collect();
    disk.batch_get_each(&keys, visit).await.unwrap();
    let seen = std::mem::take(&mut *seen.lock());
    assert_eq!(
        seen,
        vec![(0, value(1).to_vec()), (2, value(3).to_vec())],
        "visited (index, value)"
    );
    assert!(
        cached() < before + (1 << 20),
        "a value read one at a time went into the block cache: {before} -> {} bytes",
        cached()
    );
    // A batch read still fills it (hot values then come from memory).
    disk.batch_get(&keys).await.unwrap();
    assert!(cached() >= before + (2 << 20), "{before} -> {}", cached());
}

fn patterned(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i % 251) as u8 ^ seed)
            .collect::<Vec<u8>>(),
    )
}

async fn read_each(disk: &DiskConnector, keys: &[String]) -> Vec<Option<Vec<u8>>> {
    let seen = Arc::new(Mutex::new(vec![None; keys.len()]));
    let visit: CopyOut = {
        let seen = seen.clone();
        Arc::new(move |i, bytes| seen.lock()[i] = Some(bytes.to_vec()))
    };
    disk.batch_get_each(keys, visit).await.unwrap();
    std::mem::take(&mut *seen.lock())
}

/// A value of at least `value_file_min_bytes` lives in a file of its own, not in RocksDB, and
/// reads back byte for byte through both read paths, after a reopen too; a smaller value
/// stays in RocksDB; a key that moves from a file to RocksDB (a smaller value put again) or
/// is deleted leaves no file behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_values_live_in_files_of_their_own_and_read_back_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let large = patterned(300 << 10, 7);
    let small = patterned(1000, 9);
    let keys: Vec<String> = ["large", "small", "absent"].map(String::from).to_vec();
    {
        let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
        disk.batch_put(vec![
            ("large".into(), large.clone()),
            ("small".into(), small.clone()),
        ])
        .await
        .unwrap();
        assert_eq!(
            value_files(&disk.inner),
            HashMap::from([(ValueFiles::file_name("large"), large.len() as u64)])
        );
        let db = disk.inner.db().unwrap();
        assert_eq!(
            db.get(b"large").unwrap(),
            None,
            "a file's value also in RocksDB"
        );
        assert_eq!(db.get(b"small").unwrap().as_deref(), Some(&small[..]));
        disk.close().await.unwrap();
    }
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    assert_eq!(
        disk.batch_get(&keys).await.unwrap(),
        vec![Some(large.clone()), Some(small.clone()), None]
    );
    assert_eq!(
        read_each(&disk, &keys).await,
        vec![Some(large.to_vec()), Some(small.to_vec()), None]
    );
    assert_eq!(disk.usage(), (2, (large.len() + small.len()) as u64));
    // The large key put again with a small value: back in RocksDB, its file gone.
    disk.batch_put(vec![("large".into(), small.clone())])
        .await
        .unwrap();
    assert!(value_files(&disk.inner).is_empty());
    assert_eq!(
        read_each(&disk, &keys[..1]).await,
        vec![Some(small.to_vec())]
    );
    // And large again, then deleted: no file left.
    disk.batch_put(vec![("large".into(), large.clone())])
        .await
        .unwrap();
    assert_eq!(value_files(&disk.inner).len(), 1);
    assert_eq!(disk.inner.db().unwrap().get(b"large").unwrap(), None);
    assert_eq!(disk.batch_delete(&keys[..1]).await.unwrap(), 1);
    assert!(value_files(&disk.inner).is_empty());
    assert_eq!(disk.batch_get(&keys[..1]).await.unwrap(), vec![None]);
}

/// A value file that is gone, cut short or grown is a miss (never other bytes), and its
/// entry is dropped from the index; the other values of the batch are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_or_torn_value_file_is_a_miss_and_its_entry_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let keys: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
    let value = |i: usize| patterned(100 << 10, i as u8);
    disk.batch_put(
        keys.iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), value(i)))
            .collect(),
    )
    .await
    .unwrap();
    let file = |k: &str| dir.path().join("values").join(ValueFiles::file_name(k));
    std::fs::remove_file(file("k0")).unwrap();
    std::fs::write(file("k1"), &value(1)[..1000]).unwrap();
    let mut grown = value(2).to_vec();
    grown.push(0);
    std::fs::write(file("k2"), grown).unwrap();
    assert_eq!(
        read_each(&disk, &keys).await,
        vec![None, None, None, Some(value(3).to_vec())]
    );
    assert_eq!(
        disk.batch_exists(&keys).await.unwrap(),
        vec![false, false, false, true],
        "a lost entry stayed indexed"
    );
    assert_eq!(disk.usage(), (1, 100 << 10));
    assert_eq!(value_files(&disk.inner).len(), 1, "a torn file was left");
}

/// At open, value files that no index entry names (a crash between writing a file and
/// indexing it, or an eviction's delete that failed) and temporary files are removed;
/// indexed ones are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_no_index_entry_names_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let kept = patterned(128 << 10, 1);
    {
        let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
        disk.batch_put(vec![("kept".into(), kept.clone())])
            .await
            .unwrap();
        disk.close().await.unwrap();
    }
    let values = dir.path().join("values");
    std::fs::write(values.join(ValueFiles::file_name("stray")), b"orphan").unwrap();
    std::fs::write(values.join(".tmp-17"), b"half written").unwrap();
    std::fs::write(values.join("README"), b"not ours").unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let mut names: Vec<String> = value_files(&disk.inner).into_keys().collect();
    names.sort();
    let mut expected = vec!["README".to_string(), ValueFiles::file_name("kept")];
    expected.sort();
    assert_eq!(names, expected);
    assert_eq!(
        disk.batch_get(&["kept".to_string()]).await.unwrap(),
        vec![Some(kept)]
    );
}

/// Evictions delete the evicted values' files: the folder never holds more than capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_values_leave_no_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = DiskConfig::new(dir.path());
    config.capacity_bytes = 4 * (100 << 10);
    let disk = DiskConnector::open(config).unwrap();
    for i in 0..12u8 {
        disk.batch_put(vec![(format!("k{i}"), patterned(100 << 10, i))])
            .await
            .unwrap();
    }
    assert_eq!(disk.usage(), (4, 4 * (100 << 10)));
    let mut names: Vec<String> = value_files(&disk.inner).into_keys().collect();
    names.sort();
    let mut newest: Vec<String> = (8..12)
        .map(|i| ValueFiles::file_name(&format!("k{i}")))
        .collect();
    newest.sort();
    assert_eq!(names, newest);
}

/// A read that found a value file gone or short drops the entry only if it is still so once
/// no write can run: a put of the same key that raced the read (a new file renamed in, or
/// the value moved into RocksDB) keeps its value. (The defect this guards against: the
/// read's finding alone deleted the key, and with it a value just written.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_raced_a_put_of_the_same_key_does_not_drop_the_new_value() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let key = vec!["k".to_string()];
    let large = patterned(100 << 10, 1);
    let small = patterned(1000, 2);
    // What a reader saw before the put: the file of 100 KiB, then gone or another length.
    let seen = [("k".to_string(), large.len() as u64)];
    disk.batch_put(vec![("k".into(), large.clone())])
        .await
        .unwrap();
    // Put again with the same length (a new file renamed in): kept.
    disk.batch_put(vec![("k".into(), patterned(100 << 10, 3))])
        .await
        .unwrap();
    disk.inner.drop_lost_files(&seen).unwrap();
    assert_eq!(
        disk.batch_get(&key).await.unwrap(),
        vec![Some(patterned(100 << 10, 3))]
    );
    // Put again small (moved into RocksDB, the file deleted): kept.
    disk.batch_put(vec![("k".into(), small.clone())])
        .await
        .unwrap();
    disk.inner.drop_lost_files(&seen).unwrap();
    assert_eq!(disk.batch_get(&key).await.unwrap(), vec![Some(small)]);
    // Really lost: dropped.
    disk.batch_put(vec![("k".into(), large)]).await.unwrap();
    std::fs::remove_file(dir.path().join("values").join(ValueFiles::file_name("k"))).unwrap();
    disk.inner.drop_lost_files(&seen).unwrap();
    assert_eq!(disk.usage(), (0, 0));
}

/// A key put twice in one batch keeps the last value, wherever each would live: a key in a
/// file, put small then large, still has its (new) file. (The defect: the index update saw
/// the key leave its file for RocksDB, then come back, and deleted the file just written.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_put_twice_in_one_batch_keeps_its_last_value() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let key = vec!["k".to_string()];
    let (large, small) = (patterned(100 << 10, 1), patterned(1000, 2));
    disk.batch_put(vec![("k".into(), patterned(100 << 10, 9))])
        .await
        .unwrap();
    disk.batch_put(vec![
        ("k".into(), small.clone()),
        ("k".into(), large.clone()),
    ])
    .await
    .unwrap();
    assert_eq!(
        disk.batch_get(&key).await.unwrap(),
        vec![Some(large.clone())]
    );
    disk.batch_put(vec![("k".into(), large), ("k".into(), small.clone())])
        .await
        .unwrap();
    assert_eq!(disk.batch_get(&key).await.unwrap(), vec![Some(small)]);
    assert!(value_files(&disk.inner).is_empty());
    assert_eq!(disk.usage(), (1, 1000));
}

/// A read while the database is reopened after a failed write is a miss at once. Before, the
/// reopen held the broken flag's lock (and the database's) while RocksDB opened and the
/// index loaded, and a read that memory could answer took that lock on the caller's thread:
/// an engine's step waited for the whole reopen, past any timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_during_a_reopen_is_a_miss_at_once_and_a_hit_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
    let keys = vec!["k".to_string()];
    disk.batch_put(vec![("k".to_string(), Bytes::from_static(b"value"))])
        .await
        .unwrap();
    let pause = Arc::new(std::sync::Barrier::new(2));
    *disk.inner.reopen_pause.lock() = Some(pause.clone());
    *disk.inner.broken_since.lock() = Some(Instant::now() - Duration::from_secs(2));
    let reopen = std::thread::spawn({
        let inner = disk.inner.clone();
        move || inner.recover_if_broken()
    });
    pause.wait(); // the old database is closed; the new one is not open yet
    let (sent, answer) = std::sync::mpsc::channel();
    std::thread::spawn({
        let inner = disk.inner.clone();
        let keys = keys.clone();
        move || {
            let memory = inner.read_cached(&keys);
            let read = inner.read_entries(&keys).map_err(|e| e.to_string());
            sent.send((memory, read)).unwrap();
        }
    });
    let outcome = answer.recv_timeout(Duration::from_secs(5));
    pause.wait(); // the reopen goes on
    reopen.join().unwrap();
    let (memory, read) = outcome.expect("the read waited for the reopen");
    assert!(memory.is_none(), "not answered from memory while reopening");
    assert!(read.is_err(), "the database is not there yet: {read:?}");
    assert!(disk.inner.broken_since.lock().is_none(), "reopened");
    assert_eq!(
        disk.batch_get(&keys).await.unwrap(),
        vec![Some(Bytes::from_static(b"value"))]
    );
}
