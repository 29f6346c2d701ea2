"""The serving benchmark's inputs (kvpool-py/bench/bench_serve.py), without a server: the
local tokenizer round-trips every token id through text as `vllm serve` and its client see it,
and a scaled Mooncake trace keeps its requests' shared prefixes."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import bench_serve  # noqa: E402


def test_every_token_id_decodes_to_text_that_encodes_back_to_it(tmp_path):
    from transformers import AutoTokenizer

    bench_serve.make_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = list(range(3, bench_serve.VOCAB))
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1


def test_a_scaled_trace_keeps_lengths_in_step_and_prefixes_shared(tmp_path):
    src, dst = tmp_path / "t.jsonl", tmp_path / "s.jsonl"
    rows = [{"timestamp": 0, "input_length": 1600, "output_length": 40, "hash_ids": [7, 8, 9, 1]},
            {"timestamp": 5, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 2]},
            {"timestamp": 9, "input_length": 100000, "output_length": 9,
             "hash_ids": list(range(100, 296))},
            {"timestamp": 12, "input_length": 600, "output_length": 9, "hash_ids": [5, 6]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    block = bench_serve.scale_trace(str(src), str(dst), requests=3, scale=16, max_tokens=4000)
    assert block == 32
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == 3  # only the first `requests`
    assert out[0] == {"timestamp": 0, "input_length": 100, "output_length": 2,
                      "hash_ids": [7, 8, 9, 1]}
    # The second request still shares its first two blocks with the first.
    assert out[1]["hash_ids"][:2] == out[0]["hash_ids"][:2] and out[1]["input_length"] == 68
    assert out[1]["output_length"] == 1  # at least one token
    # A prompt past the cap is cut to it, with the blocks it still covers.
    assert out[2]["input_length"] == 4000 and len(out[2]["hash_ids"]) == 125


def test_pick_keeps_the_named_entries_in_order_and_refuses_unknown_names():
    import argparse

    import pytest

    ap = argparse.ArgumentParser()
    named = {"a": 1, "b": 2, "c": 3}
    assert bench_serve.pick(ap, named, None, "things") == named
    assert list(bench_serve.pick(ap, named, "c,a", "things")) == ["a", "c"]
    with pytest.raises(SystemExit):
        bench_serve.pick(ap, named, "a,z", "things")


def test_worst_gaps_are_the_longest_of_the_successful_requests_with_their_position():
    detailed = {
        # Seconds between tokens, per request; the second request failed.
        "itls": [[0.030, 0.120, 0.031], [0.500], [0.045, 0.029]],
        "errors": ["", "connection reset", ""],
    }
    assert bench_serve.worst_gaps(detailed) == [[120.0, 1], [45.0, 0], [31.0, 2]]
    assert bench_serve.worst_gaps({}) == []  # a result saved without --save-detailed


def test_rounds_alternate_the_order_of_configurations():
    configs = {"no connector": ["a"], "kvpool L1": ["b"], "kvpool daemon": ["c"]}
    even = bench_serve.round_order(configs, 0)
    odd = bench_serve.round_order(configs, 1)
    assert [name for _, name, _ in even] == ["no connector", "kvpool L1", "kvpool daemon"]
    assert [name for _, name, _ in odd] == ["kvpool daemon", "kvpool L1", "no connector"]
    # Each configuration keeps its index (its server's port) and its arguments in every round.
    assert sorted(odd) == sorted(even) == [(0, "no connector", ["a"]), (1, "kvpool L1", ["b"]),
                                           (2, "kvpool daemon", ["c"])]


def test_daemon_cpus_are_read_from_a_list_or_default_to_the_last_cpu_allowed():
    assert bench_serve.parse_cpus("1") == {1}
    assert bench_serve.parse_cpus("2-3,6") == {2, 3, 6}
    assert bench_serve.parse_cpus(None) == {max(os.sched_getaffinity(0))}
