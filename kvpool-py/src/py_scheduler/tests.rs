//! The scheduler and workers in one process, joined by their lookup sockets as in vLLM's
//! processes: loads, tensor-parallel ranks, recurrent states, a hung rank.

use super::*;
use crate::worker_core::{WorkerCore, WorkerSpec};
use kvpool_connector::host_blocks::run_copy_job;
use kvpool_connector::vllm::VllmEngineFacts;
use kvpool_core::{Dtype, HostPagedKvCache, KvKind};

const BLOCK: usize = 4;

fn spec(socket: PathBuf, tp_size: u32, tp_rank: u32) -> WorkerSpec {
    WorkerSpec {
        config_text: "[chunking]\nchunk_size = 8\n[local_cpu]\nmax_size = \"1MiB\"\n".into(),
        config_format: "toml".into(),
        facts: VllmEngineFacts {
            model: "tiny".into(),
            weights: "w".into(),
            tp_size,
            tp_rank,
            pp_rank: 0,
            block_size: BLOCK,
            num_layers: 2,
            num_kv_heads: 1,
            head_size: 2,
            dtype: Dtype::F32,
            kind: KvKind::KeyValue,
            replicated: false,
            kv_format: "test".into(),
        },
        socket_path: Some(socket),
    }
}

/// One engine step on one worker: bind, run the loads, run the saves, report.
fn step(
    w: &mut WorkerCore,
    kv: &mut HostPagedKvCache,
    meta: &[u8],
) -> (
    Vec<String>,
    Vec<String>,
    Vec<u32>,
    kvpool_connector::StepReport,
) {
    w.worker.bind_connector_metadata(meta).unwrap();
    for job in w.worker.take_load_jobs() {
        // SAFETY: the job is fresh from the worker, reported done right after.
        unsafe { run_copy_job(&job, kv) }.unwrap();
        w.worker.copy_done(job.id, true);
    }
    for job in w.worker.take_save_jobs() {
        // SAFETY: as above.
        unsafe { run_copy_job(&job, kv) }.unwrap();
        w.worker.copy_done(job.id, true);
    }
    let r = w.worker.transfer_results(&[]);
    let failed = w.worker.get_block_ids_with_load_errors();
    let report = w.worker.step_report();
    w.worker.clear_connector_metadata();
    (r.finished_sending, r.finished_recving, failed, report)
}

fn feed(
    sched: &mut ConnectorScheduler,
    reports: &[kvpool_connector::StepReport],
    failed: Vec<u32>,
) {
    let count = |f: fn(&kvpool_connector::StepReport) -> &Vec<u64>| {
        let mut m: std::collections::BTreeMap<u64, u32> = Default::default();
        for r in reports {
            for &s in f(r) {
                *m.entry(s).or_default() += 1;
            }
        }
        m.into_iter().collect::<Vec<_>>()
    };
    sched.update_connector_output(&ConnectorOutput {
        failed_block_ids: failed,
        executed_steps: count(|r| &r.executed),
        copied_steps: count(|r| &r.copied),
        ..Default::default()
    });
}

fn kv_with_noise(salt: u8) -> HostPagedKvCache {
    let layout = kvpool_core::KvLayout::new(2, 1, 2, Dtype::F32, KvKind::KeyValue, BLOCK).unwrap();
    let mut kv = HostPagedKvCache::new(layout, 16);
    for l in 0..2 {
        for (i, b) in kv.layer_mut(l).iter_mut().enumerate() {
            *b = ((i as u64 * 2654435761 + u64::from(salt) * 97 + l as u64) >> 7) as u8;
        }
    }
    kv
}

fn block_bytes(kv: &HostPagedKvCache, layer: usize, plane: usize, b: usize) -> Vec<u8> {
    (0..BLOCK)
        .flat_map(|t| kv.row(layer, plane, b * BLOCK + t).to_vec())
        .collect()
}

/// Two tensor-parallel ranks' workers, each serving its lookup socket in `dir`, and a
/// scheduler joined to both, as in vLLM's processes with TP=2.
fn two_ranks(dir: &tempfile::TempDir) -> (Vec<WorkerCore>, ConnectorScheduler) {
    let sockets = [dir.path().join("tp0.sock"), dir.path().join("tp1.sock")];
    let workers = (0..2)
        .map(|rank| WorkerCore::new(&spec(sockets[rank].clone(), 2, rank as u32)).unwrap())
        .collect();
    let sched = connect_scheduler(
        &sockets,
        ConnectorConfig::new(BLOCK),
        Duration::from_secs(5),
        Duration::from_secs(5),
        false,
    )
    .unwrap();
    (workers, sched)
}

/// Scheduler and worker joined by the lookup socket, as in vLLM's two processes: a
/// request's computed blocks are saved (visible once the step is committed), and a
/// second request with the same prefix in other blocks is told of the hit and gets
/// exactly those bytes, block by block.
#[test]
fn second_request_loads_the_first_requests_blocks_through_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("w.sock");
    let mut worker = WorkerCore::new(&spec(socket.clone(), 1, 0)).unwrap();
    let mut kv = kv_with_noise(1);
    let mut sched = connect_scheduler(
        &[socket],
        ConnectorConfig::new(BLOCK),
        Duration::from_secs(5),
        Duration::from_secs(5),
        false,
    )
    .unwrap();
    let prompt: Vec<u32> = (100..117).collect(); // 17 tokens: two 8-token chunks + 1
    let a = EngineRequest {
        req_id: "a".into(),
        prompt_token_ids: prompt.clone(),
        skip_save: false,
        extra_keys: Vec::new(),
    };
    assert_eq!(sched.get_num_new_matched_tokens(&a, 0), (0, false));
    sched.update_state_after_alloc("a", &[1, 2, 3, 4, 5], 0);
    let meta = sched.build_connector_meta(
        &scheduled_requests(vec![("a".into(), 17, vec![], 2, vec![1, 2, 3, 4, 5], 17)]).unwrap(),
    );
    // One rank, synchronous scheduling: the worker commits the step's saves itself.
    assert!(meta.commit_locally);
    let (_, _, _, report) = step(&mut worker, &mut kv, &meta.encode());
    let mut b = a.clone();
    b.req_id = "b".into();
    feed(&mut sched, &[report], vec![]);
    assert!(
        !sched.request_finished("a", &[]),
        "its save was reported copied"
    );

    // Same prompt under another LoRA adapter: no hit.
    let mut lora = a.clone();
    lora.req_id = "lora".into();
    lora.extra_keys = b"\x01\x01\x00\x00\x00x".to_vec();
    assert_eq!(sched.get_num_new_matched_tokens(&lora, 0), (0, false));
    sched.request_finished("lora", &[]);

    assert_eq!(sched.get_num_new_matched_tokens(&b, 0), (16, false));
    sched.update_state_after_alloc("b", &[9, 10, 11, 12, 13], 16);
    let meta = sched.build_connector_meta(
        &scheduled_requests(vec![(
            "b".into(),
            17,
            vec![],
            2,
            vec![9, 10, 11, 12, 13],
            17,
        )])
        .unwrap(),
    );
    let (_, _, failed, _) = step(&mut worker, &mut kv, &meta.encode());
    assert!(failed.is_empty());
    for layer in 0..2 {
        for plane in 0..2 {
            for (src, dst) in [(1, 9), (2, 10), (3, 11), (4, 12)] {
                assert_eq!(
                    block_bytes(&kv, layer, plane, dst),
                    block_bytes(&kv, layer, plane, src)
                );
            }
            assert_ne!(
                block_bytes(&kv, layer, plane, 13),
                block_bytes(&kv, layer, plane, 5)
            );
        }
    }
}

/// Tensor parallelism: the scheduler offers only what every rank can load, and commits a
/// step only once both ranks reported it.
#[test]
fn with_two_ranks_only_what_both_hold_and_both_reported_is_offered() {
    let dir = tempfile::tempdir().unwrap();
    let (mut workers, mut sched) = two_ranks(&dir);
    let mut kvs = [kv_with_noise(3), kv_with_noise(4)];
    let prompt: Vec<u32> = (0..17).collect();
    let request = |id: &str| EngineRequest {
        req_id: id.into(),
        prompt_token_ids: prompt.clone(),
        skip_save: false,
        extra_keys: Vec::new(),
    };
    sched.get_num_new_matched_tokens(&request("a"), 0);
    sched.update_state_after_alloc("a", &[1, 2, 3, 4, 5], 0);
    let meta = sched
        .build_connector_meta(
            &scheduled_requests(vec![("a".into(), 17, vec![], 2, vec![1, 2, 3, 4, 5], 17)])
                .unwrap(),
        )
        .encode();
    let r0 = step(&mut workers[0], &mut kvs[0], &meta).3;
    let r1 = step(&mut workers[1], &mut kvs[1], &meta).3;
    // Only rank 0's report arrived: nothing is committed.
    feed(&mut sched, &[r0], vec![]);
    let next = sched.build_connector_meta(&[]).encode();
    step(&mut workers[0], &mut kvs[0], &next);
    step(&mut workers[1], &mut kvs[1], &next);
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("b"), 0),
        (0, false)
    );
    sched.request_finished("b", &[]);
    feed(&mut sched, &[r1], vec![]);
    let next = sched.build_connector_meta(&[]).encode();
    step(&mut workers[0], &mut kvs[0], &next);
    step(&mut workers[1], &mut kvs[1], &next);
    assert_eq!(
        sched.get_num_new_matched_tokens(&request("c"), 0),
        (16, false)
    );
}

/// A hybrid model's recurrent states over the sockets: one round trip per rank answers
/// each state on its own, and a state is present only where every rank holds it.
#[test]
fn a_state_is_present_only_where_every_rank_holds_it() {
    use kvpool_connector::host_spans::HostSpan;
    use kvpool_connector::vllm::state_values::StateValues;

    let dir = tempfile::tempdir().unwrap();
    let (workers, mut sched) = two_ranks(&dir);
    let runtime = std::sync::Arc::new(tokio::runtime::Runtime::new().unwrap());
    let state = [7u8; 16];
    let store = |w: &WorkerCore, at: kvpool_core::ChunkHash| {
        let values =
            StateValues::new(w.worker.engine().clone(), runtime.clone(), 16, 1 << 20, 4).unwrap();
        let spans = vec![HostSpan {
            addr: state.as_ptr() as usize,
            len: 16,
        }];
        // SAFETY: the span lies in `state`, alive and unchanged during the call.
        unsafe { values.write(&[(at, spans)]) }.unwrap()
    };
    let (both, one, none) = (
        kvpool_core::ChunkHash([1; 16]),
        kvpool_core::ChunkHash([2; 16]),
        kvpool_core::ChunkHash([3; 16]),
    );
    assert_eq!(store(&workers[0], both), 1);
    assert_eq!(store(&workers[1], both), 1);
    assert_eq!(store(&workers[0], one), 1);
    assert_eq!(
        sched.chunks_present(&[one, both, none]),
        vec![false, true, false]
    );
    assert!(sched.chunks_present(&[]).is_empty());
}

/// A rank that stops answering costs one bounded wait, then its breaker opens and
/// lookups are misses at once until it answers again.
#[test]
fn a_hung_rank_is_bounded_then_skipped_by_its_breaker() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("tp0.sock");
    let hung = dir.path().join("tp1.sock");
    let w0 = WorkerCore::new(&spec(good.clone(), 2, 0)).unwrap();
    // Rank 1 answers the hello like a real worker, then never answers a lookup.
    use kvpool_connector::vllm::lookup_service::{LookupRequest, LookupResponse, WorkerInfo};
    use kvpool_core::frame::{read_frame, write_frame};
    let engine = w0.worker.engine().clone();
    let info = WorkerInfo {
        probe_hash: kvpool_connector::probe_hash(&engine),
        chunk_size: engine.token_database().chunk_size() as u32,
        hash_algorithm: engine.token_database().config().hash_algorithm,
        rank: 1,
    };
    let listener = std::os::unix::net::UnixListener::bind(&hung).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                while let Ok(req) = read_frame::<LookupRequest>(&mut conn) {
                    match req {
                        LookupRequest::Hello => {
                            write_frame(&mut conn, &LookupResponse::Hello(info)).unwrap()
                        }
                        LookupRequest::Lookup { .. } | LookupRequest::Presence { .. } => {
                            std::thread::sleep(Duration::from_secs(3600))
                        }
                    }
                }
            });
        }
    });
    let mut sched = connect_scheduler(
        &[good, hung.clone()],
        ConnectorConfig::new(BLOCK),
        Duration::from_millis(300),
        Duration::from_secs(5),
        false,
    )
    .unwrap();
    let prompt: Vec<u32> = (0..17).collect();
    let req = |i: usize| EngineRequest {
        req_id: format!("r{i}"),
        prompt_token_ids: prompt.clone(),
        skip_save: false,
        extra_keys: Vec::new(),
    };
    // Each failed lookup waits at most the timeout (a thread left behind on the hung rank
    // counts its failure when its own deadline passes, so allow a few more lookups).
    let needed = kvpool_connector::vllm::lookup_service::BREAKER_FAILURES as usize;
    let mut lookups = 0;
    while sched.counters().breakers_open == 0 {
        assert!(lookups < 3 * needed, "the breaker never opened");
        let t = std::time::Instant::now();
        assert_eq!(
            sched.get_num_new_matched_tokens(&req(lookups), 0),
            (0, false)
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "lookup took {:?}",
            t.elapsed()
        );
        lookups += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(lookups >= needed - 1, "opened after {lookups} lookups");
    assert_eq!(sched.counters().breakers_open, 1);
    let t = std::time::Instant::now();
    assert_eq!(sched.get_num_new_matched_tokens(&req(99), 0), (0, false));
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "the open breaker answers at once"
    );
    assert!(sched.counters().breaker_misses >= 1);
}
