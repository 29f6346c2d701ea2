//! A prompt's tail (its whole blocks in the chunk its last token falls in, that chunk's last
//! block never) is keyed block by block, so a repeated prompt is served to its last whole block, as vLLM's own prefix
//! cache would serve it, and a longer prompt over an earlier, shorter one finds the earlier
//! one's tail. Each test compares the loaded blocks byte for byte with the model.

mod protocol_fixture;

use kvpool_connector::BlockUpdate;
use kvpool_sim::kv_model::model_mismatches;
use protocol_fixture::*;

/// Four whole chunks, one whole tail block, then five tokens in a partial block.
const PROMPT: usize = 4 * CHUNK + BLOCK + 5;

/// Runs request `id` over `p` in `blocks` with nothing loaded, computing it in one step, and
/// commits its saves. Returns how many tail blocks the step saved.
fn compute_and_save(s: &mut Setup, id: &str, p: &[u32], blocks: &[u32]) -> usize {
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request(id, p), 0),
        (0, false)
    );
    s.sched.update_state_after_alloc(id, blocks, 0);
    let meta = s.sched.build_connector_meta(&[scheduled(
        id,
        BlockUpdate::Replace(blocks.to_vec()),
        p.len(),
    )]);
    let saved_tail = meta.requests[0].save_tail.len();
    let owned = p.to_vec();
    assert!(
        s.worker_step(&meta, &[(&owned, blocks, 0..p.len())])
            .is_empty()
    );
    s.settle();
    saved_tail
}

/// Loads request `id` over `p` into `blocks`; returns the tokens loaded.
fn load(s: &mut Setup, id: &str, p: &[u32], blocks: &[u32]) -> usize {
    let (hit, asynchronous) = s.sched.get_num_new_matched_tokens(&request(id, p), 0);
    assert!(!asynchronous, "L1 hits under a lease load synchronously");
    s.sched.update_state_after_alloc(id, blocks, hit);
    let meta = s.sched.build_connector_meta(&[scheduled(
        id,
        BlockUpdate::Replace(blocks.to_vec()),
        p.len(),
    )]);
    assert!(s.worker_step(&meta, &[]).is_empty(), "no load failed");
    hit
}

#[test]
fn an_exact_repeat_is_served_to_its_last_whole_block() {
    let mut s = setup();
    let p = prompt(PROMPT, 11);
    let a_blocks: Vec<u32> = (0..PROMPT.div_ceil(BLOCK) as u32).collect();
    assert_eq!(compute_and_save(&mut s, "a", &p, &a_blocks), 1);

    let b_blocks: Vec<u32> = (20..20 + a_blocks.len() as u32).collect();
    let served = 4 * CHUNK + BLOCK;
    assert!(model_mismatches(&s.w.kv, &p[..served], &b_blocks) > 0);
    assert_eq!(load(&mut s, "b", &p, &b_blocks), served);
    assert_eq!(PROMPT - served, 5, "only the partial block is recomputed");
    assert_eq!(
        model_mismatches(&s.w.kv, &p[..served], &b_blocks),
        0,
        "chunks and the tail block loaded byte for byte into other blocks"
    );
}

#[test]
fn a_longer_prompt_finds_the_tail_of_an_earlier_shorter_one() {
    let mut s = setup();
    let long = prompt(PROMPT + 40, 12);
    let short = &long[..PROMPT];
    let a_blocks: Vec<u32> = (0..PROMPT.div_ceil(BLOCK) as u32).collect();
    assert_eq!(compute_and_save(&mut s, "a", short, &a_blocks), 1);

    // The long prompt's fifth chunk was never saved whole: its first block comes from the
    // short prompt's tail.
    let c_blocks: Vec<u32> = (30..30 + (PROMPT + 40).div_ceil(BLOCK) as u32).collect();
    let served = 4 * CHUNK + BLOCK;
    assert_eq!(load(&mut s, "c", &long, &c_blocks), served);
    assert_eq!(model_mismatches(&s.w.kv, &long[..served], &c_blocks), 0);
}

#[test]
fn a_tail_is_found_only_after_the_same_prefix() {
    let mut s = setup();
    let p = prompt(PROMPT, 13);
    let a_blocks: Vec<u32> = (0..PROMPT.div_ceil(BLOCK) as u32).collect();
    compute_and_save(&mut s, "a", &p, &a_blocks);
    // The same tail tokens after another first chunk: nothing is served, not even the tail.
    let mut other = p.clone();
    other[0] ^= 1;
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("d", &other), 0),
        (0, false)
    );
    // A prompt that stops inside the tail block serves only its whole chunks.
    let shorter = &p[..4 * CHUNK + BLOCK - 1];
    assert_eq!(
        s.sched
            .get_num_new_matched_tokens(&request("e", shorter), 0),
        (4 * CHUNK, false)
    );
}

#[test]
fn the_tail_is_saved_once_the_prompt_is_computed() {
    let mut s = setup();
    let p = prompt(PROMPT, 14);
    let blocks: Vec<u32> = (0..PROMPT.div_ceil(BLOCK) as u32).collect();
    s.sched.get_num_new_matched_tokens(&request("a", &p), 0);
    s.sched.update_state_after_alloc("a", &blocks, 0);
    // A chunked prefill: two chunks, then the rest.
    let meta = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        2 * CHUNK,
    )]);
    assert!(
        meta.requests[0].save_tail.is_empty(),
        "the prompt is not computed yet"
    );
    let owned = p.clone();
    s.worker_step(&meta, &[(&owned, &blocks, 0..2 * CHUNK)]);
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("a", BlockUpdate::Unchanged, PROMPT)]);
    assert_eq!(meta.requests[0].save_tail.len(), 1);
    s.worker_step(&meta, &[(&owned, &blocks, 2 * CHUNK..PROMPT)]);
    // Decode steps save no tail again.
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("a", BlockUpdate::Unchanged, PROMPT + 1)]);
    assert!(meta.requests.iter().all(|r| r.save_tail.is_empty()));
    s.worker_step(&meta, &[]);
    s.settle();
    let b_blocks: Vec<u32> = (40..40 + blocks.len() as u32).collect();
    assert_eq!(load(&mut s, "b", &p, &b_blocks), 4 * CHUNK + BLOCK);
    assert_eq!(
        model_mismatches(&s.w.kv, &p[..4 * CHUNK + BLOCK], &b_blocks),
        0
    );
}

#[test]
fn a_prompt_shorter_than_a_chunk_is_served_from_its_tail() {
    let mut s = setup();
    // One whole block (the chunk's last block is never a tail block) and five tokens.
    let n = BLOCK + 5;
    let p = prompt(n, 15);
    let a_blocks: Vec<u32> = (0..n.div_ceil(BLOCK) as u32).collect();
    assert_eq!(compute_and_save(&mut s, "a", &p, &a_blocks), 1);
    let b_blocks: Vec<u32> = (50..50 + a_blocks.len() as u32).collect();
    assert_eq!(load(&mut s, "b", &p, &b_blocks), BLOCK);
    assert_eq!(model_mismatches(&s.w.kv, &p[..BLOCK], &b_blocks), 0);
}

#[test]
fn a_prompt_ending_on_a_chunk_boundary_is_served_to_its_last_whole_block() {
    let mut s = setup();
    let n = 3 * CHUNK;
    let p = prompt(n, 16);
    let a_blocks: Vec<u32> = (0..n.div_ceil(BLOCK) as u32).collect();
    // The last chunk is saved whole, and its blocks but the last one by one.
    assert_eq!(
        compute_and_save(&mut s, "a", &p, &a_blocks),
        CHUNK / BLOCK - 1
    );
    let b_blocks: Vec<u32> = (10..10 + a_blocks.len() as u32).collect();
    let served = n - BLOCK;
    assert_eq!(load(&mut s, "b", &p, &b_blocks), served);
    assert_eq!(
        model_mismatches(&s.w.kv, &p[..served], &b_blocks),
        0,
        "two whole chunks and the last chunk's tail blocks, byte for byte"
    );
    // A longer prompt over it finds the last chunk whole.
    let long: Vec<u32> = p.iter().copied().chain(prompt(BLOCK + 5, 17)).collect();
    let c_blocks: Vec<u32> = (20..20 + long.len().div_ceil(BLOCK) as u32).collect();
    assert_eq!(load(&mut s, "c", &long, &c_blocks), n);
    assert_eq!(model_mismatches(&s.w.kv, &long[..n], &c_blocks), 0);
}

#[test]
fn a_chunk_aligned_prompt_computed_in_two_steps_saves_its_tail_before_its_last_chunk() {
    let mut s = setup();
    let n = 2 * CHUNK;
    let p = prompt(n, 18);
    let blocks: Vec<u32> = (0..n.div_ceil(BLOCK) as u32).collect();
    s.sched.get_num_new_matched_tokens(&request("a", &p), 0);
    s.sched.update_state_after_alloc("a", &blocks, 0);
    // A chunked prefill that stops one block short: the first chunk, and the tail blocks of
    // the last (all of them are computed), but not the last chunk.
    let meta = s.sched.build_connector_meta(&[scheduled(
        "a",
        BlockUpdate::Replace(blocks.clone()),
        n - BLOCK,
    )]);
    let r = &meta.requests[0];
    assert_eq!(r.save.map(|sv| sv.save_until), Some(CHUNK as u32));
    assert_eq!(
        (r.save_tail_start, r.save_tail.len()),
        (CHUNK as u32, CHUNK / BLOCK - 1)
    );
    let owned = p.clone();
    s.worker_step(&meta, &[(&owned, &blocks, 0..n - BLOCK)]);
    let meta = s
        .sched
        .build_connector_meta(&[scheduled("a", BlockUpdate::Unchanged, n)]);
    let r = &meta.requests[0];
    assert_eq!(
        r.save.map(|sv| (sv.save_from, sv.save_until)),
        Some((CHUNK as u32, n as u32))
    );
    assert!(r.save_tail.is_empty(), "the tail is saved once");
    s.worker_step(&meta, &[(&owned, &blocks, n - BLOCK..n)]);
    s.settle();
    let b_blocks: Vec<u32> = (20..20 + blocks.len() as u32).collect();
    assert_eq!(load(&mut s, "b", &p, &b_blocks), n - BLOCK);
    assert_eq!(model_mismatches(&s.w.kv, &p[..n - BLOCK], &b_blocks), 0);
}
