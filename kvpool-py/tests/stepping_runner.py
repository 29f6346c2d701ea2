"""Steps one vLLM engine by hand and records when each token of each request arrives: what a
streaming client sees. Used by the asynchrony tests as a subprocess:
    python stepping_runner.py SPEC.json OUT.json
SPEC keys: model, kvpool (kv_connector_extra_config), multiprocess, prompt_a (token ids),
a_tokens (tokens A generates), prompt_b, b_after (submit B once A has this many tokens),
abort_b_after_s (abort B this long after submitting it; null: let it finish).
OUT: per request the arrival time of each token (seconds since B's submission), B's submission
and finish, and kvpool's stats and in-flight counters after the engine went idle.
"""

import json
import os
import sys
import time


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if not spec.get("multiprocess"):
        kwargs["distributed_executor_backend"] = "uni"
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        block_size=32, max_model_len=spec.get("max_model_len", 4096), seed=0,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvpool"]),
        **kwargs,
    )
    engine = llm.llm_engine

    def params(n):
        return SamplingParams(temperature=0, detokenize=False, ignore_eos=True, max_tokens=n)

    engine.add_request("A", {"prompt_token_ids": spec["prompt_a"]}, params(spec["a_tokens"]))
    times = {"A": [], "B": []}
    tokens = {"A": [], "B": []}
    b_submitted = None
    b_finished = None
    aborted = False
    abort_after = spec.get("abort_b_after_s")
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        for o in outs:
            got = list(o.outputs[0].token_ids)
            while len(times[o.request_id]) < len(got):
                times[o.request_id].append(now)
            tokens[o.request_id] = got
            if o.request_id == "B" and o.finished:
                b_finished = now
        if b_submitted is None and len(times["A"]) >= spec["b_after"]:
            engine.add_request("B", {"prompt_token_ids": spec["prompt_b"]}, params(4))
            b_submitted = time.monotonic()
        if (abort_after is not None and b_submitted is not None and not aborted
                and now - b_submitted >= abort_after):
            engine.abort_request(["B"])
            aborted = True
    # Let the connector finish what it owes (commits, held blocks) and settle.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    out = {
        "a_times": [t - b_submitted for t in times["A"]],
        "b_times": [t - b_submitted for t in times["B"]],
        "b_finished": None if b_finished is None else b_finished - b_submitted,
        "tokens": tokens,
        "aborted": aborted,
    }
    if not spec.get("multiprocess"):
        # vLLM's worker connector of this process (in-process mode).
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown, get_kv_transfer_group)

        worker = get_kv_transfer_group()._work
        out["in_flight"] = list(worker.native.in_flight())
        out["stats"] = dict(worker.native.stats())
        ensure_kv_transfer_shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
