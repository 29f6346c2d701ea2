"""What a vLLM key is bound to besides token ids: the served model and the weights vLLM loaded,
and each request's extra keys (LoRA adapter and its weights, cache salt, multimodal inputs).
The engine-agnostic parts (weights digests, the pool config) are in ``kvpool.identity``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvpool import _native
from kvpool.identity import (  # noqa: F401 - re-exported for the connector's modules
    _PROCESS_NONCE,
    adapter_digest,
    directory_digest,
    file_digest,
    resolve_config,
    weights_digest,
)

logger = logging.getLogger("kvpool")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


def model_identity(vllm_config: "VllmConfig", weights_id: str | None = None) -> tuple[str, str]:
    """(served name, digest of the weights loaded, or the operator's ``weights_id``): what a
    key's model scope holds."""
    mc = vllm_config.model_config
    name = mc.served_model_name or mc.model
    if isinstance(name, (list, tuple)):
        name = name[0]
    load_config = vllm_config.load_config
    load_format = str(getattr(load_config, "load_format", "auto"))
    return str(name), weights_digest(str(mc.model), getattr(mc, "revision", None), load_format,
                                     getattr(load_config, "download_dir", None), weights_id)


#: Adapter path -> the first digest of its weights this process saw.
_first_adapter_digests: dict[str, str] = {}


def _lora_identity(lora: Any) -> str:
    """``{name}@w={digest of the adapter's weights}``; the digest is computed once per adapter
    and only re-checked (by the files' identities) at later lookups. An adapter whose files
    changed while this process ran is bound to this process from then on: vLLM keeps an
    adapter loaded once per ``lora_int_id``, so this engine may still compute with the old
    weights, whose KV must not be shared under the new weights' digest."""
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
    digest = adapter_digest(str(path)) if path else None
    if digest is not None:
        first = _first_adapter_digests.setdefault(str(path), digest)
        if first != digest:
            if not first.startswith("changed:"):
                logger.warning("kvpool: the files of LoRA adapter %s (%s) changed while this "
                               "engine ran; its KV is bound to this process from now on",
                               getattr(lora, "lora_name", "?"), path)
                _first_adapter_digests[str(path)] = "changed:" + first
            digest = None
    if digest is None:
        # Weights we cannot read are bound to this process.
        digest = f"process-{_PROCESS_NONCE}"
    return f"{lora.lora_name}@w={digest}"


def extra_keys_of(request: "Request") -> bytes:
    """What the request's KV depends on besides token ids: LoRA adapter (its name and a digest
    of its weights), cache salt and multimodal inputs (vLLM's own block hashes include the
    same)."""
    lora = getattr(request, "lora_request", None)
    mm = getattr(request, "mm_features", None) or []
    return _native.encode_extra_keys(
        lora_name=_lora_identity(lora) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm_hashes=[str(f.identifier) for f in mm],
    )
