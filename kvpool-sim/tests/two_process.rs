//! Scheduler and worker in two OS processes, joined by a Unix socket.
//!
//! The test process is the scheduler. It re-executes its own binary as the worker process,
//! which owns the pool, the paged KV cache and the model. The scheduler's pool lookups and
//! each step's encoded metadata cross the socket; nothing else is shared.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpool_connector::{
    BlockUpdate, ConnectorConfig, ConnectorOutput, ConnectorScheduler, ConnectorWorker,
    EngineRequest, PoolLookup, ScheduledRequest, probe_hash_of,
};
use kvpool_core::{
    CacheEngine, ChunkHash, ChunkedTokenDatabase, ChunkingConfig, Dtype, EvictionKind,
    HashAlgorithm, HostPagedKvCache, KeyScope, KvKind, KvLayout, StorageManager,
};
use kvpool_sim::single_request::{model_compute, model_mismatches};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

const SOCKET_ENV: &str = "KVPOOL_TWO_PROCESS_SOCKET";

#[derive(Debug, Serialize, Deserialize)]
enum ToWorker {
    Lookup(Vec<[u8; 16]>),
    Step {
        meta: Vec<u8>,
        tokens: Vec<u32>,
        blocks: Vec<u32>,
        compute_from: u32,
    },
    Verify {
        tokens: Vec<u32>,
        blocks: Vec<u32>,
    },
    Quit,
}

#[derive(Debug, Serialize, Deserialize)]
enum FromWorker {
    Hits(u64),
    StepDone {
        finished_sending: Vec<String>,
        failed: Vec<u32>,
    },
    Mismatches(u64),
}

fn send<T: Serialize>(s: &mut UnixStream, m: &T) {
    let b = postcard::to_stdvec(m).unwrap();
    s.write_all(&(b.len() as u32).to_le_bytes()).unwrap();
    s.write_all(&b).unwrap();
}

fn recv<T: DeserializeOwned>(s: &mut UnixStream) -> T {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut b).unwrap();
    postcard::from_bytes(&b).unwrap()
}

fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, Dtype::F16, KvKind::KeyValue, 2).unwrap()
}

fn token_database() -> ChunkedTokenDatabase {
    let scope = KeyScope::new("two-process", 1, 0, 0, layout().fingerprint()).unwrap();
    ChunkedTokenDatabase::new(
        ChunkingConfig {
            chunk_size: 2,
            ..Default::default()
        },
        scope,
    )
    .unwrap()
}

/// The worker process's entry point; it runs only when the test below starts it.
#[test]
#[ignore = "entry point of the worker process started by scheduler_and_worker_in_two_processes"]
fn worker_process() {
    let path = std::env::var(SOCKET_ENV).expect("started by scheduler_and_worker_in_two_processes");
    let mut sock = UnixStream::connect(path).unwrap();
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let l1 = Arc::new(kvpool_backends::LocalCpuBackend::new(1 << 20, EvictionKind::Lru).unwrap());
    let manager = runtime
        .block_on(async {
            StorageManager::builder()
                .primary(l1.clone(), l1.clone())
                .build()
        })
        .unwrap();
    let engine = Arc::new(CacheEngine::new(layout(), token_database(), Arc::new(manager)).unwrap());
    let mut worker = ConnectorWorker::new(engine.clone(), runtime.clone(), layout().block_size);
    worker.register_kv_caches(&layout()).unwrap();
    let mut kv = HostPagedKvCache::new(layout(), 16);
    loop {
        match recv::<ToWorker>(&mut sock) {
            ToWorker::Lookup(hashes) => {
                let hashes: Vec<ChunkHash> = hashes.into_iter().map(ChunkHash).collect();
                let chunks = kvpool_connector::scheduler::lookup_chunks(&engine, &runtime, &hashes);
                send(&mut sock, &FromWorker::Hits(chunks as u64));
            }
            ToWorker::Step {
                meta,
                tokens,
                blocks,
                compute_from,
            } => {
                worker.bind_connector_metadata(&meta).unwrap();
                worker.start_load_kv(&mut kv).unwrap();
                for layer in 0..layout().num_layers {
                    worker.wait_for_layer_load(layer).unwrap();
                    model_compute(
                        &mut kv,
                        layer,
                        &tokens,
                        &blocks,
                        compute_from as usize..tokens.len(),
                    );
                    worker.save_kv_layer(layer, &kv).unwrap();
                }
                worker.wait_for_save(&kv).unwrap();
                let (finished_sending, _) = worker.get_finished(&[]);
                let failed = worker.get_block_ids_with_load_errors();
                worker.clear_connector_metadata();
                send(
                    &mut sock,
                    &FromWorker::StepDone {
                        finished_sending,
                        failed,
                    },
                );
            }
            ToWorker::Verify { tokens, blocks } => {
                let bad = model_mismatches(&kv, &tokens, &blocks) as u64;
                send(&mut sock, &FromWorker::Mismatches(bad));
            }
            ToWorker::Quit => return,
        }
    }
}

/// Pool lookups answered by the worker process.
struct RpcLookup(Arc<Mutex<UnixStream>>);

impl PoolLookup for RpcLookup {
    fn lookup(&mut self, chunk_hashes: &[ChunkHash]) -> usize {
        let mut s = self.0.lock().unwrap();
        send(
            &mut s,
            &ToWorker::Lookup(chunk_hashes.iter().map(|h| h.0).collect()),
        );
        match recv(&mut s) {
            FromWorker::Hits(n) => n as usize,
            other => panic!("unexpected reply {other:?}"),
        }
    }
}

/// Runs one request's prefill: returns (tokens loaded from the pool, rows differing from the model).
fn run_request(
    sched: &mut ConnectorScheduler,
    sock: &Arc<Mutex<UnixStream>>,
    id: &str,
    prompt: &[u32],
    blocks: &[u32],
) -> (usize, u64) {
    let request = EngineRequest {
        req_id: id.into(),
        prompt_token_ids: prompt.to_vec(),
        skip_save: false,
        extra_keys: Vec::new(),
    };
    let (external, _) = sched.get_num_new_matched_tokens(&request, 0);
    sched.update_state_after_alloc(id, blocks, external);
    let meta = sched.build_connector_meta(&[ScheduledRequest {
        req_id: id.into(),
        new_token_ids: vec![],
        blocks: BlockUpdate::Unchanged,
        num_computed_tokens_after_step: prompt.len(),
    }]);
    let mut s = sock.lock().unwrap();
    send(
        &mut s,
        &ToWorker::Step {
            meta: meta.encode(),
            tokens: prompt.to_vec(),
            blocks: blocks.to_vec(),
            compute_from: external as u32,
        },
    );
    let FromWorker::StepDone {
        finished_sending,
        failed,
    } = recv(&mut s)
    else {
        panic!("expected StepDone")
    };
    assert!(failed.is_empty());
    send(
        &mut s,
        &ToWorker::Verify {
            tokens: prompt.to_vec(),
            blocks: blocks.to_vec(),
        },
    );
    let FromWorker::Mismatches(bad) = recv(&mut s) else {
        panic!("expected Mismatches")
    };
    drop(s);
    sched.update_connector_output(&ConnectorOutput {
        finished_sending,
        ..Default::default()
    });
    assert_eq!(sched.request_finished(id, blocks), (false, None));
    (external, bad)
}

#[test]
fn scheduler_and_worker_in_two_processes() {
    let path = std::env::temp_dir().join(format!("kvpool-two-process-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["worker_process", "--exact", "--ignored", "--nocapture"])
        .env(SOCKET_ENV, &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "the worker process exited early"
                );
                assert!(
                    Instant::now() < deadline,
                    "the worker process never connected"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let sock = Arc::new(Mutex::new(stream));
    let config = ConnectorConfig {
        block_size: 2,
        save_unfull_chunk: false,
        save_decode_tokens: false,
        offload: Default::default(),
    };
    let mut sched = ConnectorScheduler::with_lookup(
        Box::new(RpcLookup(sock.clone())),
        2,
        HashAlgorithm::default(),
        probe_hash_of(&token_database()),
        config,
    );

    // Request A ("Hello", ",", " world") is computed in the worker process; its full chunk is saved.
    let (loaded_a, bad_a) = run_request(&mut sched, &sock, "A", &[15496, 11, 995], &[0, 1]);
    assert_eq!((loaded_a, bad_a), (0, 0));
    // Request B shares the prefix: the lookup crosses the socket, the chunk loads into new blocks.
    let (loaded_b, bad_b) = run_request(&mut sched, &sock, "B", &[15496, 11, 1917, 0], &[2, 3]);
    assert_eq!(loaded_b, 2, "B's shared chunk comes from the worker's pool");
    assert_eq!(
        bad_b, 0,
        "B's KV in the worker process is exactly the model's"
    );

    send(&mut sock.lock().unwrap(), &ToWorker::Quit);
    assert!(child.wait().unwrap().success(), "the worker process failed");
    let _ = std::fs::remove_file(&path);
}
