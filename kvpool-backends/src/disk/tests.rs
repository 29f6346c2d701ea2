//! The disk tier's own unit tests: bounded calls, and the index agreeing with RocksDB.

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

fn assert_index_matches_rocksdb(inner: &DiskInner, round: u64) {
    let db = inner.db().unwrap();
    let stored: HashMap<String, u64> = db
        .iterator(rocksdb::IteratorMode::Start)
        .map(|item| {
            let (k, v) = item.unwrap();
            (String::from_utf8(k.to_vec()).unwrap(), v.len() as u64)
        })
        .collect();
    let idx = inner.index.lock();
    assert_eq!(
        idx.sizes, stored,
        "index and RocksDB disagree after round {round}"
    );
    assert_eq!(idx.bytes, stored.values().sum::<u64>());
    assert!(idx.bytes <= 8 * 4096, "over capacity: {}", idx.bytes);
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
        let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
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
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
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
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
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
    let disk = DiskConnector::open(DiskConfig::new(dir.path())).unwrap();
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
