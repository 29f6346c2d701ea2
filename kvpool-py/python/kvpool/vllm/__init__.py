"""kvpool inside vLLM: ``kvpool.vllm.KvpoolConnector``, a KV connector (vLLM's
``KVConnectorBase_V1``), selected with ``"kv_connector": "KvpoolConnector",
"kv_connector_module_path": "kvpool.vllm"``.

| file | holds |
|---|---|
| ``connector.py`` | the connector class: each vLLM call, to the scheduler or worker side |
| ``scheduler_side.py`` | EngineCore's half: lookups over the workers' sockets, metadata, commits, KV events |
| ``worker_side.py`` | each Worker's half: the pool, the lookup server, running the copy jobs |
| ``layouts.py`` | which KV cache layouts kvpool knows and how each becomes planes |
| ``identity.py`` | what vLLM keys are bound to: the served model and its weights, LoRA adapters, extra keys (weights digests and the config itself: ``kvpool.identity``) |
| ``reports.py`` | worker metadata, connector stats, Prometheus series, KV events |
| ``tier.py`` | ``KvpoolTier``: kvpool as a secondary tier under vLLM's native offloading |
| ``compat.py`` | the vLLM versions tested, and the start-up check: an untested version warned about, a different connector API refused |

The transfer paths themselves (kvpool-cuda's native executors; torch block copies) are
engine-agnostic: ``kvpool.transfer``. The connector's classes are imported on first use, so
``kvpool.vllm.layouts`` and ``kvpool.vllm.identity`` load without vLLM.

Options (``kv_connector_extra_config``): ``config`` (a path to a TOML file, TOML text, or a
dict; else ``KVPOOL_CONFIG``; else 2 GiB of CPU memory and no lower tier), ``pool`` (the
node's pool daemon, ``unix:///run/kvpool/kvpool.sock``: ``kvpool serve``; added as the first
lower tier),
``save_decode_tokens`` (default false), ``socket_dir`` (default: the temp dir),
``lookup_timeout_ms`` (default 5000: one lookup, all ranks together),
``stage_node_memory_copies`` (default false: a CPU worker loads and saves the pool daemon's
chunks the way a GPU worker does, through a staged copy of the worker's that is checked or
hashed; for tests of that route), ``transfer`` (``auto``, the default: ``native``, measured
faster on CPU and on an H200 (docs/benchmarks.md); ``native``: kvpool-cuda's executors,
memcpy on CPU; on a GPU one ``cuMemcpyBatchAsync`` per job phase, or kvpool's copy kernel for
small scattered pages, on kvpool's own stream; ``torch``: torch's copy ops, the fallback).

Loads from memory leased at lookup run before the forward pass, and so does one load from
disk, Redis, S3 or Mooncake per step when no other request is running; any other load (or
every load when vLLM schedules asynchronously) runs in the background while other requests
run (the request waits in ``WAITING_FOR_REMOTE_KVS``). Saves are copied out of
the blocks in the step that computed them and become visible once every rank ran the step
with no failed load touching them. A chunk that cannot be loaded is reported through
``get_block_ids_with_load_errors`` and recomputed (kvpool sets ``kv_load_failure_policy`` to
``"recompute"``).

The connector declares vLLM's ``SupportsHMA`` (vLLM keeps its hybrid KV cache manager on)
and serves a hybrid model's KV cache groups, one part each (``kvpool.vllm.hybrid``): full and
sliding-window attention, and recurrent states (``kvpool.vllm.state_groups``). It stands
aside, with one warning and no lookup, load or save, where it cannot serve exactly: state
groups outside vLLM's ``align`` mode, under speculative decoding, off the CPU build, or with a
chunk size that is not a multiple of the block size; and MLA on vLLM's CPU build (which does
not resume MLA from a cached prefix).
"""

_EXPORTS = {
    "KvpoolConnector": "kvpool.vllm.connector",
    "KvpoolConnectorMetadata": "kvpool.vllm.connector",
    "extra_keys_of": "kvpool.vllm.identity",
    "resolve_config": "kvpool.vllm.identity",
    "PROM_COUNTERS": "kvpool.vllm.reports",
    "KvpoolConnectorStats": "kvpool.vllm.reports",
    "KvpoolKVEvents": "kvpool.vllm.reports",
    "KvpoolPromMetrics": "kvpool.vllm.reports",
    "KvpoolWorkerMeta": "kvpool.vllm.reports",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.vllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
