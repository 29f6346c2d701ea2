"""kvpool: a KV-cache pool for LLM inference engines, in Rust.

Use with vLLM (see the README's "Use with vLLM")::

    --kv-transfer-config '{"kv_connector": "KvpoolConnector",
                           "kv_connector_module_path": "kvpool.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"config": "kvpool.toml"}}'

Use with SGLang (see the README's "Use with SGLang"): ``kvpool.sglang.KvpoolStorage``, a HiCache
L3 storage backend (``--hicache-storage-backend dynamic``).

``kvpool._native`` is the Rust extension: ``Scheduler`` and ``Worker`` (the two halves of
the connector), ``encode_extra_keys``, ``lookup_socket_path`` and ``check_config``.
"""

from kvpool._native import (  # noqa: F401
    Scheduler,
    Worker,
    __version__,
    check_config,
    encode_extra_keys,
    lookup_socket_path,
)
