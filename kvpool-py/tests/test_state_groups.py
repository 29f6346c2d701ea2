"""The scheduler side of a hybrid model's recurrent-state parts (``kvpool.vllm.state_groups``),
with stand-ins for the pool's presence lookups and the attention part's tracker: which
boundary a hit ends on, where its state is loaded, which offers are saved, and every case in
which the state cannot be placed exactly (a miss, or a failed load vLLM recomputes)."""

from types import SimpleNamespace

from kvpool.vllm.hybrid import HybridSchedulerSide
from kvpool.vllm.state_groups import (MAX_STATE_CANDIDATES, StateGroup, StateSchedulerSide,
                                      state_candidates)

BS = 16  # engine block size = chunk size (one block per chunk)


class Pool:
    """Stand-in for a state part's lookups: which chunk hashes every rank holds."""

    def __init__(self, held=()):
        self.held = set(held)
        self.asked = []

    def chunk_size(self):
        return BS

    def chunks_present(self, keys):
        self.asked.append(list(keys))
        return [k in self.held for k in keys]

    def scope_digest(self):
        return "state"


class Tracker:
    """Stand-in for the attention part: its tracker's chunk hashes, and its hit."""

    def __init__(self, chunks, hit):
        self.native = SimpleNamespace(chunk_hashes=lambda req_id: [key(i) for i in range(chunks)])
        self.hit = hit
        self.allocs = []

    def get_num_new_matched_tokens(self, request, num_computed):
        return self.hit, True

    def update_state_after_alloc(self, request, blocks, n):
        self.allocs.append(n)


def key(chunk_index):
    """The chain hash of the chunk ``chunk_index`` (the prefix ending at its end)."""
    return bytes([chunk_index + 1]) * 16


def request(n, req_id="r"):
    return SimpleNamespace(request_id=req_id, num_tokens=n, prompt_token_ids=list(range(n)))


def blocks(*groups):
    return SimpleNamespace(get_block_ids=lambda: tuple(list(g) for g in groups))


def state_part(pool, tracker, index=1, saves=True, save_decode_tokens=False):
    group = StateGroup(index=index, layer_names=("l",), content_bytes=64,
                       key_format=f"group={index}/2:state")
    return StateSchedulerSide(group=group, socket_paths=[], block_size=BS, keys_of=tracker,
                              save_decode_tokens=save_decode_tokens, timeout_ms=100,
                              loads=True, saves=saves, native=pool)


def meta(part, offers=None):
    import json

    so = SimpleNamespace(preempted_req_ids=[], kv_connector_block_state=SimpleNamespace(
        boundary_state_offloads=offers or {}))
    data, _ = part.build_connector_meta(so)
    return json.loads(data)


def test_candidates_are_whole_chunks_short_of_the_last_token_longest_first():
    assert state_candidates(0, 64, 65, BS) == [64, 48, 32, 16]
    # The prompt's last token is always computed: never a hit at its end.
    assert state_candidates(0, 64, 64, BS) == [48, 32, 16]
    # Only past what vLLM computed, within what attention can load.
    assert state_candidates(16, 40, 100, BS) == [32]
    assert state_candidates(32, 40, 100, BS) == []
    assert len(state_candidates(0, 10_000, 10_001, BS)) == MAX_STATE_CANDIDATES


def test_a_hit_ends_where_every_state_part_holds_the_state_and_loads_it_into_its_slot():
    tracker = Tracker(chunks=4, hit=64)
    # Part 1 holds states after 16, 32 and 48 tokens; part 2 only after 16 and 32.
    one = state_part(Pool({key(0), key(1), key(2)}), tracker, index=1)
    two = state_part(Pool({key(0), key(1)}), tracker, index=2)
    hybrid = HybridSchedulerSide([tracker], [one, two])
    req = request(70)
    assert hybrid.get_num_new_matched_tokens(req, 0) == (32, True)
    # Part 2 was asked only about what part 1 holds.
    assert two.native.asked == [[key(2), key(1), key(0)]]
    # vLLM's align layout: nulls, then the block the state at 32 goes to (slot 32/16 - 1).
    hybrid.update_state_after_alloc(req, blocks([5, 6, 7], [0, 9, 10], [0, 11, 12]), 32)
    assert tracker.allocs == [32]
    assert meta(one)["loads"] == [["r", key(1).hex(), 9]]
    assert meta(two)["loads"] == [["r", key(1).hex(), 11]]


def test_no_state_at_any_boundary_is_a_miss_for_every_group():
    tracker = Tracker(chunks=4, hit=64)
    hybrid = HybridSchedulerSide([tracker], [state_part(Pool(), tracker)])
    assert hybrid.get_num_new_matched_tokens(request(70), 0) == (0, False)


def test_a_state_past_what_attention_can_load_is_not_used():
    tracker = Tracker(chunks=4, hit=16)
    part = state_part(Pool({key(2)}), tracker)
    hybrid = HybridSchedulerSide([tracker], [part])
    assert hybrid.get_num_new_matched_tokens(request(70), 0) == (0, False)
    assert part.native.asked == [[key(0)]]


def test_another_accepted_hit_or_layout_fails_the_load_instead_of_loading_elsewhere():
    tracker = Tracker(chunks=4, hit=64)
    part = state_part(Pool({key(1)}), tracker)
    hybrid = HybridSchedulerSide([tracker], [part])
    req = request(70)
    assert hybrid.get_num_new_matched_tokens(req, 0) == (32, True)
    # vLLM accepted 16 tokens, not the 32 whose state is held: recomputed, never loaded.
    part.update_state_after_alloc(req, blocks([1, 2], [0, 9]), 16)
    assert meta(part) == {"loads": [], "refused": ["r"], "saves": []}

    assert hybrid.get_num_new_matched_tokens(req, 0) == (32, True)
    # The state's slot is the null block: unexpected, recomputed.
    part.update_state_after_alloc(req, blocks([1, 2], [9, 0]), 32)
    assert meta(part)["refused"] == ["r"]

    # A load nobody promised.
    part.update_state_after_alloc(request(70, "other"), blocks([1, 2], [0, 9]), 32)
    assert meta(part)["refused"] == ["other"]

    # No external tokens: nothing loads, nothing fails.
    assert hybrid.get_num_new_matched_tokens(req, 0) == (32, True)
    part.update_state_after_alloc(req, blocks([1, 2], [0, 9]), 0)
    assert meta(part) == {"loads": [], "refused": [], "saves": []}


def test_only_this_groups_whole_chunk_prompt_boundaries_are_saved_under_the_prefix_key():
    tracker = Tracker(chunks=4, hit=0)
    part = state_part(Pool(), tracker, index=1)
    req = request(60)
    HybridSchedulerSide([tracker], [part]).get_num_new_matched_tokens(req, 0)
    offers = {"r": [(1, 7, 32), (2, 8, 32), (1, 0, 48), (1, 9, 40), (1, 10, 48)],
              # A request never looked up: its prompt is unknown, so nothing is saved.
              "unknown": [(1, 4, 16)]}
    saved = meta(part, offers)["saves"]
    assert saved == [[key(1).hex(), 7], [key(2).hex(), 10]], saved
    assert part.saved_prompt_tokens(req) == 48
    # Past the prompt (decode), saved only with save_decode_tokens.
    assert meta(part, {"r": [(1, 11, 64)]})["saves"] == []
    decoding = state_part(Pool(), Tracker(chunks=5, hit=0), save_decode_tokens=True)
    decoding.promise(req, 0, None, None)
    assert meta(decoding, {"r": [(1, 11, 64)]})["saves"] == [[key(3).hex(), 11]]
    # A consumer (kv_consumer) saves nothing.
    consumer = state_part(Pool(), tracker, saves=False)
    assert meta(consumer, offers)["saves"] == []


def test_a_boundary_whose_load_failed_is_not_offered_to_the_request_again():
    tracker = Tracker(chunks=4, hit=64)
    part = state_part(Pool({key(1), key(2)}), tracker)
    hybrid = HybridSchedulerSide([tracker], [part])
    req = request(70)
    assert hybrid.get_num_new_matched_tokens(req, 0) == (48, True)
    hybrid.update_state_after_alloc(req, blocks([1, 2, 3], [0, 0, 9]), 48)
    meta(part)
    # The load failed (vLLM's failed_recving): vLLM looks the request up again.
    part.update_connector_output(SimpleNamespace(finished_recving={"r"},
                                                 failed_recving={"r"}))
    assert hybrid.get_num_new_matched_tokens(req, 0) == (32, True)
    # Another request is offered the boundary still.
    assert hybrid.get_num_new_matched_tokens(request(70, "s"), 0) == (48, True)
    # Once the request ends, its failures are forgotten.
    part.request_finished(req)
    assert part.excluded("r") == set()
