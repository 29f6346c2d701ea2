use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvpool_backends::{ControlledFaults, InMemoryConnector, LocalCpuBackend, TimeoutConnector};
use kvpool_core::{
    ChunkCodec, EvictionKind, HashAlgorithm, KeyScope, PoolConfig, RemoteBackend, RemoteConnector,
    StorageManager, TierConfig,
};

use super::*;

const ROW: usize = 4096;
const ROWS: usize = 8;

type Lower = ControlledFaults<InMemoryConnector>;

struct Fixture {
    tier: OffloadTier,
    region: Vec<u8>,
    lower: Lower,
    runtime: Arc<Runtime>,
}

fn runtime() -> Arc<Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    )
}

fn scope(model: &str) -> KeyScope {
    let config = pool_config_for_offload_tier(&PoolConfig::default(), model, 2, ROW).unwrap();
    config.key_scope().unwrap()
}

/// A tier over an optional L1 (`l1_rows` rows) and one lower tier in process memory behind
/// fault switches, moving rows of a region of `ROWS` rows filled with `seed`-dependent bytes.
fn fixture(model: &str, l1_rows: Option<usize>, lower: Lower) -> Fixture {
    let runtime = runtime();
    let bounded = TimeoutConnector::new(lower.clone(), Duration::from_millis(300));
    let mut builder = StorageManager::builder();
    if let Some(rows) = l1_rows {
        let cpu = Arc::new(LocalCpuBackend::new(rows * ROW, EvictionKind::Lru).unwrap());
        builder = builder.l1(cpu.clone(), cpu);
    }
    let _inside = runtime.enter();
    let storage = Arc::new(
        builder
            .lower(Arc::new(RemoteBackend::new(
                bounded,
                ChunkCodec::default(),
                ROW as u64,
            )))
            .build()
            .unwrap(),
    );
    let mut region: Vec<u8> = (0..ROWS * ROW)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect();
    // SAFETY: the region outlives the tier in every test (the fixture owns both and the
    // tier is drained before the region is read or dropped).
    let primary = unsafe { PrimaryRegion::new(region.as_mut_ptr() as usize, ROWS, ROW) }.unwrap();
    let tier = OffloadTier::new(
        storage,
        runtime.clone(),
        scope(model),
        primary,
        16,
        HashAlgorithm::default(),
    );
    Fixture {
        tier,
        region,
        lower,
        runtime,
    }
}

fn wait_finished(tier: &OffloadTier, jobs: usize) -> Vec<TierJobResult> {
    tier.drain();
    let done = tier.finished();
    assert_eq!(done.len(), jobs, "{done:?}");
    done
}

fn lookup_until_answered(tier: &OffloadTier, key: &[u8]) -> TierLookup {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tier.lookup(key) {
            TierLookup::Retry if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            answer => return answer,
        }
    }
}

fn row(f: &Fixture, r: usize) -> &[u8] {
    &f.region[r * ROW..(r + 1) * ROW]
}

fn region_copy(f: &Fixture) -> Vec<u8> {
    f.tier.drain();
    f.region.clone()
}

fn keys(n: u8) -> Vec<Vec<u8>> {
    (0..n).map(|i| vec![i; 36]).collect()
}

#[test]
fn rows_stored_then_loaded_into_other_rows_are_byte_exact_through_l1_and_the_lower_tier() {
    for l1 in [Some(ROWS), None] {
        let f = fixture("m@w=1", l1, Lower::default());
        let want: Vec<Vec<u8>> = (0..3).map(|r| row(&f, r).to_vec()).collect();
        f.tier.submit_store(1, keys(3), vec![0, 1, 2]);
        let done = wait_finished(&f.tier, 1);
        assert!(
            done[0].success && done[0].bytes == 3 * ROW as u64,
            "{done:?}"
        );
        f.runtime.block_on(f.tier.storage.flush()).unwrap();
        assert_eq!(f.lower.inner().len(), 3, "written behind to the lower tier");
        for k in keys(3) {
            assert_eq!(
                lookup_until_answered(&f.tier, &k),
                TierLookup::Hit,
                "l1 {l1:?}"
            );
        }
        assert_eq!(lookup_until_answered(&f.tier, &[9; 36]), TierLookup::Miss);

        f.tier.submit_load(2, keys(3), vec![5, 6, 7]);
        let done = wait_finished(&f.tier, 1);
        assert_eq!(done[0].loaded, Some(3), "{done:?}");
        assert!(done[0].success);
        for (i, want) in want.iter().enumerate() {
            assert_eq!(row(&f, 5 + i), &want[..], "row {i}, l1 {l1:?}");
        }
    }
}

#[test]
fn another_checkpoint_and_a_misplaced_or_corrupt_value_are_misses_never_data() {
    let lower = Lower::default();
    let writer = fixture("m@w=1", None, lower.clone());
    writer.tier.submit_store(1, keys(2), vec![0, 1]);
    assert!(wait_finished(&writer.tier, 1)[0].success);
    writer
        .runtime
        .block_on(writer.tier.storage.flush())
        .unwrap();

    // Same served name, other weights: a scope of its own, nothing shared.
    let other = fixture("m@w=2", None, lower.clone());
    assert_eq!(
        lookup_until_answered(&other.tier, &keys(1)[0]),
        TierLookup::Miss
    );
    let before = row(&other, 4).to_vec();
    other.tier.submit_load(2, keys(1), vec![4]);
    let done = wait_finished(&other.tier, 1);
    assert_eq!((done[0].success, done[0].loaded), (false, Some(0)));
    assert_eq!(row(&other, 4), &before[..], "nothing written into the row");

    // Key 1's value copied under key 0 (a misplaced value), and key 1's corrupted.
    let reader = fixture("m@w=1", None, lower.clone());
    let k0 = reader.tier.key_of(&keys(1)[0]).to_string();
    let k1 = reader.tier.key_of(&keys(2)[1]).to_string();
    let v1 = lower.inner().raw(&k1).unwrap();
    lower.inner().insert_raw(&k0, v1.clone());
    let mut corrupt = v1.to_vec();
    *corrupt.last_mut().unwrap() ^= 1;
    let corrupt = Bytes::from(corrupt);
    lower.inner().insert_raw(&k1, corrupt.clone());
    let before = region_copy(&reader);
    reader.tier.submit_load(3, keys(2), vec![6, 7]);
    let done = wait_finished(&reader.tier, 1);
    assert_eq!((done[0].success, done[0].loaded), (false, Some(0)));
    assert_eq!(region_copy(&reader), before, "nothing written");
    // The load deleted both bad values; put them back and ask the lookups too.
    lower.inner().insert_raw(&k0, v1);
    lower.inner().insert_raw(&k1, corrupt);
    for k in keys(2) {
        assert_eq!(lookup_until_answered(&reader.tier, &k), TierLookup::Miss);
    }
}

#[test]
fn a_dead_lower_tier_fails_jobs_within_its_timeout_then_recovers() {
    let lower = Lower::default();
    let f = fixture("m@w=1", None, lower.clone());
    f.tier.submit_store(1, keys(2), vec![0, 1]);
    assert!(wait_finished(&f.tier, 1)[0].success);
    f.runtime.block_on(f.tier.storage.flush()).unwrap();

    lower
        .switches()
        .hang
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let started = Instant::now();
    assert_eq!(lookup_until_answered(&f.tier, &[7; 36]), TierLookup::Miss);
    let before = region_copy(&f);
    f.tier.submit_load(2, keys(2), vec![4, 5]);
    let done = wait_finished(&f.tier, 1);
    assert!(!done[0].success, "{done:?}");
    assert_eq!(region_copy(&f), before, "a failed load writes nothing");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "bounded by the tier's timeout"
    );

    lower
        .switches()
        .hang
        .store(false, std::sync::atomic::Ordering::SeqCst);
    std::thread::sleep(LOOKUP_ANSWER_TTL);
    assert_eq!(lookup_until_answered(&f.tier, &keys(1)[0]), TierLookup::Hit);
    f.tier.submit_load(3, keys(2), vec![4, 5]);
    assert!(wait_finished(&f.tier, 1)[0].success);
    assert_eq!(row(&f, 4), row(&f, 0));
    assert_eq!(row(&f, 5), row(&f, 1));
}

#[test]
fn a_job_with_a_row_outside_the_region_fails_at_once() {
    let f = fixture("m@w=1", Some(ROWS), Lower::default());
    f.tier.submit_store(1, keys(2), vec![0, ROWS]);
    f.tier.submit_load(2, keys(1), vec![0, 1]);
    let done = wait_finished(&f.tier, 2);
    assert!(done.iter().all(|d| !d.success), "{done:?}");
    assert_eq!(f.tier.in_flight(), 0);
}

#[test]
fn the_pool_config_is_fitted_to_one_row_per_chunk_and_a_bad_one_is_refused() {
    let mut base = PoolConfig::default();
    base.tiers.push(TierConfig::new("memory://"));
    let config = pool_config_for_offload_tier(&base, "m@w=1|kv=ab", 4, 1 << 20).unwrap();
    assert_eq!(config.chunk_bytes().unwrap(), 1 << 20);
    assert_eq!(config.key_scope().unwrap().world_size, 4);
    assert!(pool_config_for_offload_tier(&base, "m", 1, 3).is_err());
    let mut small = base.clone();
    small.local_cpu.max_size = kvpool_core::ByteSize(64 << 10);
    let err = pool_config_for_offload_tier(&small, "m", 1, 1 << 20).unwrap_err();
    assert!(err.to_string().contains("local_cpu.max_size"), "{err}");
}

#[test]
fn a_load_with_a_missing_middle_key_loads_the_prefix_only_and_forgets_the_rest() {
    let lower = Lower::default();
    let f = fixture("m@w=1", None, lower.clone());
    f.tier.submit_store(1, keys(3), vec![0, 1, 2]);
    assert!(wait_finished(&f.tier, 1)[0].success);
    f.runtime.block_on(f.tier.storage.flush()).unwrap();
    for k in keys(3) {
        assert_eq!(lookup_until_answered(&f.tier, &k), TierLookup::Hit);
    }
    let middle = f.tier.key_of(&keys(3)[1]).to_string();
    f.runtime
        .block_on(lower.inner().batch_delete(&[middle]))
        .unwrap();
    let before = region_copy(&f);
    f.tier.submit_load(2, keys(3), vec![5, 6, 7]);
    let done = wait_finished(&f.tier, 1);
    assert_eq!(
        (done[0].success, done[0].loaded),
        (false, Some(1)),
        "{done:?}"
    );
    assert_eq!(row(&f, 5), row(&f, 0));
    assert_eq!(
        &f.region[6 * ROW..],
        &before[6 * ROW..],
        "rows after the prefix untouched"
    );
    // The keys that did not load are no longer remembered hits (vLLM would promote them again).
    assert_eq!(f.tier.lookup(&keys(3)[1]), TierLookup::Miss);
    assert_eq!(f.tier.lookup(&keys(3)[2]), TierLookup::Miss);
}

#[test]
fn after_a_reset_nothing_stored_before_is_found() {
    let f = fixture("m@w=1", Some(ROWS), Lower::default());
    f.tier.submit_store(1, keys(2), vec![0, 1]);
    assert!(wait_finished(&f.tier, 1)[0].success);
    f.runtime.block_on(f.tier.storage.flush()).unwrap();
    assert_eq!(lookup_until_answered(&f.tier, &keys(1)[0]), TierLookup::Hit);
    f.tier.reset();
    assert_eq!(
        lookup_until_answered(&f.tier, &keys(1)[0]),
        TierLookup::Miss
    );
    f.tier.submit_store(2, keys(1), vec![2]);
    assert!(wait_finished(&f.tier, 1)[0].success);
    assert_eq!(lookup_until_answered(&f.tier, &keys(1)[0]), TierLookup::Hit);
}

#[test]
fn a_job_or_lookup_that_dies_still_answers() {
    let f = fixture("m@w=1", Some(ROWS), Lower::default());
    let job = f.tier.start(7, &keys(2), vec![0, 1], true).unwrap();
    assert_eq!(f.tier.in_flight(), 1);
    drop(job); // as when its task panics or the runtime shuts down
    let done = wait_finished(&f.tier, 1);
    assert_eq!(
        (done[0].job_id, done[0].success, done[0].loaded),
        (7, false, Some(0))
    );
    assert_eq!(f.tier.in_flight(), 0);

    let hash = f.tier.key_of(&[5; 36]).hash;
    f.tier
        .shared
        .lookups
        .lock()
        .answers
        .insert(hash, Remembered::Pending);
    assert_eq!(f.tier.lookup(&[5; 36]), TierLookup::Retry);
    drop(LookupRead {
        shared: f.tier.shared.clone(),
        hash,
        answered: false,
    });
    assert_eq!(f.tier.lookup(&[5; 36]), TierLookup::Miss);
}

#[test]
fn after_close_jobs_fail_and_lookups_miss() {
    let f = fixture("m@w=1", Some(ROWS), Lower::default());
    f.tier.submit_store(1, keys(1), vec![0]);
    assert!(wait_finished(&f.tier, 1)[0].success);
    f.tier.close().unwrap();
    assert_eq!(f.tier.lookup(&keys(1)[0]), TierLookup::Miss);
    f.tier.submit_load(2, keys(1), vec![3]);
    let done = wait_finished(&f.tier, 1);
    assert!(!done[0].success);
}
