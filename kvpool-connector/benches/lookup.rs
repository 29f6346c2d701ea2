//! The scheduler's lookup of a 128K-token prompt that the pool holds whole (its 512 chunks and
//! its tail blocks in L1), as vLLM's first `get_num_new_matched_tokens` call for a request
//! runs it: hashing the prompt, looking up the chunks and then the chunk tail's block keys, and
//! leasing them; the request then ends (its tracker and lease are dropped).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kvpool_backends::build_pool;
use kvpool_connector::{ConnectorConfig, ConnectorScheduler, EngineRequest, LeaseTable};
use kvpool_core::{
    ByteSize, Chunk, ChunkMeta, Dtype, HostPagedKvCache, KvKind, MemoryObjMut, PoolConfig,
};

const BLOCK: usize = 16;

fn lookup_128k_with_tail(c: &mut Criterion) {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap(),
    );
    let mut config = PoolConfig {
        layout: kvpool_core::KvLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_size: 8,
            dtype: Dtype::F16,
            kind: KvKind::KeyValue,
            block_size: BLOCK,
        },
        ..Default::default()
    };
    config.local_cpu.max_size = ByteSize::mib(64);
    let engine = runtime.block_on(build_pool(&config)).unwrap().engine;
    let chunk = engine.token_database().chunk_size();
    // 512 whole chunks, then 200 tokens: 12 whole tail blocks and 8 tokens.
    let n = 128 * 1024 + 200;
    let tokens: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761) % 128_000)
        .collect();
    let whole = n / chunk * chunk;
    let kv = HostPagedKvCache::new(*engine.layout(), n.div_ceil(BLOCK));
    let slots: Vec<i64> = (0..whole as i64).collect();
    runtime
        .block_on(engine.store(&tokens[..whole], None, &kv, &slots))
        .unwrap();
    // The tail blocks, as the connector stores them: one value per block under its tail key.
    let algorithm = engine.token_database().config().hash_algorithm;
    let last = engine
        .token_database()
        .process_tokens(&tokens[..whole], None)
        .unwrap()
        .last()
        .unwrap()
        .key
        .hash;
    let layout = *engine.layout();
    let tail: Vec<_> = algorithm
        .chain_tail_blocks(&last, &tokens[whole..n - 1], BLOCK)
        .into_iter()
        .map(|h| {
            let key = kvpool_core::CacheKey::new(engine.token_database().scope().clone(), h);
            let chunk = Chunk {
                meta: ChunkMeta {
                    layout_fingerprint: layout.fingerprint(),
                    dtype: layout.dtype,
                    token_count: BLOCK as u32,
                },
                data: MemoryObjMut::heap(layout.chunk_bytes(BLOCK)).freeze(),
            };
            (key, chunk)
        })
        .collect();
    let tail_blocks = tail.len();
    runtime.block_on(engine.storage().put(tail)).unwrap();

    let leases = Arc::new(LeaseTable::new(256 << 20, Duration::from_secs(60)));
    let mut scheduler = ConnectorScheduler::new(
        engine.clone(),
        runtime.clone(),
        leases,
        ConnectorConfig::new(BLOCK),
    );
    let request = EngineRequest {
        req_id: "r".into(),
        prompt_token_ids: tokens,
        skip_save: false,
        extra_keys: Vec::new(),
    };
    let served = whole + tail_blocks * BLOCK;
    assert_eq!(
        scheduler.get_num_new_matched_tokens(&request, 0),
        (served, false),
        "every chunk and every whole tail block is served"
    );
    scheduler.request_finished("r", &[]);
    c.bench_function(
        "scheduler_lookup_128k_tokens_512_chunks_12_tail_blocks",
        |b| {
            b.iter(|| {
                black_box(scheduler.get_num_new_matched_tokens(black_box(&request), 0));
                scheduler.request_finished("r", &[]);
            })
        },
    );
}

criterion_group!(benches, lookup_128k_with_tail);
criterion_main!(benches);
