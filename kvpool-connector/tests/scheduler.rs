//! Scheduler-side rules, checked on a real pool.

use std::sync::Arc;

use async_trait::async_trait;
use kvpool_backends::{BackendFactory, TierRequest, register_scheme};
use kvpool_backends::{InMemoryConnector, InMemoryNodeMemory};
use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorOutput, ConnectorScheduler, EngineRequest, LeaseTable,
    ScheduledRequest,
};
use kvpool_core::{ByteSize, ConfigError, HostPagedKvCache, PoolConfig, RemoteConnector};

struct Setup {
    runtime: Arc<tokio::runtime::Runtime>,
    engine: Arc<kvpool_core::CacheEngine>,
    leases: Arc<LeaseTable>,
}

fn setup() -> Setup {
    setup_with_tier(None)
}

/// A pool with L1 and, with `tier`, that lower tier (a URL).
fn setup_with_tier(tier: Option<&str>) -> Setup {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let mut config = PoolConfig::default();
    config.local_cpu.max_size = ByteSize::mib(256);
    config.chunking.chunk_size = 16;
    config.tiers.extend(tier.map(kvpool_core::TierConfig::new));
    let engine = runtime
        .block_on(kvpool_backends::build_pool(&config))
        .unwrap()
        .engine;
    let leases = Arc::new(LeaseTable::new(
        64 << 20,
        std::time::Duration::from_secs(60),
    ));
    Setup {
        runtime,
        engine,
        leases,
    }
}

fn scheduler(s: &Setup, save_decode_tokens: bool) -> ConnectorScheduler {
    scheduler_with(
        s,
        ConnectorConfig {
            save_decode_tokens,
            ..ConnectorConfig::new(16)
        },
    )
}

/// A scheduler over `s`'s pool with `config`.
fn scheduler_with(s: &Setup, config: ConnectorConfig) -> ConnectorScheduler {
    ConnectorScheduler::new(
        s.engine.clone(),
        s.runtime.clone(),
        s.leases.clone(),
        config,
    )
}

fn request(id: &str, n: u32, skip_save: bool) -> EngineRequest {
    EngineRequest {
        req_id: id.into(),
        prompt_token_ids: (0..n).collect(),
        skip_save,
        extra_keys: Vec::new(),
    }
}

fn step(id: &str, computed: usize, new_tokens: Vec<u32>) -> ScheduledRequest {
    ScheduledRequest {
        req_id: id.into(),
        new_tokens_start: computed - new_tokens.len(),
        new_token_ids: new_tokens,
        blocks: BlockUpdate::Unchanged,
        num_computed_tokens_after_step: computed,
    }
}

/// Stores `n` tokens of the 0..n sequence in the pool.
fn store(s: &Setup, n: usize) {
    let kv = HostPagedKvCache::new(*s.engine.layout(), 64);
    let tokens: Vec<u32> = (0..n as u32).collect();
    let slots: Vec<i64> = (0..n as i64).collect();
    s.runtime
        .block_on(s.engine.store(&tokens, None, &kv, &slots))
        .unwrap();
}

#[test]
fn the_final_token_is_never_loaded_and_gpu_tokens_are_not_reloaded() {
    let s = setup();
    store(&s, 64);
    let mut sched = scheduler(&s, false);
    // 64 tokens all in the pool: at most 48 (three chunks) are offered, so one is computed.
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("a", 64, false), 0),
        (48, false)
    );
    // The GPU already has 32: only 16 more.
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("b", 64, false), 32),
        (16, false)
    );
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("c", 64, false), 48),
        (0, false)
    );
    sched.update_state_after_alloc("b", &[0, 1, 2, 3], 16);
    let meta = sched.build_connector_meta(&[step("b", 64, vec![])]);
    let load = meta.requests[0].load.unwrap();
    assert_eq!((load.gpu_cached_tokens, load.load_until), (32, 48));
    assert!(!load.asynchronous, "every chunk is leased in memory");
    assert_eq!(meta.requests[0].block_ids, [0, 1, 2, 3]);
}

#[test]
fn loads_are_asynchronous_unless_leased_in_memory_or_nothing_else_runs() {
    let s = setup();
    store(&s, 64);
    let mut sched = scheduler(&s, false);
    // Another request runs: a load leased in memory whole is still synchronous.
    sched.build_connector_meta(&[step("running", 8, vec![])]);
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("a", 64, false), 0),
        (48, false)
    );
    assert_eq!(s.leases.stats().leases, 1, "the lookup leased a's chunks");
    // A lease budget of one chunk: the rest must come from outside the lease, asynchronously.
    let small = Setup {
        runtime: s.runtime.clone(),
        engine: s.engine.clone(),
        leases: Arc::new(LeaseTable::new(1, std::time::Duration::from_secs(60))),
    };
    let mut tight = scheduler(&small, false);
    // With no other request running, a fetch before the forward pass stalls nobody.
    assert_eq!(
        tight.get_num_new_matched_tokens(&request("b", 64, false), 0),
        (48, false)
    );
    // One such load per step: a second request looked up in the same step loads in the
    // background, so the first's step does not wait for both fetches.
    assert_eq!(
        tight.get_num_new_matched_tokens(&request("c", 64, false), 0),
        (48, true)
    );
    // Asked again (vLLM could not allocate its blocks), the first keeps its promise.
    assert_eq!(
        tight.get_num_new_matched_tokens(&request("b", 64, false), 0),
        (48, false)
    );
    // With another request running, the load goes to the background so its steps go on.
    tight.build_connector_meta(&[step("running", 8, vec![])]);
    assert_eq!(
        tight.get_num_new_matched_tokens(&request("b", 64, false), 0),
        (48, true)
    );
    // Preempted or finished, it no longer runs.
    tight.request_preempted("running");
    assert_eq!(
        tight.get_num_new_matched_tokens(&request("b", 64, false), 0),
        (48, false)
    );
    tight.build_connector_meta(&[step("running", 8, vec![])]);
    tight.request_finished("running", &[]);
    assert_eq!(
        tight.get_num_new_matched_tokens(&request("b", 64, false), 0),
        (48, false)
    );
    // An engine that schedules asynchronously never loads a lower tier synchronously, idle
    // or not (a failed load would have the next step computed on it).
    let mut ahead = scheduler_with(
        &small,
        ConnectorConfig {
            async_scheduling: true,
            ..ConnectorConfig::new(16)
        },
    );
    assert_eq!(
        ahead.get_num_new_matched_tokens(&request("d", 64, false), 0),
        (48, true)
    );
    // `Leased` has no idle rule (vLLM's data-parallel ranks step in lockstep).
    let mut lockstep = scheduler_with(
        &small,
        ConnectorConfig {
            load_timing: kvpool_connector::LoadTiming::Leased,
            ..ConnectorConfig::new(16)
        },
    );
    assert_eq!(
        lockstep.get_num_new_matched_tokens(&request("e", 64, false), 0),
        (48, true)
    );
    // With asynchronous scheduling every load is asynchronous.
    let mut always = scheduler_with(
        &s,
        ConnectorConfig {
            load_timing: kvpool_connector::LoadTiming::Always,
            ..ConnectorConfig::new(16)
        },
    );
    assert_eq!(
        always.get_num_new_matched_tokens(&request("c", 64, false), 0),
        (48, true)
    );
    // An asynchronous load ships as soon as the blocks are allocated, with the request
    // unscheduled (vLLM waits for it), and the request is then waiting on it.
    always.update_state_after_alloc("c", &[4, 5, 6, 7], 48);
    let meta = always.build_connector_meta(&[]);
    assert_eq!(meta.requests.len(), 1);
    let load = meta.requests[0].load.unwrap();
    assert!(load.asynchronous && load.load_until == 48);
    assert!(meta.requests[0].save.is_none());
    assert!(always.tracker("c").unwrap().load_in_flight);
    // A request aborted with its load in flight is not held (vLLM holds it until the load ends).
    assert!(!always.request_finished("c", &[4, 5, 6, 7]));
    let next = always.build_connector_meta(&[]);
    assert_eq!(next.ended_requests, ["c"]);
    assert!(next.held_requests.is_empty());
}

#[test]
fn saves_skip_what_was_saved_cover_complete_chunks_and_honour_skip_save() {
    let s = setup();
    let mut sched = scheduler(&s, false);
    sched.get_num_new_matched_tokens(&request("a", 40, false), 0);
    sched.update_state_after_alloc("a", &[0, 1, 2], 0);
    let m1 = sched.build_connector_meta(&[step("a", 40, vec![])]);
    let save = m1.requests[0].save.unwrap();
    assert_eq!(
        (save.save_from, save.save_until),
        (0, 32),
        "complete chunks only"
    );
    // Decode tokens are not saved unless configured.
    let m2 = sched.build_connector_meta(&[step("a", 48, vec![7; 8])]);
    assert!(m2.requests.is_empty(), "nothing new to save: {m2:?}");
    let mut with_decode = scheduler(&s, true);
    with_decode.get_num_new_matched_tokens(&request("d", 40, false), 0);
    with_decode.update_state_after_alloc("d", &[0, 1, 2], 0);
    with_decode.build_connector_meta(&[step("d", 40, vec![])]);
    let m3 = with_decode.build_connector_meta(&[step("d", 48, vec![7; 8])]);
    let save = m3.requests[0].save.unwrap();
    assert_eq!(
        (save.save_from, save.save_until),
        (32, 48),
        "saves continue where they stopped"
    );

    sched.get_num_new_matched_tokens(&request("private", 40, true), 0);
    sched.update_state_after_alloc("private", &[4, 5, 6], 0);
    assert!(
        sched
            .build_connector_meta(&[step("private", 40, vec![])])
            .requests
            .is_empty()
    );
}

#[test]
fn blocks_are_held_while_a_save_may_be_copying_and_failed_loads_rewind_saves() {
    let s = setup();
    let mut sched = scheduler(&s, false);
    sched.get_num_new_matched_tokens(&request("a", 64, false), 0);
    sched.update_state_after_alloc("a", &[10, 11, 12, 13], 0);
    let m = sched.build_connector_meta(&[step("a", 64, vec![])]);
    // The save of step `m.step` is not reported copied yet: the engine holds a's blocks, and
    // the next metadata tells the workers to report a once their copies ended.
    assert!(sched.request_finished("a", &[10, 11, 12, 13]));
    assert_eq!(sched.tracked_requests(), 0);
    sched.update_connector_output(&ConnectorOutput {
        executed_steps: vec![(m.step, 1)],
        copied_steps: vec![(m.step, 1)],
        ..Default::default()
    });
    let next = sched.build_connector_meta(&[]);
    assert_eq!(next.held_requests, ["a"]);
    assert_eq!(next.commit_steps, [m.step]);
    // A request whose saves were all reported copied is freed at once.
    sched.get_num_new_matched_tokens(&request("z", 64, false), 0);
    sched.update_state_after_alloc("z", &[20, 21, 22, 23], 0);
    let m = sched.build_connector_meta(&[step("z", 64, vec![])]);
    sched.update_connector_output(&ConnectorOutput {
        executed_steps: vec![(m.step, 1)],
        copied_steps: vec![(m.step, 1)],
        ..Default::default()
    });
    assert!(!sched.request_finished("z", &[20, 21, 22, 23]));

    // A failed load in block 12 (tokens 32..48) rewinds the save point to token 32.
    sched.get_num_new_matched_tokens(&request("b", 64, false), 0);
    sched.update_state_after_alloc("b", &[10, 11, 12, 13], 0);
    sched.build_connector_meta(&[step("b", 64, vec![])]);
    assert_eq!(sched.tracker("b").unwrap().saved_tokens, 64);
    sched.update_connector_output(&ConnectorOutput {
        failed_block_ids: vec![12],
        ..Default::default()
    });
    assert_eq!(sched.tracker("b").unwrap().saved_tokens, 32);
    assert!(sched.has_pending_work(), "b's step is not reported yet");
    let again = sched.build_connector_meta(&[step("b", 64, vec![])]);
    let save = again.requests[0].save.unwrap();
    assert_eq!((save.save_from, save.save_until), (32, 64));

    // Preemption forgets the GPU blocks and save progress.
    sched.request_preempted("b");
    let t = sched.tracker("b").unwrap();
    assert!(t.block_ids.is_empty() && t.saved_tokens == 0 && t.load.is_none());
}

#[test]
fn decode_tokens_join_only_at_the_schedulers_own_count() {
    let s = setup();
    let mut sched = scheduler(&s, true);
    sched.get_num_new_matched_tokens(&request("a", 40, false), 0);
    sched.update_state_after_alloc("a", &[0, 1, 2, 3], 0);
    sched.build_connector_meta(&[step("a", 40, vec![])]);
    assert_eq!(sched.token_count("a"), Some(40));
    // Tokens sent from another position (a copy of the count kept elsewhere drifted) are
    // refused, and the request saves no more decode tokens: its sequence is unknown.
    let drifted = ScheduledRequest {
        req_id: "a".into(),
        new_token_ids: vec![9; 8],
        new_tokens_start: 44,
        blocks: BlockUpdate::Unchanged,
        num_computed_tokens_after_step: 52,
    };
    let m = sched.build_connector_meta(&[drifted]);
    assert!(m.requests.iter().all(|r| r.save.is_none()), "{m:?}");
    let t = sched.tracker("a").unwrap();
    assert!(t.token_stream_broken);
    assert_eq!(t.token_ids.len(), 40);
    assert_eq!(sched.token_count("b"), None);
}

/// Process memory shared by every pool that opens its scheme (so one pool can read what
/// another stored), saying whether its reads are node memory as the pool daemon's tier does.
struct SharedStore {
    store: InMemoryConnector,
    node_memory: bool,
}

#[async_trait]
impl BackendFactory for SharedStore {
    fn example(&self) -> String {
        String::new()
    }
    async fn open(&self, _: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        if self.node_memory {
            Ok(Box::new(InMemoryNodeMemory(self.store.clone())))
        } else {
            Ok(Box::new(self.store.clone()))
        }
    }
}

#[test]
fn a_tier_reading_node_memory_is_loaded_at_lookup_and_leased_so_the_load_is_synchronous() {
    for (scheme, node_memory) in [("nodememory", true), ("elsewhere", false)] {
        register_scheme(
            scheme,
            SharedStore {
                store: InMemoryConnector::new(),
                node_memory,
            },
        )
        .unwrap();
        let url = format!("{scheme}://");
        // One engine computes and stores the prefix; it reaches the shared tier.
        let writer = setup_with_tier(Some(&url));
        store(&writer, 64);
        writer
            .runtime
            .block_on(writer.engine.storage().flush())
            .unwrap();
        // Another engine, its L1 empty, finds it in the shared tier.
        let reader = setup_with_tier(Some(&url));
        let mut sched = scheduler(&reader, false);
        // Another request runs (else any load would be synchronous).
        sched.build_connector_meta(&[step("running", 8, vec![])]);
        let answer = sched.get_num_new_matched_tokens(&request("a", 64, false), 0);
        let hits = reader.engine.storage().stats().tiers[1].hit_chunks;
        if node_memory {
            assert_eq!(answer, (48, false), "loaded at lookup: a synchronous load");
            assert_eq!(reader.leases.stats().leases, 1);
            assert_eq!(hits, 3, "three chunks read from node memory");
            // They were promoted into L1 and are leased, so the worker's load reads memory.
            let meta = {
                sched.update_state_after_alloc("a", &[0, 1, 2, 3], 48);
                sched.build_connector_meta(&[step("a", 64, vec![])])
            };
            assert!(!meta.requests[0].load.unwrap().asynchronous);
            // L1 holds the first two chunks: the lookup leases them and loads only the third.
            let mixed = setup_with_tier(Some(&url));
            store(&mixed, 32);
            let mut sched = scheduler(&mixed, false);
            let answer = sched.get_num_new_matched_tokens(&request("m", 64, false), 0);
            assert_eq!(answer, (48, false));
            assert_eq!(mixed.engine.storage().stats().tiers[1].hit_chunks, 1);
            assert_eq!(mixed.leases.take("m").unwrap().chunks.len(), 3);
            // A lease budget of one chunk: the lookup cannot complete the hit from memory, so
            // it loads nothing and leaves the whole hit to an asynchronous load.
            let tight = Setup {
                leases: Arc::new(LeaseTable::new(
                    reader.engine.layout().chunk_bytes(16),
                    std::time::Duration::from_secs(60),
                )),
                ..setup_with_tier(Some(&url))
            };
            let mut sched = scheduler(&tight, false);
            sched.build_connector_meta(&[step("running", 8, vec![])]);
            let answer = sched.get_num_new_matched_tokens(&request("b", 64, false), 0);
            assert_eq!(answer, (48, true));
            assert_eq!(tight.engine.storage().stats().tiers[1].hit_chunks, 0);
            // With every load asynchronous (vLLM's asynchronous scheduling) the lookup loads
            // nothing: the scheduler's thread would copy for no earlier load.
            let later = setup_with_tier(Some(&url));
            let mut always = scheduler_with(
                &later,
                ConnectorConfig {
                    load_timing: kvpool_connector::LoadTiming::Always,
                    ..ConnectorConfig::new(16)
                },
            );
            let answer = always.get_num_new_matched_tokens(&request("c", 64, false), 0);
            assert_eq!(answer, (48, true));
            assert_eq!(later.engine.storage().stats().tiers[1].hit_chunks, 0);
        } else {
            assert_eq!(answer, (48, true), "any other tier loads asynchronously");
            assert_eq!(reader.leases.stats().leases, 0);
            assert_eq!(hits, 0, "a lookup reads nothing from it");
        }
    }
}

/// A scheduler in its worker's process (vLLM's EngineCore with its one worker) asks the
/// worker's lookup server without the socket and gets the socket's answers; once the server
/// is gone from this process, it asks over the socket again (whose open connection the
/// server's connection thread still answers).
#[test]
fn a_lookup_in_the_servers_process_answers_as_its_socket_does_without_it() {
    use kvpool_connector::{LookupServer, PoolLookup, SocketLookup};
    use std::time::Duration;

    let s = setup();
    store(&s, 48); // three whole chunks of 16 tokens
    let dir = std::env::temp_dir().join(format!("kvpool-lookup-in-process-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.sock");
    let server = LookupServer::start(
        &path,
        s.engine.clone(),
        s.runtime.clone(),
        s.leases.clone(),
        0,
        Duration::from_secs(60),
    )
    .unwrap();
    let connect = || {
        SocketLookup::connect(
            std::slice::from_ref(&path),
            Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .unwrap()
        .0
    };
    let mut socket = connect();
    let mut local = connect().answer_in_process();
    let mut hasher = s.engine.token_database().hasher(&[]);
    hasher.extend(&(0..64).collect::<Vec<u32>>());
    let hashes = hasher.hashes().to_vec();
    assert_eq!(hashes.len(), 4);
    for lookup in [&mut socket, &mut local] {
        assert_eq!(lookup.lookup("", &hashes, false).chunks, 3);
        assert_eq!(lookup.presence(&hashes), vec![true, true, true, false]);
    }
    assert_eq!(local.lookups_in_process(), 2);
    assert_eq!(socket.lookups_in_process(), 0);
    assert_eq!(
        (local.lookups_over_sockets(), socket.lookups_over_sockets()),
        (0, 2)
    );
    // A request's lookup leases what L1 holds, into the worker's lease table, on both routes.
    for (lookup, req) in [(&mut socket, "over-socket"), (&mut local, "in-process")] {
        let answer = lookup.lookup(req, &hashes, false);
        assert_eq!((answer.chunks, answer.leased), (3, 3), "{req}");
    }
    assert_eq!(s.leases.stats().leases, 2);
    assert_eq!(local.lookups_in_process(), 3);

    drop(server);
    assert_eq!(local.lookup("", &hashes, false).chunks, 3);
    assert_eq!(
        (local.lookups_in_process(), local.lookups_over_sockets()),
        (3, 1),
        "no server left in this process: over the socket"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lookup server started at the path of one still running takes the path over: the old
/// one, dropped, stops without touching the new one's socket file or its registration, and
/// the new one answers on both routes.
#[test]
fn a_server_replaced_at_its_path_stops_without_taking_the_new_ones_socket() {
    use kvpool_connector::{LookupServer, PoolLookup, SocketLookup};
    use std::time::Duration;

    let s = setup();
    store(&s, 16);
    let dir = std::env::temp_dir().join(format!("kvpool-lookup-replaced-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.sock");
    let start = || {
        LookupServer::start(
            &path,
            s.engine.clone(),
            s.runtime.clone(),
            s.leases.clone(),
            0,
            Duration::from_secs(60),
        )
        .unwrap()
    };
    let old = start();
    let new = start();
    let (dropped, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(old);
        let _ = dropped.send(());
    });
    done.recv_timeout(Duration::from_secs(10))
        .expect("the old server stopped");
    assert!(path.exists(), "the new server's socket file is still there");
    let mut hasher = s.engine.token_database().hasher(&[]);
    hasher.extend(&(0..16).collect::<Vec<u32>>());
    let connect = || {
        SocketLookup::connect(
            std::slice::from_ref(&path),
            Duration::from_secs(5),
            Duration::from_secs(1),
        )
        .expect("the new server answers on its socket")
        .0
    };
    let mut socket = connect();
    let mut local = connect().answer_in_process();
    assert_eq!(socket.lookup("", hasher.hashes(), false).chunks, 1);
    assert_eq!(local.lookup("", hasher.hashes(), false).chunks, 1);
    assert_eq!(
        local.lookups_in_process(),
        1,
        "the new server is still registered"
    );
    drop(new);
    assert!(!path.exists(), "the last server removes its socket file");
    let _ = std::fs::remove_dir_all(&dir);
}
