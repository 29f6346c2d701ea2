"""The connector's options (vLLM's ``kv_connector_extra_config``), each checked at start-up: an
unknown key (a typo such as ``"asyn_loads"``) or a value of the wrong kind is refused naming
what kvpool takes, as the TOML side refuses unknown keys. No vLLM import: usable from tools.
"""

from __future__ import annotations

import difflib
import tempfile
from dataclasses import dataclass
from typing import Any

from kvpool.identity import WEIGHTS_ID_OPTION, named_weights
from kvpool.transfer import TRANSFERS

#: Every option, with what it takes and its default (docs/configuration.md lists the same).
OPTIONS: dict[str, str] = {
    "config": "the pool config: a path to a TOML file, TOML text or a dict "
              "(default: KVPOOL_CONFIG, else 2 GiB of CPU memory and no lower tier)",
    "pool": "the node's pool daemon, unix:///run/kvpool/kvpool.sock (default: none)",
    "save_decode_tokens": "true or false: also store tokens generated while decoding "
                          "(default false)",
    "socket_dir": "where the lookup sockets go (default: the temp dir)",
    "lookup_timeout_ms": "a positive integer: one lookup, all ranks together (default 5000)",
    "async_loads": "true (default: lower tiers load in the background while other requests "
                   "run), \"always\" (every load does) or false (every load before the "
                   "forward pass)",
    "stage_node_memory_copies": "true or false: a CPU worker loads and saves the pool "
                                "daemon's chunks the way a GPU worker does (tests; default "
                                "false)",
    "transfer": "\"auto\" (default: native), \"native\" (kvpool-cuda's copies) or \"torch\" "
                "(torch's copy ops)",
    "consumer_saves": "true or false: with kv_role \"kv_consumer\", also store what this "
                      "instance computes itself (default false: a consumer only loads)",
    "handoff_timeout_ms": "a positive integer: how long a request a producer handed off waits "
                          "for the producer's saves to be found (default 2000)",
    "weights_id": "a string naming the weights, used in keys instead of a digest of the "
                  "weight files (for weights kvpool cannot hash: streamed, custom loaders); "
                  "change it whenever the weights change (default: hash the files)",
}

@dataclass(frozen=True)
class ConnectorOptions:
    """The checked options (``config`` and ``pool`` are read by ``resolve_config``)."""

    save_decode_tokens: bool = False
    socket_dir: str = ""
    lookup_timeout_ms: int = 5000
    #: ``True``, ``False`` or ``"always"``.
    async_loads: Any = True
    stage_node_memory_copies: bool = False
    transfer: str = "auto"
    consumer_saves: bool = False
    handoff_timeout_ms: int = 2000
    #: The operator's name for the weights (``None``: hash the weight files).
    weights_id: str | None = None


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"kvpool: option {name!r} must be true or false, not {value!r}")


def _milliseconds(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) \
            or not str(value).isdigit() or int(value) <= 0:
        raise ValueError(f"kvpool: option {name!r} must be a positive integer (milliseconds), "
                         f"not {value!r}")
    return int(value)


def check_options(extra: dict[str, Any]) -> ConnectorOptions:
    """Checks every key and value of ``extra``; returns the typed options. Raises
    ``ValueError`` naming an unknown option (and the closest known one) or a bad value."""
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        known = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
        raise ValueError(f"kvpool: unknown option(s) {', '.join(hints)} in "
                         f"kv_connector_extra_config. kvpool's options: {known}")
    timeout = _milliseconds("lookup_timeout_ms", extra.get("lookup_timeout_ms", 5000))
    handoff_timeout = _milliseconds("handoff_timeout_ms", extra.get("handoff_timeout_ms", 2000))
    async_loads = extra.get("async_loads", True)
    if async_loads not in (True, False, "true", "false", "always", "auto"):
        raise ValueError(f"kvpool: option 'async_loads' must be true, false or \"always\", "
                         f"not {async_loads!r}")
    transfer = extra.get("transfer", "auto")
    if transfer not in TRANSFERS:
        raise ValueError(f"kvpool: option 'transfer' must be one of {', '.join(TRANSFERS)}, "
                         f"not {transfer!r}")
    socket_dir = extra.get("socket_dir") or tempfile.gettempdir()
    if not isinstance(socket_dir, str):
        raise ValueError(f"kvpool: option 'socket_dir' must be a path, not {socket_dir!r}")
    return ConnectorOptions(
        save_decode_tokens=_bool("save_decode_tokens", extra.get("save_decode_tokens", False)),
        socket_dir=socket_dir,
        lookup_timeout_ms=timeout,
        async_loads=async_loads,
        stage_node_memory_copies=_bool("stage_node_memory_copies",
                                       extra.get("stage_node_memory_copies", False)),
        transfer=transfer,
        consumer_saves=_bool("consumer_saves", extra.get("consumer_saves", False)),
        handoff_timeout_ms=handoff_timeout,
        weights_id=_weights_id(extra.get(WEIGHTS_ID_OPTION)),
    )


def _weights_id(value: Any) -> str | None:
    if value is None:
        return None
    named_weights(value)  # refuses an empty or non-string name
    return value.strip()


#: vLLM's ``kv_role`` values and what kvpool does in each.
ROLES = {
    "kv_both": "loads and saves",
    "kv_producer": "saves what it computes, never looks a prompt up (a prefill instance)",
    "kv_consumer": "loads, saves nothing (a decode instance; consumer_saves: true saves "
                   "what it computes)",
}


def role_actions(kv_role: str | None, options: ConnectorOptions) -> tuple[bool, bool]:
    """(loads, saves) for vLLM's ``kv_role`` (``None``: ``kv_both``). Refuses a role kvpool
    does not know and ``consumer_saves`` outside the consumer role."""
    role = kv_role or "kv_both"
    if role not in ROLES:
        raise ValueError(f"kvpool: kv_role {role!r} is not one of {', '.join(ROLES)}")
    if options.consumer_saves and role != "kv_consumer":
        raise ValueError(f"kvpool: option 'consumer_saves' is for kv_role \"kv_consumer\"; "
                         f"this instance's role is {role!r}")
    return role != "kv_producer", role != "kv_consumer" or options.consumer_saves
