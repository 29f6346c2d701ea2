use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_backends::{ControlledFaults, InMemoryConnector, LocalCpuBackend, TimeoutConnector};
use kvpool_core::{
    ChunkCodec, EvictionKind, HashAlgorithm, KeyScope, PoolConfig, RemoteBackend, StorageManager,
};

use super::*;
use crate::host_spans::{HostSpan, page_spans};
use crate::opaque_values::{ValueScope, pool_config_for_values};

/// A host pool in SGLang's `layer_first` layout: `[K|V][layer][slot]`, one segment of `SEG`
/// bytes per (K or V, layer, page slot), so a page's four segments lie far apart.
const LAYERS: usize = 2;
const SEG: usize = 512;
const SLOTS: usize = 8;
const PAGE: usize = 2 * LAYERS * SEG;

type Lower = ControlledFaults<InMemoryConnector>;

struct Fixture {
    store: HiCacheStore,
    host: Vec<u8>,
    lower: Lower,
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

fn scope(model: &str, rank: u32) -> KeyScope {
    let scope = ValueScope {
        model,
        world_size: 2,
        rank,
        pp_rank: 0,
    };
    let config = pool_config_for_values(&PoolConfig::default(), scope, PAGE, "pages").unwrap();
    config.key_scope().unwrap()
}

/// A store for `model` on `rank` over an optional L1 of `l1_pages` pages and one lower tier
/// in process memory behind fault switches; the host pool is filled with `seed`-dependent
/// bytes.
fn fixture(model: &str, rank: u32, l1_pages: Option<usize>, lower: Lower, writer: bool) -> Fixture {
    let runtime = runtime();
    let bounded = TimeoutConnector::new(lower.clone(), Duration::from_millis(300));
    let mut builder = StorageManager::builder();
    if let Some(pages) = l1_pages {
        let cpu = Arc::new(LocalCpuBackend::new(pages * PAGE, EvictionKind::Lru).unwrap());
        builder = builder.l1(cpu.clone(), cpu);
    }
    let storage = {
        let _inside = runtime.enter();
        Arc::new(
            builder
                .lower(Arc::new(RemoteBackend::new(
                    bounded,
                    ChunkCodec::default(),
                    PAGE as u64,
                )))
                .build()
                .unwrap(),
        )
    };
    let host = (0..SLOTS * PAGE)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect();
    let store = HiCacheStore::new(
        storage,
        runtime,
        scope(model, rank),
        PAGE,
        16,
        HashAlgorithm::default(),
        writer,
    );
    Fixture { store, host, lower }
}

/// The spans of host slot `slot`, in `get_page_buffer_meta`'s order for `layer_first`
/// (per layer: K, then V).
fn spans(f: &mut Fixture, slot: usize) -> PageSpans {
    let base = f.host.as_mut_ptr() as usize;
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        for kv in 0..2 {
            let offset = ((kv * LAYERS + layer) * SLOTS + slot) * SEG;
            out.push(HostSpan {
                addr: base + offset,
                len: SEG,
            });
        }
    }
    out
}

/// Slot `slot`'s bytes, in span order.
fn page(f: &mut Fixture, slot: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for span in spans(f, slot) {
        let offset = span.addr - f.host.as_ptr() as usize;
        out.extend_from_slice(&f.host[offset..offset + span.len]);
    }
    out
}

fn keys(range: std::ops::Range<u8>) -> Vec<String> {
    range.map(|i| format!("{i:064x}")).collect()
}

fn write(f: &mut Fixture, keys: &[String], slots: &[usize]) -> Vec<bool> {
    let pages: Vec<PageSpans> = slots.iter().map(|&s| spans(f, s)).collect();
    // SAFETY: the spans lie in the fixture's host buffer, which outlives the call.
    unsafe { f.store.write_pages(keys, &pages) }
}

fn read(f: &mut Fixture, keys: &[String], slots: &[usize]) -> Vec<bool> {
    let pages: Vec<PageSpans> = slots.iter().map(|&s| spans(f, s)).collect();
    // SAFETY: as in `write`; nothing else touches the buffer during the call.
    unsafe { f.store.read_pages(keys, &pages) }
}

fn flush(f: &Fixture) {
    f.store.runtime.block_on(f.store.storage.flush()).unwrap();
}

/// A store with no L1 over `lower`, pages 0 and 1 written from host slots 0 and 1 and in the
/// lower tier.
fn two_pages_in(lower: &Lower) -> Fixture {
    let mut f = fixture("m@w=1", 0, None, lower.clone(), true);
    assert_eq!(write(&mut f, &keys(0..2), &[0, 1]), vec![true; 2]);
    flush(&f);
    f
}

/// Reads pages 0 and 1 of [`two_pages_in`] into slots 4 and 5 and checks both arrived.
fn assert_both_pages_read(f: &mut Fixture) {
    assert_eq!(read(f, &keys(0..2), &[4, 5]), vec![true; 2]);
    assert_eq!(page(f, 4), page(f, 0));
    assert_eq!(page(f, 5), page(f, 1));
}

#[test]
fn pages_written_from_scattered_spans_read_back_byte_exact_into_other_slots() {
    for l1 in [Some(SLOTS), None] {
        let mut f = fixture("m@w=1", 0, l1, Lower::default(), true);
        let want: Vec<Vec<u8>> = (0..3).map(|s| page(&mut f, s)).collect();
        assert_eq!(write(&mut f, &keys(0..3), &[0, 1, 2]), vec![true; 3]);
        flush(&f);
        assert_eq!(f.lower.inner().len(), 3, "written behind to the lower tier");
        assert_eq!(f.store.existing_prefix(&keys(0..3)), 3, "l1 {l1:?}");

        assert_eq!(read(&mut f, &keys(0..3), &[5, 6, 7]), vec![true; 3]);
        for (s, want) in [5, 6, 7].into_iter().zip(&want) {
            assert_eq!(&page(&mut f, s), want, "slot {s}, l1 {l1:?}");
        }
        let stats = f.store.take_call_stats();
        assert_eq!(stats.reads.len(), 1);
        assert_eq!(stats.writes.len(), 1);
        assert_eq!(stats.reads[0].pages, 3);
        assert_eq!(stats.writes[0].bytes, 3 * PAGE as u64);
        assert_eq!(f.store.take_call_stats(), CallStats::default(), "drained");
    }
}

#[test]
fn existing_prefix_and_reads_stop_at_the_first_missing_page() {
    let mut f = fixture("m@w=1", 0, Some(SLOTS), Lower::default(), true);
    let k = keys(0..4);
    assert_eq!(
        write(
            &mut f,
            &[k[0].clone(), k[1].clone(), k[3].clone()],
            &[0, 1, 3]
        ),
        vec![true; 3]
    );
    assert_eq!(f.store.existing_prefix(&k), 2, "page 2 is missing");
    assert_eq!(f.store.existing_prefix(&k[2..]), 0);
    let untouched = page(&mut f, 7);
    assert_eq!(
        read(&mut f, &k, &[4, 5, 6, 7]),
        vec![true, true, false, false]
    );
    assert_eq!(
        page(&mut f, 7),
        untouched,
        "nothing written past the prefix"
    );
    assert_eq!(f.store.totals().pages_missed, 2);
}

#[test]
fn other_weights_another_rank_and_a_misplaced_or_corrupt_value_are_misses_never_data() {
    let lower = Lower::default();
    let mut writer = fixture("m@w=1", 0, None, lower.clone(), true);
    assert_eq!(write(&mut writer, &keys(0..2), &[0, 1]), vec![true; 2]);
    flush(&writer);

    for (model, rank) in [("m@w=2", 0), ("m@w=1", 1)] {
        let mut other = fixture(model, rank, None, lower.clone(), true);
        assert_eq!(
            other.store.existing_prefix(&keys(0..2)),
            0,
            "{model} rank {rank}"
        );
        let before = other.host.clone();
        assert_eq!(read(&mut other, &keys(0..2), &[4, 5]), vec![false; 2]);
        assert_eq!(other.host, before, "nothing written");
    }

    // Page 1's value copied under page 0 (a misplaced value), and page 1's corrupted.
    let mut reader = fixture("m@w=1", 0, None, lower.clone(), true);
    let k0 = reader.store.key_of(&keys(0..1)[0]).to_string();
    let k1 = reader.store.key_of(&keys(1..2)[0]).to_string();
    let v1 = lower.inner().raw(&k1).unwrap();
    lower.inner().insert_raw(&k0, v1.clone());
    let mut corrupt = v1.to_vec();
    *corrupt.last_mut().unwrap() ^= 1;
    lower.inner().insert_raw(&k1, Bytes::from(corrupt));
    let before = reader.host.clone();
    assert_eq!(read(&mut reader, &keys(0..2), &[4, 5]), vec![false; 2]);
    assert_eq!(reader.host, before, "nothing written");
    assert_eq!(
        reader.store.existing_prefix(&keys(0..2)),
        0,
        "bad values were deleted"
    );
}

#[test]
fn spans_that_do_not_add_up_to_a_page_are_refused_and_nothing_moves() {
    let mut f = fixture("m@w=1", 0, Some(SLOTS), Lower::default(), true);
    let mut short = vec![spans(&mut f, 0)];
    short[0].pop();
    // SAFETY: the spans lie in the fixture's host buffer.
    let written = unsafe { f.store.write_pages(&keys(0..1), &short) };
    assert_eq!(written, vec![false]);
    assert_eq!(f.store.existing_prefix(&keys(0..1)), 0);
    assert_eq!(write(&mut f, &keys(0..1), &[0]), vec![true]);
    let before = f.host.clone();
    // SAFETY: as above.
    let read_back = unsafe { f.store.read_pages(&keys(0..1), &short) };
    assert_eq!(read_back, vec![false]);
    // Keys and pages that differ in number.
    assert_eq!(read(&mut f, &keys(0..2), &[3]), vec![false; 2]);
    assert_eq!(f.host, before);
    assert_eq!(f.store.totals().pages_refused, 1);
    // Lengths whose sum wraps to exactly a page (the defect: the sum wrapped in a release
    // build, and overflowed in a debug one) are refused too; nothing is read through them.
    let mut wrapping = spans(&mut f, 1);
    wrapping[0].len = usize::MAX;
    // usize::MAX + (2 * SEG + 1) wraps to 2 * SEG: with the other 2 * LAYERS - 2 spans, PAGE.
    wrapping[1].len = 2 * SEG + 1;
    let total = wrapping
        .iter()
        .fold(0usize, |sum, s| sum.wrapping_add(s.len));
    assert_eq!(total, PAGE, "the lengths wrap to one page");
    // SAFETY: the call is refused before any span is touched (what this test checks).
    let written = unsafe { f.store.write_pages(&keys(0..1), &[wrapping]) };
    assert_eq!(written, vec![false]);
}

#[test]
fn a_rank_that_does_not_write_accepts_pages_and_reads_the_writers() {
    let lower = Lower::default();
    let mut follower = fixture("m@w=1", 0, None, lower.clone(), false);
    assert_eq!(write(&mut follower, &keys(0..2), &[0, 1]), vec![true; 2]);
    flush(&follower);
    assert_eq!(lower.inner().len(), 0, "the follower stored nothing");

    let mut writer = fixture("m@w=1", 0, None, lower.clone(), true);
    let want = page(&mut writer, 2);
    assert_eq!(write(&mut writer, &keys(5..6), &[2]), vec![true]);
    flush(&writer);
    assert_eq!(lower.inner().len(), 1);
    assert_eq!(read(&mut follower, &keys(5..6), &[6]), vec![true]);
    assert_eq!(page(&mut follower, 6), want);
}

#[test]
fn a_dead_lower_tier_is_a_miss_within_its_timeout_then_recovers() {
    let lower = Lower::default();
    let mut f = two_pages_in(&lower);
    lower
        .switches()
        .hang
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(f.store.existing_prefix(&keys(0..2)), 0);
    let before = f.host.clone();
    assert_eq!(read(&mut f, &keys(0..2), &[4, 5]), vec![false; 2]);
    assert_eq!(f.host, before);
    lower
        .switches()
        .hang
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(f.store.existing_prefix(&keys(0..2)), 2);
    assert_both_pages_read(&mut f);
}

#[test]
fn after_clear_nothing_stored_before_is_found_and_after_close_calls_are_refused() {
    let mut f = fixture("m@w=1", 0, Some(SLOTS), Lower::default(), true);
    assert_eq!(write(&mut f, &keys(0..2), &[0, 1]), vec![true; 2]);
    f.store.clear();
    assert_eq!(f.store.existing_prefix(&keys(0..2)), 0);
    assert_eq!(read(&mut f, &keys(0..2), &[4, 5]), vec![false; 2]);
    assert_eq!(write(&mut f, &keys(0..1), &[2]), vec![true]);
    assert_eq!(
        f.store.existing_prefix(&keys(0..1)),
        1,
        "new pages are found"
    );

    f.store.close().unwrap();
    f.store.close().unwrap();
    assert_eq!(f.store.existing_prefix(&keys(0..1)), 0);
    assert_eq!(write(&mut f, &keys(3..4), &[3]), vec![false]);
    assert_eq!(read(&mut f, &keys(0..1), &[6]), vec![false]);
}

#[test]
fn flat_segment_lists_split_into_pages_in_order_and_bad_ones_are_refused() {
    let pages = page_spans(2, &[10, 20, 30, 40], &[1, 2, 3, 4]).unwrap();
    assert_eq!(
        pages,
        vec![
            vec![HostSpan { addr: 10, len: 1 }, HostSpan { addr: 20, len: 2 }],
            vec![HostSpan { addr: 30, len: 3 }, HostSpan { addr: 40, len: 4 }],
        ]
    );
    assert!(page_spans(0, &[], &[]).unwrap().is_empty());
    assert!(page_spans(3, &[10, 20, 30, 40], &[1, 2, 3, 4]).is_err());
    assert!(page_spans(2, &[10, 20], &[1]).is_err());
    assert!(page_spans(1, &[0], &[1]).is_err());
    // A span whose end wraps the address space (`addr + len` overflows).
    let err = page_spans(1, &[usize::MAX - 4], &[16]).unwrap_err();
    assert!(err.contains("past the end of the address space"), "{err}");
}

#[test]
fn a_sharing_store_keeps_its_pages_apart_answers_per_page_and_leaves_the_tiers_open() {
    let mut f = fixture("m@w=1", 0, Some(SLOTS), Lower::default(), true);
    // A second host pool's store (a Mamba state per page: smaller pages, another scope).
    let side = f.store.sharing(scope("m@w=1|pool=mamba", 0), SEG, 1);
    let ks = keys(0..4);
    // The side store holds states at pages 1 and 3 only, one segment of slot 0 each.
    let state = HostSpan {
        addr: f.host.as_mut_ptr() as usize,
        len: SEG,
    };
    let two = [ks[1].clone(), ks[3].clone()];
    // SAFETY: the span lies in the fixture's host buffer, which outlives the call.
    let wrote = unsafe { side.write_pages(&two, &[vec![state], vec![state]]) };
    assert_eq!(wrote, vec![true; 2]);
    assert_eq!(side.presence(&ks), vec![false, true, false, true]);
    assert_eq!(side.existing_prefix(&ks), 0, "page 0 holds no state");
    // The same page hashes under the KV store's scope are other keys.
    assert_eq!(f.store.presence(&ks), vec![false; 4]);
    assert_eq!(write(&mut f, &ks[..2], &[0, 1]), vec![true; 2]);
    assert_eq!(f.store.presence(&ks), vec![true, true, false, false]);
    assert_eq!(side.presence(&ks), vec![false, true, false, true]);
    // A state read back equals the bytes written.
    let mut back = vec![0u8; SEG];
    let into = HostSpan {
        addr: back.as_mut_ptr() as usize,
        len: SEG,
    };
    // SAFETY: `back` outlives the call and nothing else touches it.
    let read = unsafe { side.read_pages(&ks[1..2], &[vec![into]]) };
    assert_eq!(read, vec![true]);
    assert_eq!(back, f.host[..SEG]);
    // Closing the side store leaves the KV store's tiers open.
    side.close().unwrap();
    assert_eq!(side.presence(&ks[1..2]), vec![false]);
    assert_eq!(f.store.existing_prefix(&ks), 2);
}

/// A tier read that its timeout gave up on and that hands its values over later (a blocking
/// read finishing in the background) writes nothing into SGLang's host slots once the read
/// returned: the slots may be SGLang's again by then.
#[test]
fn a_tier_read_given_up_on_writes_nothing_into_the_host_slots_afterwards() {
    let lower = Lower::default();
    let mut f = two_pages_in(&lower);
    // Visits 600 ms after the read started; the tier's timeout is 300 ms.
    lower
        .switches()
        .late_visit_ms
        .store(600, std::sync::atomic::Ordering::SeqCst);
    let before = f.host.clone();
    assert_eq!(read(&mut f, &keys(0..2), &[4, 5]), vec![false; 2]);
    std::thread::sleep(Duration::from_millis(800));
    assert!(f.host == before, "a late visit wrote into the host slots");
    // Visited in time, the same read copies both pages.
    lower
        .switches()
        .late_visit_ms
        .store(50, std::sync::atomic::Ordering::SeqCst);
    assert_both_pages_read(&mut f);
}
