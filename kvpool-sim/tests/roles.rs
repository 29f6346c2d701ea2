//! Disaggregated prefill's roles: a prefill instance (vLLM's `kv_producer`) saves what it
//! computes and never looks a prompt up, even one the pool holds; a decode instance
//! (`kv_consumer`) loads and saves nothing (every request `skip_save`).

mod protocol_fixture;

use kvpool_connector::{BlockUpdate, ConnectorConfig};
use protocol_fixture::*;

#[test]
fn a_producer_never_loads_and_still_saves_what_it_computes() {
    let mut s = setup_with(
        1,
        ConnectorConfig {
            loads: false,
            ..ConnectorConfig::new(BLOCK)
        },
    );
    let stored = prompt(2 * CHUNK + 3, 31);
    s.seed_pool(&stored);
    assert_eq!(s.pool_hit(&stored), 2 * CHUNK);
    assert_eq!(
        s.sched
            .get_num_new_matched_tokens(&request("a", &stored), 0),
        (0, false),
        "a producer looked the prompt up"
    );
    // A new prompt is computed and saved as with any role.
    let p = prompt(2 * CHUNK + 3, 32);
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request("b", &p), 0),
        (0, false)
    );
    let blocks: Vec<u32> = (0..p.len().div_ceil(BLOCK) as u32).collect();
    s.sched.update_state_after_alloc("b", &blocks, 0);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "b",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    assert!(
        s.worker_step(&meta, &[(&p, &blocks, 0..p.len())])
            .is_empty()
    );
    s.settle();
    assert_eq!(s.pool_hit(&p), 2 * CHUNK, "the producer's prompt was saved");
    assert!(s.wrong_chunks(&p).is_empty());
}

#[test]
fn a_consumer_loads_and_saves_nothing() {
    let mut s = setup();
    let stored = prompt(CHUNK + 3, 33);
    s.seed_pool(&stored);
    // A longer prompt than the pool holds: its second chunk is computed, not saved.
    let mut p = stored[..CHUNK].to_vec();
    p.extend(prompt(CHUNK + 3, 34));
    let mut req = request("c", &p);
    req.skip_save = true;
    let (hit, _) = s.sched.get_num_new_matched_tokens(&req, 0);
    assert_eq!(hit, CHUNK, "the consumer loads what the pool holds");
    let blocks: Vec<u32> = (0..p.len().div_ceil(BLOCK) as u32).collect();
    s.sched.update_state_after_alloc("c", &blocks, hit);
    let meta = s.sched.build_connector_meta(&[scheduled(
        "c",
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    assert!(
        s.worker_step(&meta, &[(&p, &blocks, CHUNK..p.len())])
            .is_empty()
    );
    s.settle();
    assert_eq!(
        s.pool_hit(&p),
        CHUNK,
        "the consumer saved its computed chunk"
    );
}

/// Saves `p` as request `id` would, then returns what it names for a hand-off and what a
/// later request of the same prompt (another engine's lookup) finds.
fn named_and_found(s: &mut Setup, id: &str, p: &[u32], first_block: u32) -> (usize, usize) {
    assert_eq!(s.sched.saved_prompt_tokens(id), 0, "no state yet");
    assert_eq!(
        s.sched.get_num_new_matched_tokens(&request(id, p), 0),
        (0, false)
    );
    let blocks: Vec<u32> = (first_block..first_block + p.len().div_ceil(BLOCK) as u32).collect();
    s.sched.update_state_after_alloc(id, &blocks, 0);
    let meta = s.sched.build_connector_meta(&[scheduled(
        id,
        BlockUpdate::Replace(blocks.clone()),
        p.len(),
    )]);
    assert!(s.worker_step(&meta, &[(p, &blocks, 0..p.len())]).is_empty());
    s.settle();
    let named = s.sched.saved_prompt_tokens(id);
    let later = format!("{id}-again");
    let (found, _) = s.sched.get_num_new_matched_tokens(&request(&later, p), 0);
    (named, found)
}

#[test]
fn a_finished_prompt_names_what_a_later_lookup_of_it_finds() {
    let mut s = setup();
    // Two whole chunks and two whole blocks past them, then 3 tokens of a third block: the
    // tail blocks count.
    let p = prompt(2 * CHUNK + 2 * BLOCK + 3, 35);
    assert_eq!(
        named_and_found(&mut s, "p", &p, 0),
        (2 * CHUNK + 2 * BLOCK, 2 * CHUNK + 2 * BLOCK)
    );
    // A prompt ending on a chunk boundary: a lookup stops before its last token, and finds
    // the last chunk's blocks but the last through their tail keys; that is what is named.
    let q = prompt(3 * CHUNK, 36);
    assert_eq!(
        named_and_found(&mut s, "q", &q, 20),
        (3 * CHUNK - BLOCK, 3 * CHUNK - BLOCK)
    );
    // Ending on a block boundary inside a chunk: to the block before the last.
    let r = prompt(CHUNK + BLOCK, 37);
    assert_eq!(named_and_found(&mut s, "r", &r, 40), (CHUNK, CHUNK));
}
