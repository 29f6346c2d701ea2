//! Loads and saves through the node's pool daemon with one copy. A load: a lookup pins the
//! daemon's chunks where they lie in shared memory, the load copies each straight into the
//! engine's blocks, and the worker checks the copy there. A save: the daemon lends places in
//! its memory, the save copies each chunk straight into one, and the worker seals it with a
//! checksum hashed from the blocks. A real daemon on a socket in a temp dir; the engine side is
//! the simulator's (host KV blocks, as vLLM's CPU build has). An engine whose blocks the
//! worker cannot read (a GPU's) takes the staged route instead: its side reads each chunk
//! once into a buffer the job names, fills the blocks from that copy, and the worker checks
//! the buffer (`EngineWorker::new_staging`).

mod protocol_fixture;

use std::sync::Arc;

use kvpool_backends::daemon::{DaemonOptions, DaemonServer, PoolDaemon, SocketAccess};
use kvpool_connector::host_blocks::run_copy_job;
use kvpool_connector::{BlockUpdate, ConnectorMetadata, LeasedChunk};
use kvpool_core::memory::EvictionKind;
use kvpool_sim::kv_model::model_mismatches;
use protocol_fixture::*;

struct Daemon {
    daemon: Arc<PoolDaemon>,
    _server: DaemonServer,
    _runtime: tokio::runtime::Runtime,
    url: String,
    _dir: tempfile::TempDir,
}

fn daemon() -> Daemon {
    daemon_lending_for(kvpool_backends::daemon::DEFAULT_LEASE_TTL)
}

/// A daemon whose pins and allocations live `lease_ttl` (engines use them for half of it).
fn daemon_lending_for(lease_ttl: std::time::Duration) -> Daemon {
    daemon_over(lease_ttl, Vec::new())
}

/// A daemon over the lower tiers `tiers`.
fn daemon_over(
    lease_ttl: std::time::Duration,
    tiers: Vec<Arc<dyn kvpool_core::RemoteConnector>>,
) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvpool.sock");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let options = DaemonOptions {
        tenant: "default".into(),
        capacity: 64 << 20,
        eviction: EvictionKind::Lru,
        lease_ttl,
        write_behind_quota: 16 << 20,
        copy_buffer_bytes: kvpool_backends::daemon::default_copy_buffer_bytes(64 << 20),
    };
    let daemon =
        Arc::new(PoolDaemon::with_tiers(options, tiers, runtime.handle().clone()).unwrap());
    let server = DaemonServer::bind(daemon.clone(), &path, SocketAccess::default()).unwrap();
    Daemon {
        daemon,
        _server: server,
        _runtime: runtime,
        url: format!("kvpool+unix://{}", path.display()),
        _dir: dir,
    }
}

/// An engine that stored `p` through the daemon (it reaches the daemon behind L1), gone.
fn stored_by_another_engine(d: &Daemon, p: &[u32]) {
    let mut writer = setup_tiered(&d.url);
    writer.seed_pool(p);
    writer
        .runtime
        .block_on(writer.engine.storage().flush())
        .unwrap();
    assert_eq!(d.daemon.stats().entries as usize, p.len() / CHUNK);
}

/// A request of `p` in a fresh engine: looked up (`stored` tokens hit, leased) and allocated
/// `blocks`; returns its connector metadata for the step that loads it.
fn looked_up(
    s: &mut Setup,
    p: &[u32],
    stored: usize,
    blocks: &[u32],
) -> kvpool_connector::ConnectorMetadata {
    let hit = s.sched.get_num_new_matched_tokens(&request("r", p), 0);
    assert_eq!(
        hit,
        (stored, false),
        "a synchronous load of the daemon's chunks"
    );
    s.sched.update_state_after_alloc("r", blocks, hit.0);
    s.sched.build_connector_meta(&[scheduled(
        "r",
        BlockUpdate::Replace(blocks.to_vec()),
        p.len(),
    )])
}

#[test]
fn the_daemons_chunks_are_copied_once_into_the_blocks_and_checked_there() {
    let d = daemon();
    let p = prompt(3 * CHUNK + 1, 3);
    stored_by_another_engine(&d, &p[..3 * CHUNK]);
    let mut s = setup_tiered(&d.url);
    let blocks: Vec<u32> = (10..17).collect();
    let meta = looked_up(&mut s, &p, 3 * CHUNK, &blocks);
    // The lease holds the daemon's chunks where they lie: nothing was copied into L1.
    assert_eq!(s.engine.storage().stats().tiers[0].backend.entries, 0);
    assert_eq!(d.daemon.stats().pins, 3, "the lease pins the three chunks");
    let failed = s.worker_step(&meta, &[]);
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(
        model_mismatches(&s.w.kv, &p[..3 * CHUNK], &blocks[..6]),
        0,
        "the blocks hold the stored KV"
    );
    let trace = s.w.worker.stats();
    assert_eq!(trace.loaded_tokens as usize, 3 * CHUNK);
    assert_eq!(trace.failed_load_blocks, 0);
    assert_eq!(
        trace.saved_tokens, 0,
        "what the load brought is not saved again"
    );
    assert_eq!(
        s.engine.storage().stats().tiers[0].backend.entries,
        0,
        "still nothing in L1: one copy, from the daemon's memory into the blocks"
    );
    // The pins are released on the session's next call: nothing stays pinned.
    s.pool_hit(&p);
    assert_eq!(d.daemon.stats().pins, 0);
}

/// Another process writes into the payload of chunk `index` of `req`'s lease after the lookup
/// checked its header (a misbehaving engine, or a pin the daemon reclaimed and lent again).
fn change_leased_chunk(s: &mut Setup, req: &str, index: usize) {
    let lease = s.w.worker.leases().take(req).unwrap();
    let LeasedChunk::Shared { chunk, .. } = &lease.chunks[index].1 else {
        panic!("the lookup leases the daemon's chunk where it lies")
    };
    // SAFETY: the pinned payload lies in the engine's mapping of the daemon's arena, which
    // the chunk keeps mapped; the test plays the other process writing into it.
    unsafe { *((chunk.payload_ptr() + 100) as *mut u8) ^= 0x40 };
    s.w.worker.leases().grant(req, lease.chunks);
}

/// Makes `s`'s rank one whose blocks the worker cannot read, as a GPU engine's: it stages
/// its copies from node memory for the worker to check.
fn staging(s: &mut Setup) {
    let leases = s.w.worker.leases().clone();
    s.w = kvpool_sim::engine_side::EngineWorker::new_staging(
        s.engine.clone(),
        s.runtime.clone(),
        leases,
        *s.engine.layout(),
        64,
    )
    .unwrap();
}

#[test]
fn a_staging_engine_reads_the_daemons_chunks_once_and_checks_the_staged_copy() {
    // The GPU route, on host blocks: the lookup pins the chunks where they lie (nothing goes
    // through L1), the engine side reads each once into the job's buffer and fills the blocks
    // from it, and the worker checks the buffer behind the forward pass.
    let d = daemon();
    let p = prompt(3 * CHUNK + 1, 13);
    stored_by_another_engine(&d, &p[..3 * CHUNK]);
    let mut s = setup_tiered(&d.url);
    staging(&mut s);
    let blocks: Vec<u32> = (10..17).collect();
    let meta = looked_up(&mut s, &p, 3 * CHUNK, &blocks);
    assert_eq!(s.engine.storage().stats().tiers[0].backend.entries, 0);
    assert_eq!(d.daemon.stats().pins, 3, "the lease pins the three chunks");
    s.w.begin_step(&meta.encode()).unwrap();
    assert_eq!(
        s.w.worker.in_flight().0,
        1,
        "the staged copies are checked behind the forward pass"
    );
    let out = s.w.end_step(&[]);
    let failed = s.report(&[out]);
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(model_mismatches(&s.w.kv, &p[..3 * CHUNK], &blocks[..6]), 0);
    let stats = s.w.worker.stats();
    assert_eq!(stats.loaded_tokens as usize, 3 * CHUNK);
    assert_eq!(stats.node_memory_tokens as usize, 3 * CHUNK);
    assert_eq!(stats.node_memory_staged_tokens as usize, 3 * CHUNK);
    assert_eq!(stats.heap_buffers, 0, "L1's pool had room for the buffers");
    assert_eq!(
        s.engine.storage().stats().tiers[0].backend.entries,
        0,
        "the staged copies are not stored in L1"
    );
    s.pool_hit(&p);
    assert_eq!(d.daemon.stats().pins, 0);
}

#[test]
fn with_l1_full_a_staged_load_takes_its_buffers_from_the_heap_and_counts_them() {
    // On a GPU a copy into heap memory waits for the device: slower, still exact. The
    // worker says so (`heap_buffers`) instead of failing the load.
    let d = daemon();
    let p = prompt(3 * CHUNK + 1, 17);
    stored_by_another_engine(&d, &p[..3 * CHUNK]);
    let mut s = setup_tiered(&d.url);
    staging(&mut s);
    let blocks: Vec<u32> = (10..17).collect();
    let meta = looked_up(&mut s, &p, 3 * CHUNK, &blocks);
    // Everything L1's pool has, held by someone else for the step.
    let chunk_bytes = s.engine.layout().chunk_bytes(CHUNK);
    let mut held = Vec::new();
    while let Ok(buf) = s.engine.storage().allocate(chunk_bytes) {
        held.push(buf);
    }
    assert!(!held.is_empty());
    let failed = s.worker_step(&meta, &[]);
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(model_mismatches(&s.w.kv, &p[..3 * CHUNK], &blocks[..6]), 0);
    let stats = s.w.worker.stats();
    assert_eq!(stats.node_memory_staged_tokens as usize, 3 * CHUNK);
    assert_eq!(stats.heap_buffers, 3, "one buffer per chunk, from the heap");
    drop(held);
    s.pool_hit(&p);
    assert_eq!(d.daemon.stats().pins, 0);
}

/// Loads `chunks` chunks the daemon holds into a fresh engine (one that stages its copies if
/// `staged`), with chunk `changed` written by another process after the lookup: its blocks
/// and every later one must be reported failed, the chunks before it loaded, and nothing in
/// the blocks used as KV unchecked.
fn a_chunk_changed_after_the_lookup_fails_from_it_on(
    chunks: usize,
    changed: usize,
    seed: u32,
    staged: bool,
) {
    let d = daemon();
    let p = prompt(chunks * CHUNK + 1, seed);
    stored_by_another_engine(&d, &p[..chunks * CHUNK]);
    let mut s = setup_tiered(&d.url);
    if staged {
        staging(&mut s);
    }
    let blocks: Vec<u32> = (0..2 * chunks as u32 + 1).collect();
    let meta = looked_up(&mut s, &p, chunks * CHUNK, &blocks);
    change_leased_chunk(&mut s, "r", changed);
    // The step's copies run at its start; their checks go on behind the forward pass and
    // are settled, failed blocks known, by the step's end (vLLM asks for them after it).
    s.w.begin_step(&meta.encode()).unwrap();
    assert_eq!(
        s.w.worker.in_flight().0,
        1,
        "the load's checks run behind the forward pass, not in start_load_kv"
    );
    let out = s.w.end_step(&[]);
    assert_eq!(s.w.worker.in_flight().0, 0, "settled by the step's end");
    let failed = s.report(&[out]);
    // The changed chunk's blocks and everything after it are reported, so the engine
    // recomputes them; the chunks before it checked and stay.
    let kept = 2 * changed;
    assert_eq!(failed, blocks[kept..2 * chunks]);
    assert_eq!(
        model_mismatches(&s.w.kv, &p[..changed * CHUNK], &blocks[..kept]),
        0
    );
    assert_eq!(s.w.worker.stats().loaded_tokens as usize, changed * CHUNK);
    assert_eq!(
        s.pool_hit(&p),
        changed * CHUNK,
        "the chunk that failed its check was deleted (the ones after it are unreachable)"
    );
    assert_eq!(
        d.daemon.stats().pins,
        0,
        "the failed load's pins are released too"
    );
}

#[test]
fn a_chunk_changed_in_shared_memory_after_the_lookup_is_a_failed_load_never_kv() {
    a_chunk_changed_after_the_lookup_fails_from_it_on(3, 1, 4, false);
}

#[test]
fn a_chunk_changed_late_in_a_long_load_fails_from_it_on_and_keeps_the_ones_before() {
    a_chunk_changed_after_the_lookup_fails_from_it_on(7, 5, 9, false);
}

#[test]
fn a_chunk_changed_in_shared_memory_fails_its_staged_copys_check_never_kv() {
    a_chunk_changed_after_the_lookup_fails_from_it_on(3, 1, 14, true);
    a_chunk_changed_after_the_lookup_fails_from_it_on(4, 0, 15, true);
}

#[test]
fn without_the_engines_blocks_in_host_memory_the_daemons_chunks_go_through_l1() {
    // A worker that cannot read the blocks (a GPU engine's) never leases shared memory: the
    // lookup copies the chunks into L1 and checks them there, as before.
    let d = daemon();
    let p = prompt(CHUNK + 1, 5);
    stored_by_another_engine(&d, &p[..CHUNK]);
    let mut s = setup_tiered(&d.url);
    s.w.worker.leases().set_checks_copies(false);
    let blocks: Vec<u32> = (0..3).collect();
    let meta = looked_up(&mut s, &p, CHUNK, &blocks);
    assert_eq!(
        s.engine.storage().stats().tiers[0].backend.entries,
        1,
        "promoted into L1"
    );
    let failed = s.worker_step(&meta, &[]);
    assert!(failed.is_empty());
    assert_eq!(model_mismatches(&s.w.kv, &p[..CHUNK], &blocks[..2]), 0);
}

/// Schedules a request `id` of `p` that nothing in the pool covers, into `blocks`: the
/// metadata of the step that computes it all (and saves it).
fn computed_in_one_step(s: &mut Setup, id: &str, p: &[u32], blocks: &[u32]) -> ConnectorMetadata {
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request(id, p), 0),
        (0, false)
    );
    s.sched.update_state_after_alloc(id, blocks, 0);
    s.sched.build_connector_meta(&[scheduled(
        id,
        BlockUpdate::Replace(blocks.to_vec()),
        p.len(),
    )])
}

#[test]
fn a_save_is_copied_once_into_the_daemons_memory_and_another_engine_loads_it() {
    a_save_is_copied_once_into_the_daemons_memory(false);
}

#[test]
fn a_staging_engines_save_is_copied_once_into_the_daemons_memory_and_sealed_from_its_copy() {
    a_save_is_copied_once_into_the_daemons_memory(true);
}

/// Engine A (one that stages its copies if `staged`) saves a prompt with one copy into places
/// the daemon lends; another engine loads it with the right KV.
fn a_save_is_copied_once_into_the_daemons_memory(staged: bool) {
    let d = daemon();
    let p = prompt(3 * CHUNK + 1, 6);
    let mut a = setup_tiered(&d.url);
    if staged {
        staging(&mut a);
    }
    let blocks: Vec<u32> = (0..7).collect();
    let meta = computed_in_one_step(&mut a, "a", &p, &blocks);
    let failed = a.worker_step(&meta, &[(&p, &blocks, 0..p.len())]);
    assert!(failed.is_empty(), "{failed:?}");
    a.settle();
    let stats = a.w.worker.stats();
    assert_eq!(stats.stored_tokens as usize, 3 * CHUNK, "{stats:?}");
    assert_eq!(stats.node_memory_saved_tokens as usize, 3 * CHUNK);
    assert_eq!(
        a.engine.storage().stats().tiers[0].backend.entries,
        0,
        "nothing went through L1: one copy, from the blocks into the daemon's memory"
    );
    let daemon_stats = d.daemon.stats();
    assert_eq!(daemon_stats.entries as usize, 3, "{daemon_stats:?}");
    assert_eq!(
        daemon_stats.allocations, 0,
        "every place lent was committed"
    );

    // Another engine loads them with the right KV.
    let mut b = setup_tiered(&d.url);
    let b_blocks: Vec<u32> = (20..27).collect();
    let meta = looked_up(&mut b, &p, 3 * CHUNK, &b_blocks);
    let failed = b.worker_step(&meta, &[]);
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(
        model_mismatches(&b.w.kv, &p[..3 * CHUNK], &b_blocks[..6]),
        0
    );
    assert_eq!(b.w.worker.stats().node_memory_tokens as usize, 3 * CHUNK);
}

#[test]
fn a_save_changed_in_shared_memory_before_its_seal_is_refused_by_readers_never_kv() {
    a_save_changed_in_shared_memory_before_its_seal_is_refused_by_readers(false);
}

#[test]
fn a_staged_save_changed_in_shared_memory_before_its_seal_is_refused_by_readers_never_kv() {
    a_save_changed_in_shared_memory_before_its_seal_is_refused_by_readers(true);
}

/// The checksum is hashed from the engine's blocks (or, for an engine that stages its copies
/// if `staged`, from the staged copy), not from the place the save was copied to: another
/// process writing there after the copy (a misbehaving engine) makes the value fail every
/// reader's check. Hashed from the place, the change would be vouched for.
fn a_save_changed_in_shared_memory_before_its_seal_is_refused_by_readers(staged: bool) {
    let d = daemon();
    let p = prompt(3 * CHUNK + 1, 7);
    let mut a = setup_tiered(&d.url);
    if staged {
        staging(&mut a);
    }
    let blocks: Vec<u32> = (0..7).collect();
    let meta = computed_in_one_step(&mut a, "a", &p, &blocks);
    a.w.begin_step(&meta.encode()).unwrap();
    a.compute(&p, &blocks, 0..p.len());
    let saves = a.w.worker.take_save_jobs();
    assert_eq!(saves.len(), 1);
    let job = &saves[0];
    // SAFETY: the job comes straight from this rank's worker, reported done below.
    unsafe { run_copy_job(job, &mut a.w.kv) }.unwrap();
    // SAFETY: the second chunk's place lies in the engine's mapping of the daemon's arena,
    // lent until the job is reported done; the test plays the other process writing there.
    unsafe { *((job.chunk_ptrs[1] + 100) as *mut u8) ^= 0x40 };
    a.w.worker.copy_done(job.id, true);
    let out = a.w.end_step(&[]);
    a.report(&[out]);
    a.settle();
    assert_eq!(
        d.daemon.stats().entries,
        3,
        "stored: the writer cannot tell"
    );

    let mut b = setup_tiered(&d.url);
    let b_blocks: Vec<u32> = (20..27).collect();
    let meta = looked_up(&mut b, &p, 3 * CHUNK, &b_blocks);
    let failed = b.worker_step(&meta, &[]);
    assert_eq!(
        failed,
        [22, 23, 24, 25],
        "the changed chunk on is recomputed"
    );
    assert_eq!(model_mismatches(&b.w.kv, &p[..CHUNK], &b_blocks[..2]), 0);
    assert_eq!(b.w.worker.stats().loaded_tokens as usize, CHUNK);
}

#[test]
fn with_a_tier_besides_the_daemon_saves_go_through_l1_to_reach_every_tier() {
    // One copy into a daemon would skip the other tier: with more than one tier below L1,
    // saves keep the L1 path, which writes each tier behind.
    let (d1, d2) = (daemon(), daemon());
    let p = prompt(CHUNK + 1, 8);
    let mut a = setup_tiers(&[d1.url.as_str(), d2.url.as_str()]);
    let blocks: Vec<u32> = (0..3).collect();
    let meta = computed_in_one_step(&mut a, "a", &p, &blocks);
    a.worker_step(&meta, &[(&p, &blocks, 0..p.len())]);
    a.settle();
    a.runtime.block_on(a.engine.storage().flush()).unwrap();
    assert_eq!(a.w.worker.stats().node_memory_saved_tokens, 0);
    assert_eq!(a.w.worker.stats().stored_tokens as usize, CHUNK);
    assert_eq!(
        a.engine.storage().stats().tiers[0].backend.entries,
        1,
        "in L1"
    );
    assert_eq!(
        (d1.daemon.stats().entries, d2.daemon.stats().entries),
        (1, 1)
    );
}

#[test]
fn a_prefix_the_daemon_holds_is_not_saved_again_when_the_engine_computes_it() {
    // vLLM's own prefix cache serves a prompt the engine saved before (no load): its save
    // skips what the daemon holds, as it skips what L1 holds.
    let d = daemon();
    let p = prompt(3 * CHUNK + 1, 9);
    let mut a = setup_tiered(&d.url);
    let blocks: Vec<u32> = (0..7).collect();
    let meta = computed_in_one_step(&mut a, "a", &p, &blocks);
    a.worker_step(&meta, &[(&p, &blocks, 0..p.len())]);
    a.settle();
    assert_eq!(d.daemon.stats().commits, 3);
    let saved = a.w.worker.stats().saved_tokens;

    // Request b: the same prompt in the same blocks, which vLLM's prefix cache holds.
    assert_eq!(
        a.sched
            .get_num_new_matched_tokens(&request("b", &p), 3 * CHUNK),
        (0, false)
    );
    a.sched.update_state_after_alloc("b", &blocks, 0);
    let meta = a.sched.build_connector_meta(&[scheduled(
        "b",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    a.worker_step(&meta, &[(&p, &blocks, 3 * CHUNK..p.len())]);
    a.settle();
    assert_eq!(d.daemon.stats().commits, 3, "nothing committed again");
    assert_eq!(
        a.w.worker.stats().saved_tokens,
        saved,
        "nothing copied again"
    );
}

#[test]
fn a_place_whose_loan_ran_out_before_the_copy_is_never_written() {
    // The step stalls past half the daemon's lease between planning the save and running
    // its copy: the daemon may have lent that memory to another value, so the save is
    // dropped, not written.
    let d = daemon_lending_for(std::time::Duration::from_millis(200));
    let p = prompt(CHUNK + 1, 10);
    let mut a = setup_tiered(&d.url);
    let blocks: Vec<u32> = (0..3).collect();
    let meta = computed_in_one_step(&mut a, "a", &p, &blocks);
    a.w.begin_step(&meta.encode()).unwrap();
    a.compute(&p, &blocks, 0..p.len());
    std::thread::sleep(std::time::Duration::from_millis(150));
    assert!(
        a.w.worker.take_save_jobs().is_empty(),
        "no copy into a lapsed loan"
    );
    let out = a.w.end_step(&[]);
    a.report(&[out]);
    a.settle();
    let stats = a.w.worker.stats();
    assert_eq!(
        (stats.stored_tokens, stats.save_errors),
        (0, 1),
        "{stats:?}"
    );
    assert_eq!(d.daemon.stats().entries, 0);
}

/// A staging engine loads two chunks whose first block vLLM's own prefix cache holds already,
/// so the job starts one block into chunk 0, with chunk `changed` written by another process
/// after the lookup: the staged copy of chunk 0 is checked whole, and the failed blocks run
/// from the changed chunk's first block the job copied.
fn a_staged_load_past_held_blocks_fails_from_the_changed_chunk(changed: usize) -> Vec<u32> {
    let d = daemon();
    let p = prompt(2 * CHUNK + 1, 17 + changed as u32);
    stored_by_another_engine(&d, &p[..2 * CHUNK]);
    let mut s = setup_tiered(&d.url);
    staging(&mut s);
    let blocks: Vec<u32> = (30..35).collect();
    let held = BLOCK;
    let hit = s.sched.get_num_new_matched_tokens(&request("r", &p), held);
    assert_eq!(hit, (2 * CHUNK - held, false));
    s.sched.update_state_after_alloc("r", &blocks, hit.0);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "r",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    change_leased_chunk(&mut s, "r", changed);
    s.w.begin_step(&meta.encode()).unwrap();
    let out = s.w.end_step(&[]);
    let failed = s.report(&[out]);
    // Chunk 0's blocks past the held one, when it is not the one changed: loaded, and
    // checked in its staged copy (not copied through L1 first).
    let kept = (changed * CHUNK / BLOCK).saturating_sub(1) * BLOCK;
    let stats = s.w.worker.stats();
    assert_eq!(stats.loaded_tokens as usize, kept);
    assert_eq!(stats.node_memory_staged_tokens as usize, kept);
    failed
}

#[test]
fn a_staged_first_chunk_entered_part_way_is_checked_whole() {
    let per_chunk = CHUNK / BLOCK;
    assert_eq!(
        a_staged_load_past_held_blocks_fails_from_the_changed_chunk(0),
        (31..30 + 2 * per_chunk as u32).collect::<Vec<_>>(),
        "chunk 0 changed: every block the job copied"
    );
    assert_eq!(
        a_staged_load_past_held_blocks_fails_from_the_changed_chunk(1),
        (30 + per_chunk as u32..30 + 2 * per_chunk as u32).collect::<Vec<_>>(),
        "chunk 1 changed: its blocks, not chunk 0's"
    );
}

/// `kvpool sim` through a daemon over a lower tier: a chunk the simulator removes between
/// lookup and load (the daemon's `Delete` drops shared memory's copy only) is loaded from the
/// lower tier, not lost. Before, the simulator counted its blocks as lost and, as no load
/// failed, reported them as failures never reported (16 for 200 requests).
#[test]
fn the_simulator_through_a_daemon_over_a_lower_tier_counts_only_chunks_really_lost() {
    let lower: Arc<dyn kvpool_core::RemoteConnector> =
        Arc::new(kvpool_backends::InMemoryConnector::new());
    let d = daemon_over(kvpool_backends::daemon::DEFAULT_LEASE_TTL, vec![lower]);
    let mut settings = kvpool_sim::vllm_shaped::SimSettings {
        requests: 200,
        cpu_size: kvpool_core::ByteSize(8 << 20),
        ..Default::default()
    };
    settings
        .pool
        .tiers
        .push(kvpool_core::TierConfig::new(&d.url));
    let layout = kvpool_core::KvLayout::new(
        2,
        2,
        8,
        kvpool_core::Dtype::F16,
        kvpool_core::KvKind::KeyValue,
        16,
    )
    .unwrap();
    let report = kvpool_sim::vllm_shaped::run(&settings, layout, 64).unwrap();
    assert!(report.injected_failures > 0, "{report:?}");
    assert!(report.pool_hit_tokens > 0, "{report:?}");
    assert_eq!(
        (
            report.unreported_failed_blocks,
            report.wrong_tokens,
            report.leaked_request_states
        ),
        (0, 0, 0),
        "{report:?}"
    );
}
