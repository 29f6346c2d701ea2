//! A hybrid model's recurrent states in a real pool: stored and read back byte for byte under
//! the prefix they follow, and a miss (never data) at another prefix, in another key scope or
//! with another size; the scheduler's presence lookup answers each state on its own.

use std::sync::Arc;

use kvpool_connector::host_spans::HostSpan;
use kvpool_connector::vllm::state_values::{StateReadError, StateValues};
use kvpool_connector::{ConnectorConfig, ConnectorScheduler, LeaseTable};
use kvpool_core::{ByteSize, CacheEngine, ChunkHash, ChunkedTokenDatabase, PoolConfig};
use tokio::runtime::Runtime;

/// Layers of the state group, and bytes of one layer's state.
const LAYERS: usize = 3;
const CONTENT: usize = 96;
/// Bytes between two blocks of a layer (vLLM pads a state block to the attention page).
const STRIDE: usize = 128;
const BLOCKS: usize = 4;

fn runtime() -> Arc<Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    )
}

fn config(model: &str) -> PoolConfig {
    let mut config = PoolConfig::default();
    config.local_cpu.max_size = ByteSize::mib(64);
    config.chunking.chunk_size = 16;
    config.model.name = model.into();
    config
}

/// An engine in `model`'s key scope over `owner`'s storage.
fn engine_sharing(owner: &CacheEngine, model: &str) -> Arc<CacheEngine> {
    let config = config(model);
    let db = ChunkedTokenDatabase::new(config.chunking, config.key_scope().unwrap()).unwrap();
    Arc::new(CacheEngine::new(*owner.layout(), db, owner.storage().clone()).unwrap())
}

/// One host buffer per layer, `BLOCKS` padded blocks each, filled from `seed`.
fn state_blocks(seed: u8) -> Vec<Vec<u8>> {
    (0..LAYERS)
        .map(|l| {
            (0..BLOCKS * STRIDE)
                .map(|i| {
                    (i as u8)
                        .wrapping_mul(31)
                        .wrapping_add(seed)
                        .wrapping_add(l as u8)
                })
                .collect()
        })
        .collect()
}

/// The spans of `block`'s state in every layer (its padding left out), for a read into them.
fn spans(layers: &mut [Vec<u8>], block: usize) -> Vec<HostSpan> {
    layers
        .iter_mut()
        .map(|l| HostSpan {
            addr: l[block * STRIDE..].as_mut_ptr() as usize,
            len: CONTENT,
        })
        .collect()
}

/// Stores `block`'s state from `layers` under `at`; how many were stored anew.
fn store(states: &StateValues, at: ChunkHash, layers: &mut [Vec<u8>], block: usize) -> usize {
    let spans = spans(layers, block);
    // SAFETY: the spans lie in `layers`, borrowed (so alive and unchanged) for the call.
    unsafe { states.write(&[(at, spans)]) }.unwrap()
}

/// Reads the state stored under `at` into `spans`.
///
/// # Safety
///
/// The spans must lie in buffers the caller owns and does not touch during the call.
unsafe fn load(
    states: &StateValues,
    at: ChunkHash,
    spans: &[HostSpan],
) -> Result<(), StateReadError> {
    // SAFETY: the caller's guarantee.
    unsafe { states.read(at, &spans.to_vec()) }
}

fn state_of(layers: &[Vec<u8>], block: usize) -> Vec<u8> {
    layers
        .iter()
        .flat_map(|l| l[block * STRIDE..block * STRIDE + CONTENT].to_vec())
        .collect()
}

struct Pool {
    runtime: Arc<Runtime>,
    engine: Arc<CacheEngine>,
}

fn pool() -> Pool {
    let runtime = runtime();
    let engine = runtime
        .block_on(kvpool_backends::build_pool(&config("owner")))
        .unwrap()
        .engine;
    Pool { runtime, engine }
}

fn values(p: &Pool, model: &str, value_bytes: usize) -> StateValues {
    StateValues::new(
        engine_sharing(&p.engine, model),
        p.runtime.clone(),
        value_bytes,
        1 << 20,
        16,
    )
    .unwrap()
}

const AT_32: ChunkHash = ChunkHash([32; 16]);
const AT_48: ChunkHash = ChunkHash([48; 16]);

#[test]
fn a_state_is_read_back_byte_for_byte_into_another_block() {
    let p = pool();
    let states = values(&p, "state-group-1", LAYERS * CONTENT);
    let mut src = state_blocks(7);
    assert_eq!(store(&states, AT_32, &mut src, 2), 1);
    // A state some tier holds already is left as it is.
    assert_eq!(store(&states, AT_32, &mut src, 1), 0);

    let mut dst = state_blocks(99);
    let before = dst.clone();
    let dst_spans = spans(&mut dst, 3);
    // SAFETY: the spans lie in `dst`, not touched until the call returns.
    unsafe { load(&states, AT_32, &dst_spans) }.unwrap();
    assert_eq!(state_of(&dst, 3), state_of(&src, 2));
    // Nothing outside the block's state bytes was written (padding, other blocks).
    for (l, (got, was)) in dst.iter_mut().zip(&before).enumerate() {
        got[3 * STRIDE..3 * STRIDE + CONTENT]
            .copy_from_slice(&was[3 * STRIDE..3 * STRIDE + CONTENT]);
        assert_eq!(got, was, "layer {l}");
    }
}

#[test]
fn another_prefix_scope_or_size_is_a_miss_never_data() {
    let p = pool();
    let states = values(&p, "state-group-1", LAYERS * CONTENT);
    let mut src = state_blocks(7);
    store(&states, AT_32, &mut src, 0);
    assert_eq!(states.presence(&[AT_32, AT_48]), vec![true, false]);

    let mut dst = state_blocks(1);
    let untouched = dst.clone();
    let dst_spans = spans(&mut dst, 0);
    // Another position: the state after 48 tokens was never stored.
    assert_eq!(
        // SAFETY: the spans lie in `dst`, not touched until the call returns (and below).
        unsafe { load(&states, AT_48, &dst_spans) },
        Err(StateReadError::Missing)
    );
    // Another group (key scope) over the same pool.
    let other_group = values(&p, "state-group-2", LAYERS * CONTENT);
    assert_eq!(other_group.presence(&[AT_32]), vec![false]);
    assert_eq!(
        // SAFETY: as above.
        unsafe { load(&other_group, AT_32, &dst_spans) },
        Err(StateReadError::Missing)
    );
    // Spans that do not add up to this group's state are refused before any read.
    assert!(matches!(
        // SAFETY: as above.
        unsafe { load(&states, AT_32, &dst_spans[..2]) },
        Err(StateReadError::Spans(_))
    ));
    assert_eq!(dst, untouched, "a miss wrote into the engine's block");
    // The same scope read as a state of another size does not fit.
    let wider = StateValues::new(
        engine_sharing(&p.engine, "state-group-1"),
        p.runtime.clone(),
        LAYERS * CONTENT + LAYERS,
        1 << 20,
        16,
    )
    .unwrap();
    let mut big: Vec<Vec<u8>> = (0..LAYERS).map(|_| vec![0u8; CONTENT + 1]).collect();
    let big_spans: Vec<HostSpan> = big
        .iter_mut()
        .map(|b| HostSpan {
            addr: b.as_mut_ptr() as usize,
            len: CONTENT + 1,
        })
        .collect();
    assert!(matches!(
        // SAFETY: the spans lie in `big`, not touched until the call returns.
        unsafe { load(&wider, AT_32, &big_spans) },
        Err(StateReadError::DoesNotFit { .. })
    ));
}

#[test]
fn a_state_larger_than_the_pools_chunks_is_refused() {
    let p = pool();
    let err = StateValues::new(
        engine_sharing(&p.engine, "state-group-1"),
        p.runtime.clone(),
        4096,
        1024,
        16,
    )
    .err()
    .unwrap();
    assert!(
        err.contains("larger than the pool's largest value"),
        "{err}"
    );
}

#[test]
fn the_schedulers_presence_lookup_answers_each_state_on_its_own() {
    let p = pool();
    let group = engine_sharing(&p.engine, "state-group-1");
    let states = StateValues::new(
        group.clone(),
        p.runtime.clone(),
        LAYERS * CONTENT,
        1 << 20,
        16,
    )
    .unwrap();
    let mut src = state_blocks(3);
    // The state at 48 only: the one at 32 (a shorter prefix) is absent.
    store(&states, AT_48, &mut src, 1);
    let leases = Arc::new(LeaseTable::new(1 << 20, std::time::Duration::from_secs(60)));
    let mut sched =
        ConnectorScheduler::new(group, p.runtime.clone(), leases, ConnectorConfig::new(16));
    assert_eq!(sched.chunks_present(&[AT_48, AT_32]), vec![true, false]);
}
