"""Runs one vLLM engine (optionally with kvpool) over token-id prompts; writes a JSON result.

Used by the end-to-end tests as a subprocess, so every engine is a fresh process:
    python vllm_runner.py SPEC.json OUT.json
SPEC keys: model, prompts (lists of token ids), max_tokens, kvpool (null, or the
kv_connector_extra_config dict), multiprocess, num_gpu_blocks (forces a small KV cache),
max_num_seqs, prefix_caching, batches (lists of prompt indexes, one generate() each),
kill_after_batch ({batch index: pid to SIGKILL after it, or "self"}), check_blocks (compare what
kvpool stored with vLLM's own KV blocks; single process only), scrape_metrics (a port: fetch
kvpool's Prometheus endpoint after the last batch), kv_events_port (turn on vLLM's KV events,
published over ZMQ to a subscriber this process binds on 127.0.0.1:port; the events received
are returned, after stepping the engine on until no more arrive: `kv_events_settled`),
served_model_name, env (variables set before vLLM starts), async_scheduling
(turn vLLM's asynchronous scheduling on: the CPU platform switches it off, so the runner puts it
back after the platform's config check), tensor_parallel_size (ranks as worker processes; on
this CPU build with ``VLLM_CPU_OMP_THREADS_BIND`` in ``env``, one core per rank),
hold_after_batch ({batch index: {"ready": path, "go": path}}: after that batch, create
``ready`` and wait, up to 120 s, for ``go`` to exist: the test changes the world meanwhile),
dtype (default float32), disable_hybrid_kv_cache_manager (vLLM's flag; unset: vLLM decides),
kv_role (vLLM's, default kv_both), rank_start ("fork": the EngineCore is forked from this
process and the ranks from the EngineCore, rather than spawned as the CPU build forces; unset:
as vLLM starts them; refused with kv_events_port or check_blocks, whose state here a forked
EngineCore would inherit).
"""

import json
import os
import signal
import sys
import time


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.update(spec.get("env") or {})
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.get("kv_cache_gib", 1))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    use_kvpool = spec.get("kvpool") is not None
    if use_kvpool:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool.vllm",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvpool"],
        )
    if spec.get("tensor_parallel_size", 1) > 1:
        # vLLM's workers, one process per rank (spawned: this script's body is guarded).
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
    elif not spec.get("multiprocess"):
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("served_model_name"):
        kwargs["served_model_name"] = spec["served_model_name"]
    # What to put back after the CPU platform's config check has run.
    after_platform_check = []
    if spec.get("async_scheduling"):
        kwargs["async_scheduling"] = True

        def keep_async(vllm_config):
            vllm_config.scheduler_config.async_scheduling = True

        after_platform_check.append(keep_async)
    if spec.get("rank_start") == "fork":
        if spec.get("kv_events_port") or spec.get("check_blocks"):
            raise SystemExit("rank_start fork: a forked EngineCore would inherit this "
                             "process's KV-event subscriber or block-recording patch")
        # The EngineCore forked from this process and the ranks from the EngineCore (vLLM's
        # default where CUDA is not initialized) instead of spawned (what the CPU build
        # forces): each skips vLLM's import, ~35 s on this VM. Of kvpool's they inherit only
        # its imported module (vLLM's config check imports the connector class): no engine
        # exists here yet, and the EngineCore forks its ranks before it builds its scheduler.
        def fork_ranks(vllm_config):
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

        after_platform_check.append(fork_ranks)
    if after_platform_check:
        from vllm.platforms import cpu as cpu_platform

        check = cpu_platform.CpuPlatform.check_and_update_config.__func__

        def check_then_restore(cls, vllm_config):
            check(cls, vllm_config)
            for restore in after_platform_check:
                restore(vllm_config)

        cpu_platform.CpuPlatform.check_and_update_config = classmethod(check_then_restore)
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("disable_hybrid_kv_cache_manager") is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = spec["disable_hybrid_kv_cache_manager"]
    blocks_of = {}
    preempted = set()
    if use_kvpool and not spec.get("multiprocess"):
        from kvpool.vllm import KvpoolConnector

        build = KvpoolConnector.build_connector_meta

        def counting(self, scheduler_output):
            preempted.update(scheduler_output.preempted_req_ids or ())
            return build(self, scheduler_output)

        KvpoolConnector.build_connector_meta = counting
    if use_kvpool and spec.get("check_blocks"):
        from kvpool.vllm import KvpoolConnector

        original = KvpoolConnector.update_state_after_alloc

        def recording(self, request, blocks, num_external_tokens):
            blocks_of[tuple(request.prompt_token_ids)] = list(blocks.get_block_ids()[0])
            return original(self, request, blocks, num_external_tokens)

        KvpoolConnector.update_state_after_alloc = recording
    subscriber = None
    if spec.get("kv_events_port"):
        from vllm.config import KVEventsConfig

        subscriber = EventSubscriber(spec["kv_events_port"])
        # An endpoint without a wildcard makes vLLM's publisher connect to our socket.
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{spec['kv_events_port']}", topic="kv")
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("vllm_metrics"):
        # vLLM's Prometheus stat logger (in this process) records connector stats too.
        kwargs["disable_log_stats"] = False
    started = time.time()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec.get("dtype", "float32"),
        block_size=32,
        max_model_len=spec.get("max_model_len", 4096),
        max_num_seqs=spec.get("max_num_seqs", 256),
        enable_prefix_caching=spec.get("prefix_caching", True),
        seed=0,
        **kwargs,
    )
    startup = time.time() - started
    sp = SamplingParams(temperature=0, detokenize=False, ignore_eos=True, logprobs=1,
                        max_tokens=spec.get("max_tokens", 8))
    prompts = spec["prompts"]
    batches = spec.get("batches") or [list(range(len(prompts)))]
    results = [None] * len(prompts)
    kill_after = {int(k): v for k, v in (spec.get("kill_after_batch") or {}).items()}
    batch_s = []
    out_blocks = {}
    for b, batch in enumerate(batches):
        t0 = time.time()
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in batch], sp,
                            use_tqdm=False)
        batch_s.append(time.time() - t0)
        for i, o in zip(batch, outs):
            c = o.outputs[0]
            results[i] = {
                "tokens": list(c.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                "num_cached_tokens": o.num_cached_tokens,
            }
        if use_kvpool and spec.get("check_blocks"):
            # Right after the batch, before a later one reuses the freed blocks.
            from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

            reports = compare_blocks(get_kv_transfer_group(), [prompts[i] for i in batch],
                                     blocks_of)
            out_blocks.update(zip(batch, reports))
        hold = (spec.get("hold_after_batch") or {}).get(str(b))
        if hold:
            open(hold["ready"], "w").close()
            deadline = time.time() + 120
            while not os.path.exists(hold["go"]) and time.time() < deadline:
                time.sleep(0.05)
        if b in kill_after:
            victim = kill_after[b]
            os.kill(os.getpid() if victim == "self" else victim, signal.SIGKILL)
    out = {"results": results, "startup_s": startup, "batch_s": batch_s,
           "preempted_requests": len(preempted),
           "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)}
    if subscriber is not None:
        if use_kvpool:
            # A tier's event for a write that ends after the engine's last step (a disk
            # tier's write-behind of the last batch's values) reaches vLLM's publisher only
            # with a later step. Step on with a prompt too short to fill a block (nothing of
            # its own to announce) until two steps in a row publish nothing new.
            # `kv_events_settled` says whether that happened within 20 steps.
            short = SamplingParams(temperature=0, detokenize=False, max_tokens=1)
            quiet = 0
            for _ in range(20):
                published = subscriber.batches_received()
                time.sleep(0.25)
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], short, use_tqdm=False)
                time.sleep(0.25)  # the publisher's send and the subscriber's receive
                quiet = quiet + 1 if subscriber.batches_received() == published else 0
                if quiet == 2:
                    break
            out["kv_events_settled"] = quiet == 2
        out["kv_events"] = subscriber.stop()
    if spec.get("vllm_metrics"):
        from prometheus_client import REGISTRY

        totals = {}
        for family in REGISTRY.collect():
            for sample in family.samples:
                if sample.name.startswith("vllm:kvpool_") and sample.name.endswith("_total"):
                    totals[sample.name] = totals.get(sample.name, 0) + sample.value
        out["vllm_metrics"] = totals
    if spec.get("scrape_metrics"):
        import urllib.request

        url = f"http://127.0.0.1:{spec['scrape_metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            out["metrics"] = page.read().decode()
    if use_kvpool and not spec.get("multiprocess"):
        # vLLM's worker connector of this process (in-process mode), through vLLM's own API.
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown, get_kv_transfer_group, has_kv_transfer_group)

        # None when kvpool stood aside (it built no pool).
        work = get_kv_transfer_group()._work if has_kv_transfer_group() else None
        if spec.get("check_blocks"):
            out["blocks"] = [out_blocks[i] for i in range(len(prompts))]
        if work is not None and hasattr(work, "copies"):
            # The transfer path the worker took: kvpool-cuda's executor, or torch's ops.
            out["copies"] = "torch" if work.copies is None else work.copies.kind
        ensure_kv_transfer_shutdown()
        if work is None:
            out["stats"] = {}
        elif hasattr(work, "native_stats"):  # a hybrid model's parts
            out["stats"] = work.native_stats()
        else:
            out["stats"] = dict(work.native.stats())
    with open(out_path, "w") as f:
        json.dump(out, f)


class EventSubscriber:
    """Receives vLLM's KV event batches (ZMQ SUB, bound on loopback) in a thread."""

    def __init__(self, port):
        import threading

        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._payloads = []
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import zmq

        while self._running:
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self._payloads.append(payload)

    def batches_received(self):
        """How many event batches have arrived so far."""
        return len(self._payloads)

    def stop(self):
        """Waits for late batches, then returns every event as a dict."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        time.sleep(2)
        self._running = False
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = []
        for payload in self._payloads:
            for e in decoder.decode(payload).events:
                hashes = [h.hex() if isinstance(h, bytes) else str(h)
                          for h in getattr(e, "block_hashes", [])]
                parent = getattr(e, "parent_block_hash", None)
                if isinstance(parent, bytes):
                    parent = parent.hex()
                elif parent is not None:
                    parent = str(parent)
                events.append({"type": type(e).__name__, "medium": getattr(e, "medium", None),
                               "block_hashes": hashes, "parent": parent,
                               "tokens": len(getattr(e, "token_ids", []) or []),
                               "group": getattr(e, "group_idx", None),
                               "kind": getattr(e, "kv_cache_spec_kind", None)})
        return events


def compare_blocks(worker, prompts, blocks_of):
    """For every prompt: each chunk kvpool holds must equal, layer by layer, the bytes of the
    vLLM KV blocks that hold those tokens for that request (the blocks it computed or loaded
    into); returns per prompt the chunks compared and the blocks that differ."""
    import torch

    tensors = list(worker._work.kv_caches.values())
    report = []
    for i, prompt in enumerate(prompts):
        blocks = blocks_of.get(tuple(prompt)) or []
        chunks = worker._work.native.stored_chunks(prompt)
        chunk_tokens = 256
        per_chunk = chunk_tokens // worker._block_size
        mismatched = 0
        compared = 0
        for c, data in enumerate(chunks):
            per_layer = len(data) // len(tensors)
            for layer, t in enumerate(tensors):
                region = data[layer * per_layer:(layer + 1) * per_layer]
                block_bytes = per_layer // per_chunk
                for k in range(per_chunk):
                    block_id = blocks[c * per_chunk + k]
                    engine = t[block_id].contiguous().view(-1).view(dtype=torch.uint8)
                    stored = region[k * block_bytes:(k + 1) * block_bytes]
                    compared += 1
                    if engine.numpy().tobytes() != stored:
                        mismatched += 1
        report.append({"chunks": len(chunks), "blocks_compared": compared,
                       "blocks_mismatched": mismatched})
    return report


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
