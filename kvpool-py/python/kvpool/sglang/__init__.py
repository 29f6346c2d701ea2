"""kvpool inside SGLang: ``kvpool.sglang.KvpoolStorage``, a HiCache L3 storage backend (SGLang's
``HiCacheStorage``), selected with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.sglang", "class_name": "KvpoolStorage",
        "interface_v1": 1, "config": "/etc/kvpool/kvpool.toml"}'

| file | holds |
|---|---|
| ``storage.py`` | the backend: SGLang's calls to kvpool's pages by address, keys and their scope |

Options of ours in the extra config: ``config`` (a path to a TOML file, TOML text, or a dict;
else ``KVPOOL_CONFIG``; else 2 GiB of CPU memory and no lower tier), ``model_path`` (where
the weights are, when the server's ``--model-path`` cannot be read), ``pool`` (the node's pool
daemon) and ``weights_id`` (a name for the weights instead of a digest of their files). ``interface_v1: 1`` is
SGLang's switch to the zero-copy calls (``batch_get_v1`` / ``batch_set_v1``); without it
SGLang uses the older whole-page calls, which kvpool also serves, under another key scope.
A hybrid model's other host pools (Mamba states, sliding-window KV: SGLang's ``*_v2`` calls)
are stored beside the KV pages, each pool under a scope of its own.

Importing ``kvpool.sglang`` does not import SGLang; ``KvpoolStorage`` does, and refuses an
SGLang version whose storage interface kvpool does not know.
"""

#: SGLang versions whose storage interface this backend was written and tested against
#: (pinned in kvpool-py/tests/requirements-sglang.txt).
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

__all__ = ["KvpoolStorage", "SUPPORTED_SGLANG_VERSIONS", "check_sglang_version"]


def check_sglang_version(version: str | None = None) -> str:
    """The running SGLang's version (or ``version``), or a clear error when kvpool does not
    know its HiCache storage interface."""
    if version is None:
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError("kvpool.sglang: SGLang is not installed in this environment") from e
        version = str(getattr(sglang, "__version__", "unknown"))
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(
            f"kvpool.sglang: SGLang {version} is not supported: this kvpool knows the HiCache "
            f"storage interface of SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}. Install that "
            "version, or a kvpool that supports yours."
        )
    return version


def __getattr__(name):
    if name == "KvpoolStorage":
        from kvpool.sglang.storage import KvpoolStorage

        return KvpoolStorage
    raise AttributeError(f"module 'kvpool.sglang' has no attribute {name!r}")
