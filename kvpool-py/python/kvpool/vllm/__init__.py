"""kvpool inside vLLM: ``kvpool.vllm.KvpoolConnector``, a KV connector (vLLM's
``KVConnectorBase_V1``), selected with ``"kv_connector": "KvpoolConnector",
"kv_connector_module_path": "kvpool.vllm"``.

| file | holds |
|---|---|
| ``connector.py`` | the connector class: each vLLM call, to the scheduler or worker side |
| ``scheduler_side.py`` | EngineCore's half: lookups over the workers' sockets, metadata, commits, KV events |
| ``worker_side.py`` | each Worker's half: the pool, the lookup server, running the copy jobs |
| ``transfer.py`` | the one transfer path: torch block copies, the same code for CPU and CUDA tensors |
| ``layouts.py`` | which KV cache layouts kvpool knows and how each becomes planes |
| ``identity.py`` | what keys are bound to: the weights loaded, LoRA adapters, extra keys; the config |
| ``reports.py`` | worker metadata, connector stats, Prometheus series, KV events |

Options (``kv_connector_extra_config``): ``config`` (a path to a TOML file, TOML text, or a
dict; else ``KVPOOL_CONFIG``; else 2 GiB of CPU memory and no lower tier),
``save_decode_tokens`` (default false), ``socket_dir`` (default: the temp dir),
``lookup_timeout_ms`` (default 5000: one lookup, all ranks together).

Loads from memory leased at lookup run before the forward pass; any other load (disk, Redis,
S3, Mooncake, or every load when vLLM schedules asynchronously) runs in the background while
other requests run (the request waits in ``WAITING_FOR_REMOTE_KVS``). Saves are copied out of
the blocks in the step that computed them and become visible once every rank ran the step
with no failed load touching them. A chunk that cannot be loaded is reported through
``get_block_ids_with_load_errors`` and recomputed (kvpool sets ``kv_load_failure_policy`` to
``"recompute"``).
"""

from kvpool.vllm.connector import WORKERS, KvpoolConnector, KvpoolConnectorMetadata  # noqa: F401
from kvpool.vllm.identity import extra_keys_of, resolve_config  # noqa: F401
from kvpool.vllm.reports import (  # noqa: F401
    PROM_COUNTERS,
    KvpoolConnectorStats,
    KvpoolKVEvents,
    KvpoolPromMetrics,
    KvpoolWorkerMeta,
)
