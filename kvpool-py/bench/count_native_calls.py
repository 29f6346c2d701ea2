"""How often vLLM's connector calls cross from Python into kvpool's Rust (``kvpool._native``)
while a request loads its prefix from the pool: counted, per step and per loaded chunk, for
prefixes of a few and of many chunks, so a crossing made once per chunk shows as growth.

    cargo xtask vllm -k test_options   # once: the vLLM CPU venv with kvpool installed
    HF_HUB_OFFLINE=1 target/vllm-venv/bin/python kvpool-py/bench/count_native_calls.py

One in-process engine (vLLM's ``uni`` executor, so scheduler and worker run in this process's
main thread; the default multi-process mode splits the same calls between two processes), the
tests' random-weight 2-layer model, 256-token chunks, 32-token blocks. For each prefix length
the prompt is computed and stored once, then a second request with the same prompt loads it
from kvpool's L1; the crossings counted are those of the second request's steps (its lookup
through its first token), named by call. Counted with ``sys.setprofile`` (every call of a
native function or method from Python is a ``c_call`` event).
"""

import collections
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

#: Prefix lengths in tokens (256-token chunks): 4 and 16 chunks, each plus a 32-token suffix.
PREFIXES = (4 * 256, 16 * 256)


def native_name(fn) -> str | None:
    """``Class.method`` or ``function`` when ``fn`` is one of ``kvpool._native``'s, else
    ``None``."""
    owner = getattr(fn, "__self__", None)
    if owner is None:
        return None
    if getattr(owner, "__name__", None) == "kvpool._native":
        return fn.__name__
    cls = type(owner)
    if cls.__module__ == "kvpool._native":
        return f"{cls.__name__}.{fn.__name__}"
    return None


def main():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from make_model import make_model
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    scratch = tempfile.mkdtemp(prefix="kvpool-count-calls-")
    model = make_model(os.path.join(scratch, "model"), seed=0)
    llm = LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        block_size=32, max_model_len=8192, seed=0, enable_prefix_caching=False,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"config": {"local_cpu": {"max_size": "1GiB"}}}),
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, detokenize=False, ignore_eos=True, max_tokens=1)
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "c_call":
            name = native_name(arg)
            if name is not None:
                counts[name] += 1

    def run(req_id, prompt, counted):
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
        steps = 0
        if counted:
            counts.clear()
            sys.setprofile(profile)
        try:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            sys.setprofile(None)
        return steps

    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_shutdown, get_kv_transfer_group)

    results = []
    for n, prefix in enumerate(PREFIXES):
        prompt = [(7 * i + 13 * n) % 997 + 3 for i in range(prefix + 32)]
        run(f"store-{n}", prompt, counted=False)
        # Let the store's step commit (one more step after the request ends).
        for _ in range(3):
            engine.step()
        loaded_before = get_kv_transfer_group()._work.native.stats()["loaded_tokens"]
        steps = run(f"load-{n}", prompt, counted=True)
        loaded = get_kv_transfer_group()._work.native.stats()["loaded_tokens"] - loaded_before
        total = sum(counts.values())
        chunks = loaded // 256
        results.append({"prefix_tokens": prefix, "loaded_tokens": loaded,
                        "loaded_chunks": chunks, "steps": steps, "crossings": total,
                        "per_step": round(total / steps, 1),
                        "by_call": dict(sorted(counts.items()))})
        print(f"prefix {prefix} tokens: loaded {loaded} tokens ({chunks} chunks) in {steps} "
              f"steps, {total} crossings ({total / steps:.1f} per step)")
        for name, c in sorted(counts.items()):
            print(f"  {name:40} {c}")
    ensure_kv_transfer_shutdown()
    a, b = results
    if b["loaded_chunks"] > a["loaded_chunks"]:
        growth = (b["crossings"] - a["crossings"]) / (b["loaded_chunks"] - a["loaded_chunks"])
        print(f"crossings per extra loaded chunk: {growth:.2f}")
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
