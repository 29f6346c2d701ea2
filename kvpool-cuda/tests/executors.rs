//! Both executors against a reference of the chunk layout, on host memory: the host
//! executor, and the CUDA copy engine over the fake driver (batched and one segment at a
//! time), with the engine's stream ordering and the page-lock guards' lifetimes.

use std::sync::Arc;

use kvpool_cuda::fake::{Call, FakeDriver};
use kvpool_cuda::{
    CudaCopyEngine, CudaDriver, Direction, HostExecutor, HostRegistration, JobSpec, KvPlanes,
    Plane, RawStream, RegisterError,
};
use proptest::prelude::*;

/// The engine's KV in host memory: `planes` buffers of `blocks` rows of `stride` bytes, the
/// first `page` of each row a block's page.
struct Kv {
    buffers: Vec<Vec<u8>>,
    page: usize,
    stride: usize,
    blocks: usize,
}

impl Kv {
    fn new(planes: usize, page: usize, stride: usize, blocks: usize, seed: u8) -> Self {
        let buffers = (0..planes)
            .map(|p| {
                (0..stride * blocks)
                    .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ p as u8))
                    .collect()
            })
            .collect();
        Kv {
            buffers,
            page,
            stride,
            blocks,
        }
    }

    fn planes(&self) -> KvPlanes {
        KvPlanes::new(
            self.buffers
                .iter()
                .map(|b| Plane {
                    base: b.as_ptr() as u64,
                    row_stride: self.stride as u64,
                })
                .collect(),
            self.page as u64,
            self.blocks as u64,
        )
        .unwrap()
    }

    fn page_of(&self, plane: usize, block: u32) -> &[u8] {
        let at = block as usize * self.stride;
        &self.buffers[plane][at..at + self.page]
    }
}

/// A job's host side: chunks (and staged copies) as separate buffers.
struct Chunks {
    chunk_blocks: Vec<usize>,
    chunks: Vec<Vec<u8>>,
    staged: Vec<Option<Vec<u8>>>,
}

impl Chunks {
    fn new(chunk_blocks: Vec<usize>, block_bytes: usize, staged: &[bool], seed: u8) -> Self {
        let chunks = chunk_blocks
            .iter()
            .enumerate()
            .map(|(c, &n)| {
                (0..n * block_bytes)
                    .map(|i| (i as u8).wrapping_mul(7) ^ seed ^ (c as u8).wrapping_mul(13))
                    .collect()
            })
            .collect();
        let staged = chunk_blocks
            .iter()
            .zip(staged)
            .map(|(&n, &s)| s.then(|| vec![0xee; n * block_bytes]))
            .collect();
        Chunks {
            chunk_blocks,
            chunks,
            staged,
        }
    }

    fn ptrs(&self) -> Vec<u64> {
        self.chunks.iter().map(|c| c.as_ptr() as u64).collect()
    }

    fn staged_ptrs(&self) -> Vec<u64> {
        if self.staged.iter().all(Option::is_none) {
            return Vec::new();
        }
        self.staged
            .iter()
            .map(|s| s.as_ref().map_or(0, |b| b.as_ptr() as u64))
            .collect()
    }

    /// Block `j` of chunk `c` in plane `p`, as the chunk layout places it.
    fn page_of(&self, c: usize, plane: usize, j: usize, page: usize) -> &[u8] {
        let at = (plane * self.chunk_blocks[c] + j) * page;
        &self.chunks[c][at..at + page]
    }
}

/// Checks the reference: after a load every engine block holds its chunk's page; after a
/// save every chunk page holds its engine block's; a staged copy holds its chunk.
fn check(kv: &Kv, chunks: &Chunks, direction: Direction, ids: &[u32], skip: usize) {
    let mut k = 0;
    for (c, &bpc) in chunks.chunk_blocks.iter().enumerate() {
        let first = if c == 0 { skip } else { 0 };
        for j in first..bpc {
            let id = ids[k];
            k += 1;
            for plane in 0..kv.buffers.len() {
                assert_eq!(
                    kv.page_of(plane, id),
                    chunks.page_of(c, plane, j, kv.page),
                    "{direction:?}: chunk {c} block {j} plane {plane} (engine block {id})"
                );
            }
        }
        if let Some(staged) = &chunks.staged[c] {
            assert_eq!(staged, &chunks.chunks[c], "staged copy of chunk {c}");
        }
    }
    assert_eq!(k, ids.len());
}

#[derive(Debug, Clone)]
struct Case {
    planes: usize,
    page: usize,
    pad: usize,
    blocks: usize,
    chunk_blocks: Vec<usize>,
    skip: usize,
    staged: Vec<bool>,
    load: bool,
    /// Engine block ids: a permutation's prefix, runs of consecutive ids kept.
    ids: Vec<u32>,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..5,
        prop::sample::select(vec![8usize, 16, 64, 256]),
        prop::sample::select(vec![0usize, 8, 64]),
        prop::collection::vec(1usize..6, 1..5),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(|(planes, page, pad, chunk_blocks, load, seed)| {
            let total: usize = chunk_blocks.iter().sum();
            let max_skip = if load { chunk_blocks[0] - 1 } else { 0 };
            let n = chunk_blocks.len();
            (
                Just((planes, page, pad, chunk_blocks, load, seed)),
                0..=max_skip,
                prop::collection::vec(any::<bool>(), n),
                Just(total),
            )
        })
        .prop_map(
            |((planes, page, pad, chunk_blocks, load, seed), skip, staged, total)| {
                let blocks = total * 2 + 3;
                // Ids in runs: consecutive where the seed's bits say so (merged segments), else
                // scattered (one segment per page).
                let mut ids = Vec::new();
                let mut next = (seed % 5) as u32;
                for i in 0..total - skip {
                    if (seed >> (i % 64)) & 1 == 1 {
                        next += 2;
                    } else {
                        next += 1;
                    }
                    ids.push(next % blocks as u32);
                }
                ids.sort_unstable();
                ids.dedup();
                while ids.len() < total - skip {
                    let candidate = (0..blocks as u32).find(|b| !ids.contains(b)).unwrap();
                    ids.push(candidate);
                }
                Case {
                    planes,
                    page,
                    pad,
                    blocks,
                    chunk_blocks,
                    skip,
                    staged,
                    load,
                    ids,
                }
            },
        )
}

fn job<'a>(case: &'a Case, ptrs: &'a [u64], staged: &'a [u64], block_bytes: u64) -> JobSpec<'a> {
    JobSpec {
        direction: if case.load {
            Direction::Load
        } else {
            Direction::Save
        },
        block_ids: &case.ids,
        skip_blocks: case.skip,
        chunk_blocks: &case.chunk_blocks,
        block_bytes,
        chunk_ptrs: ptrs,
        check_copy_ptrs: staged,
    }
}

enum Executor {
    Host,
    Fake { batch: bool },
}

fn run_case(case: &Case, executor: Executor) {
    let kv = Kv::new(case.planes, case.page, case.page + case.pad, case.blocks, 3);
    let block_bytes = case.planes * case.page;
    let chunks = Chunks::new(case.chunk_blocks.clone(), block_bytes, &case.staged, 5);
    let ptrs = chunks.ptrs();
    let staged = chunks.staged_ptrs();
    let spec = job(case, &ptrs, &staged, block_bytes as u64);
    match executor {
        Executor::Host => {
            // SAFETY: the planes and chunks are live buffers of this function.
            let stats = unsafe { HostExecutor::new(kv.planes()).run(&spec) }.unwrap();
            // A save's staged page goes to two places; a load's staged chunk is one copy.
            assert!(stats.segments <= 2 * stats.pages + case.chunk_blocks.len());
        }
        Executor::Fake { batch } => {
            let driver = Arc::new(FakeDriver::new(batch));
            // SAFETY: as above (the fake's "device" memory is host memory).
            let mut engine = unsafe { CudaCopyEngine::new(driver.clone(), kv.planes()) }.unwrap();
            // SAFETY: as above.
            let submitted = unsafe { engine.submit(7, &spec, RawStream(0)) }.unwrap();
            assert_eq!(submitted.batched, batch);
            assert_eq!(engine.poll(), vec![(7, Ok(()))]);
        }
    }
    let direction = spec.direction;
    check(&kv, &chunks, direction, &case.ids, case.skip);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn the_host_executor_puts_every_page_where_the_chunk_layout_says(case in cases()) {
        run_case(&case, Executor::Host);
    }

    #[test]
    fn the_copy_engine_moves_the_same_bytes_batched_or_not(case in cases(), batch in any::<bool>()) {
        run_case(&case, Executor::Fake { batch });
    }
}

fn small_engine(batch: bool) -> (Arc<FakeDriver>, CudaCopyEngine, Kv) {
    let kv = Kv::new(2, 64, 64, 16, 1);
    let driver = Arc::new(FakeDriver::new(batch));
    // SAFETY: the planes are `kv`'s buffers, returned with the engine and dropped after it
    // by the callers (declared after it in their bindings' order of use).
    let engine = unsafe { CudaCopyEngine::new(driver.clone(), kv.planes()) }.unwrap();
    (driver, engine, kv)
}

#[test]
fn a_job_waits_for_the_compute_stream_and_a_load_is_waited_for_by_it() {
    let (driver, mut engine, _kv) = small_engine(true);
    let ours = engine.copy_stream().raw();
    let compute = RawStream(0xc0);
    for load in [false, true] {
        let chunks = Chunks::new(vec![2], 128, &[false], 9);
        let ptrs = chunks.ptrs();
        let spec = JobSpec {
            direction: if load {
                Direction::Load
            } else {
                Direction::Save
            },
            block_ids: &[3, 4],
            skip_blocks: 0,
            chunk_blocks: &[2],
            block_bytes: 128,
            chunk_ptrs: &ptrs,
            check_copy_ptrs: &[],
        };
        driver.clear_calls();
        // SAFETY: live buffers.
        unsafe { engine.submit(1, &spec, compute) }.unwrap();
        let calls = driver.calls();
        let Call::EventRecord(start, s) = calls[0] else {
            panic!("{calls:?}")
        };
        assert_eq!(
            s, compute,
            "the first event marks the compute stream's work so far"
        );
        assert_eq!(calls[1], Call::StreamWaitEvent(ours, start));
        // Two planes, consecutive blocks, one chunk: two segments in one batch.
        assert_eq!(calls[2], Call::CopyBatch(2, ours));
        let Call::EventRecord(done, s) = calls[3] else {
            panic!("{calls:?}")
        };
        assert_eq!(s, ours);
        if load {
            assert_eq!(calls[4..], [Call::StreamWaitEvent(compute, done)]);
        } else {
            assert_eq!(calls.len(), 4, "a save holds nothing on the compute stream");
        }
        assert_eq!(engine.poll(), vec![(1, Ok(()))]);
        // Nothing on the step path synchronizes the host with a stream or the device.
        assert!(
            !driver
                .calls()
                .iter()
                .any(|c| matches!(c, Call::StreamSynchronize(_) | Call::EventSynchronize(_)))
        );
    }
}

#[test]
fn jobs_are_reported_only_once_their_events_passed_and_wait_waits_for_those_alone() {
    let (driver, mut engine, _kv) = small_engine(true);
    driver.hold_events(true);
    let chunks = Chunks::new(vec![1], 128, &[false], 2);
    let ptrs = chunks.ptrs();
    for id in [1, 2] {
        let spec = JobSpec {
            direction: Direction::Save,
            block_ids: &[id as u32],
            skip_blocks: 0,
            chunk_blocks: &[1],
            block_bytes: 128,
            chunk_ptrs: &ptrs,
            check_copy_ptrs: &[],
        };
        // SAFETY: live buffers.
        unsafe { engine.submit(id, &spec, RawStream(0)) }.unwrap();
    }
    assert!(engine.poll().is_empty());
    assert_eq!(engine.in_flight(), 2);
    driver.clear_calls();
    assert_eq!(engine.wait(&[2]), vec![(2, Ok(()))]);
    assert!(matches!(driver.calls()[..], [Call::EventSynchronize(_)]));
    assert!(engine.poll().is_empty(), "job 1's event has not passed");
    driver.finish_events();
    assert_eq!(engine.poll(), vec![(1, Ok(()))]);
    assert_eq!(engine.in_flight(), 0);
}

#[test]
fn a_refused_batch_falls_back_to_one_copy_per_segment_with_the_same_bytes() {
    let case = Case {
        planes: 3,
        page: 64,
        pad: 0,
        blocks: 20,
        chunk_blocks: vec![4, 2],
        skip: 1,
        staged: vec![true, false],
        load: true,
        ids: vec![9, 10, 11, 2, 5],
    };
    let kv = Kv::new(3, 64, 64, 20, 4);
    let chunks = Chunks::new(case.chunk_blocks.clone(), 192, &case.staged, 8);
    let ptrs = chunks.ptrs();
    let staged = chunks.staged_ptrs();
    let spec = job(&case, &ptrs, &staged, 192);
    let driver = Arc::new(FakeDriver::new(true));
    driver.fail_next_batches(1);
    // SAFETY: live buffers.
    let mut engine = unsafe { CudaCopyEngine::new(driver.clone(), kv.planes()) }.unwrap();
    // SAFETY: live buffers.
    let submitted = unsafe { engine.submit(1, &spec, RawStream(0)) }.unwrap();
    assert!(!submitted.batched);
    assert!(!engine.batched(), "later jobs go one segment at a time");
    check(&kv, &chunks, Direction::Load, &case.ids, case.skip);
    assert!(
        driver
            .calls()
            .iter()
            .any(|c| matches!(c, Call::StreamSynchronize(_))),
        "what the refused batch may have queued is waited for before copying again"
    );
}

#[test]
fn a_bad_job_fails_before_anything_is_queued() {
    let (driver, mut engine, _kv) = small_engine(true);
    let chunks = Chunks::new(vec![2], 128, &[false], 2);
    let ptrs = chunks.ptrs();
    let spec = JobSpec {
        direction: Direction::Load,
        block_ids: &[3, 99],
        skip_blocks: 0,
        chunk_blocks: &[2],
        block_bytes: 128,
        chunk_ptrs: &ptrs,
        check_copy_ptrs: &[],
    };
    driver.clear_calls();
    // SAFETY: live buffers.
    let err = unsafe { engine.submit(1, &spec, RawStream(0)) }.unwrap_err();
    assert!(err.to_string().contains("engine block 99"), "{err}");
    assert!(driver.calls().is_empty());
    assert_eq!(engine.in_flight(), 0);
}

#[test]
fn streams_and_events_are_destroyed_with_the_engine() {
    let (driver, mut engine, _kv) = small_engine(false);
    let chunks = Chunks::new(vec![1], 128, &[false], 2);
    let ptrs = chunks.ptrs();
    let spec = JobSpec {
        direction: Direction::Save,
        block_ids: &[1],
        skip_blocks: 0,
        chunk_blocks: &[1],
        block_bytes: 128,
        chunk_ptrs: &ptrs,
        check_copy_ptrs: &[],
    };
    for id in 0..5 {
        // SAFETY: live buffers.
        unsafe { engine.submit(id, &spec, RawStream(0)) }.unwrap();
        assert_eq!(engine.poll().len(), 1);
    }
    let (streams, events) = driver.alive();
    assert_eq!(streams, 1);
    assert_eq!(events, 2, "events are reused once their job ended");
    drop(engine);
    assert_eq!(driver.alive(), (0, 0));
}

#[test]
fn a_registration_lives_with_its_memory_and_a_range_is_never_locked_twice() {
    let driver = Arc::new(FakeDriver::new(true));
    let pool = kvpool_core::memory::MemoryPool::new(1 << 20).unwrap();
    let (ptr, len) = pool.arena_region();
    let dyn_driver: Arc<dyn CudaDriver> = driver.clone();
    let kv = Kv::new(1, 64, 64, 4, 0);
    // SAFETY: the planes are `kv`'s buffers, which outlive the engine.
    let engine = unsafe { CudaCopyEngine::new(dyn_driver.clone(), kv.planes()) }.unwrap();
    // SAFETY: the arena stays allocated until the pool drops, which drops the guard first.
    let guard = unsafe {
        HostRegistration::register(dyn_driver.clone(), ptr, len, vec![engine.copy_stream()])
    }
    .unwrap();
    pool.attach_to_arena(Box::new(guard));
    assert_eq!(driver.registered().get(&ptr), Some(&len));
    // The same range, or part of it, again: refused by kvpool before the driver is asked.
    driver.clear_calls();
    // SAFETY: the range is live (the pool holds it).
    let again = unsafe { HostRegistration::register(dyn_driver.clone(), ptr + 4096, 4096, vec![]) };
    assert!(matches!(
        again,
        Err(RegisterError::AlreadyRegistered { .. })
    ));
    assert!(driver.calls().is_empty());
    let stream = engine.copy_stream().raw();
    driver.clear_calls();
    drop(pool);
    // The pool's drop waited for kvpool's stream, then unlocked the arena.
    assert_eq!(
        driver.calls(),
        vec![Call::StreamSynchronize(stream), Call::Unregister(ptr)]
    );
    assert!(driver.registered().is_empty());
    // A new pool (likely at the same addresses) locks again.
    let pool = kvpool_core::memory::MemoryPool::new(1 << 20).unwrap();
    let (ptr, len) = pool.arena_region();
    // SAFETY: as above.
    let guard =
        unsafe { HostRegistration::register(dyn_driver.clone(), ptr, len, vec![]) }.unwrap();
    pool.attach_to_arena(Box::new(guard));
    drop(pool);
    drop(engine);
    assert_eq!(driver.alive(), (0, 0));
}

#[test]
fn memory_the_driver_says_is_locked_already_is_refused() {
    let driver = Arc::new(FakeDriver::new(true));
    let memory = vec![0u8; 8192];
    let ptr = memory.as_ptr() as usize;
    // Locked behind kvpool's back (another library in the process).
    // SAFETY: `memory` outlives the registration (unregistered below).
    unsafe { driver.host_register(ptr, 8192) }.unwrap();
    let dyn_driver: Arc<dyn CudaDriver> = driver.clone();
    // SAFETY: `memory` is live.
    let refused = unsafe { HostRegistration::register(dyn_driver, ptr, 4096, vec![]) };
    assert!(
        matches!(refused, Err(RegisterError::AlreadyRegistered { .. })),
        "{refused:?}"
    );
    driver.host_unregister(ptr).unwrap();
}

/// 16-byte aligned host memory (as torch's allocations and L1's regions are).
fn aligned(bytes: usize, seed: u8) -> Vec<u128> {
    let mut v = vec![0u128; bytes / 16];
    // SAFETY: a u128 buffer viewed as its bytes.
    let b = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), bytes) };
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(13) ^ seed;
    }
    v
}

fn bytes_of(v: &[u128]) -> &[u8] {
    // SAFETY: a u128 buffer viewed as its bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 16) }
}

/// Small scattered pages in registered host memory go through the copy kernel in `Auto`
/// (and `Kernel`) mode, byte for byte, with the job's table in the ring until it ends; `Dma`
/// mode, unregistered host memory or a driver without the kernel go as a batch.
#[test]
fn small_scattered_pages_in_registered_memory_go_through_the_copy_kernel() {
    use kvpool_cuda::CopyMode;

    const PAGE: usize = 64;
    const BLOCKS: usize = 32;
    for (mode, kernel_driver, register, expect_kernel) in [
        (CopyMode::Auto, true, true, true),
        (CopyMode::Kernel, true, true, true),
        (CopyMode::Dma, true, true, false),
        (CopyMode::Auto, true, false, false),
        (CopyMode::Auto, false, true, false),
    ] {
        let planes_mem: Vec<Vec<u128>> = (0..2).map(|p| aligned(PAGE * BLOCKS, p)).collect();
        let planes = KvPlanes::new(
            planes_mem
                .iter()
                .map(|m| Plane {
                    base: m.as_ptr() as u64,
                    row_stride: PAGE as u64,
                })
                .collect(),
            PAGE as u64,
            BLOCKS as u64,
        )
        .unwrap();
        let chunk = aligned(4 * 2 * PAGE, 0x5a);
        let driver = FakeDriver::new(true);
        let driver = Arc::new(if kernel_driver {
            driver.with_kernel()
        } else {
            driver
        });
        let dyn_driver: Arc<dyn CudaDriver> = driver.clone();
        let registration = register.then(|| {
            // SAFETY: `chunk` outlives the registration (dropped at the end of the loop body).
            unsafe {
                HostRegistration::register(
                    dyn_driver.clone(),
                    chunk.as_ptr() as usize,
                    chunk.len() * 16,
                    vec![],
                )
            }
            .unwrap()
        });
        // SAFETY: the planes are live buffers of this loop body.
        let mut engine = unsafe { CudaCopyEngine::new(dyn_driver.clone(), planes) }.unwrap();
        engine.set_mode(mode);
        let ids = [9u32, 3, 17, 5];
        let ptrs = [chunk.as_ptr() as u64];
        let spec = JobSpec {
            direction: Direction::Load,
            block_ids: &ids,
            skip_blocks: 0,
            chunk_blocks: &[4],
            block_bytes: 2 * PAGE as u64,
            chunk_ptrs: &ptrs,
            check_copy_ptrs: &[],
        };
        driver.hold_events(true);
        // SAFETY: live buffers.
        let submitted = unsafe { engine.submit(1, &spec, RawStream(0)) }.unwrap();
        assert_eq!(
            submitted.kernel, expect_kernel,
            "{mode:?} {kernel_driver} {register}"
        );
        let kernel_calls = driver
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::CopyKernel(8, _)))
            .count();
        assert_eq!(kernel_calls, usize::from(expect_kernel));
        let chunk_bytes = bytes_of(&chunk);
        for (p, plane) in planes_mem.iter().enumerate() {
            let plane = bytes_of(plane);
            for (j, &id) in ids.iter().enumerate() {
                let at = id as usize * PAGE;
                let from = (p * 4 + j) * PAGE;
                assert_eq!(&plane[at..at + PAGE], &chunk_bytes[from..from + PAGE]);
            }
        }
        // The table stays in use while the job is in flight, and is freed when it ends.
        assert!(engine.poll().is_empty());
        driver.finish_events();
        assert_eq!(engine.poll(), vec![(1, Ok(()))]);
        drop(engine);
        drop(registration);
        assert_eq!(
            driver.host_allocated(),
            0,
            "the table ring is freed with the engine"
        );
    }
}

/// Pages the copy kernel cannot move as 16-byte words (an odd page length) go as DMA even
/// when the kernel is asked for.
#[test]
fn pages_not_in_16_byte_words_go_as_dma() {
    use kvpool_cuda::CopyMode;

    let planes_mem = aligned(24 * 8, 1);
    let planes = KvPlanes::new(
        vec![Plane {
            base: planes_mem.as_ptr() as u64,
            row_stride: 24,
        }],
        24,
        8,
    )
    .unwrap();
    let chunk = aligned(48, 2);
    let driver = Arc::new(FakeDriver::new(true).with_kernel());
    let dyn_driver: Arc<dyn CudaDriver> = driver.clone();
    // SAFETY: `chunk` outlives the registration.
    let registration = unsafe {
        HostRegistration::register(dyn_driver.clone(), chunk.as_ptr() as usize, 48, vec![])
    }
    .unwrap();
    // SAFETY: live buffers.
    let mut engine = unsafe { CudaCopyEngine::new(dyn_driver, planes) }.unwrap();
    engine.set_mode(CopyMode::Kernel);
    let ptrs = [chunk.as_ptr() as u64];
    let spec = JobSpec {
        direction: Direction::Save,
        block_ids: &[1, 5],
        skip_blocks: 0,
        chunk_blocks: &[2],
        block_bytes: 24,
        chunk_ptrs: &ptrs,
        check_copy_ptrs: &[],
    };
    // SAFETY: live buffers.
    let submitted = unsafe { engine.submit(1, &spec, RawStream(0)) }.unwrap();
    assert!(!submitted.kernel);
    assert_eq!(engine.poll(), vec![(1, Ok(()))]);
    drop(engine);
    drop(registration);
}

/// A long phase (past the 4 MiB from which the host executor copies with several threads),
/// pages split across threads mid-page, still lands byte for byte.
#[test]
fn a_long_phase_copied_by_several_threads_is_byte_exact() {
    let case = Case {
        planes: 2,
        page: 40_000,
        pad: 16,
        blocks: 200,
        chunk_blocks: vec![30, 30, 7],
        skip: 3,
        staged: vec![true, false, false],
        load: true,
        ids: (0..64).map(|i| (i * 3) as u32).collect(),
    };
    for load in [true, false] {
        let mut case = case.clone();
        case.load = load;
        if !load {
            case.skip = 0;
            case.ids = (0..67).map(|i| (i * 2 + 1) as u32).collect();
        }
        let kv = Kv::new(case.planes, case.page, case.page + case.pad, case.blocks, 6);
        let block_bytes = case.planes * case.page;
        let chunks = Chunks::new(case.chunk_blocks.clone(), block_bytes, &case.staged, 9);
        let ptrs = chunks.ptrs();
        let staged = chunks.staged_ptrs();
        let spec = job(&case, &ptrs, &staged, block_bytes as u64);
        // SAFETY: live buffers.
        let executor = unsafe { HostExecutor::new(kv.planes()) }.with_threads(3);
        // SAFETY: live buffers.
        let stats = unsafe { executor.run(&spec) }.unwrap();
        assert!(stats.bytes >= 4 << 20, "{stats:?}");
        check(&kv, &chunks, spec.direction, &case.ids, case.skip);
    }
}

/// Jobs are tracked by id (completion, the copy table's life): a second job under the id of
/// one in flight is refused before anything is queued.
#[test]
fn a_job_id_in_flight_is_refused_for_a_second_job() {
    let (driver, mut engine, _kv) = small_engine(true);
    driver.hold_events(true);
    let chunks = Chunks::new(vec![1], 128, &[false], 2);
    let ptrs = chunks.ptrs();
    let spec = JobSpec {
        direction: Direction::Save,
        block_ids: &[1],
        skip_blocks: 0,
        chunk_blocks: &[1],
        block_bytes: 128,
        chunk_ptrs: &ptrs,
        check_copy_ptrs: &[],
    };
    // SAFETY: live buffers.
    unsafe { engine.submit(5, &spec, RawStream(0)) }.unwrap();
    driver.clear_calls();
    // SAFETY: live buffers.
    let err = unsafe { engine.submit(5, &spec, RawStream(0)) }.unwrap_err();
    assert!(err.to_string().contains("in flight"), "{err}");
    assert!(driver.calls().is_empty());
    driver.finish_events();
    assert_eq!(engine.poll(), vec![(5, Ok(()))]);
}
