"""Which KV cache layouts kvpool knows, and how each becomes the planes the transfer path
moves: per layer, one ``[num_blocks, page_bytes]`` uint8 view of vLLM's tensor (a *page*: one
block of one layer, all its heads and tokens, K and V together). A layout kvpool does not know
is refused at start-up with what it saw (never guessed).

vLLM 0.32 hands ``register_kv_caches`` one 4-D view per layer, ``[blocks, heads, tokens,
content]`` in logical order, K and V packed in ``content`` (``2 * head_size``; MLA: one latent
of ``kv_lora_rank + rope`` per token); the strides carry the physical order (``LBNHC`` for
FlashAttention, Triton and MLA, ``LBHNC`` for FlashInfer on Blackwell and for the CPU backend).
Where a block's bytes are one contiguous range (every layout but ``LHBNC`` / ``BHLNC``), the
page is a strided view over them: ``block b`` starts ``b * stride(0)`` elements in, and kvpool
moves it as opaque bytes. The layout (backend, layout name, shape, strides, dtype; vLLM's
version and, on CPU, the instruction set) is part of every key, so two layouts never share a
chunk.

MLA's latent is the same on every tensor-parallel rank (vLLM's ``kv_tp_replicas``): its keys
leave the rank out, so every rank names a chunk alike and a shared tier holds it once.

This module needs torch only (vLLM is imported lazily, for names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KvCacheLayout:
    """What the worker tells kvpool about vLLM's KV caches."""

    #: One ``[num_blocks, page_bytes]`` uint8 view per layer, in layer order.
    planes: list[torch.Tensor]
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    #: ``"kv"`` or ``"latent"`` (MLA).
    kind: str
    #: The block format tag bound into every key.
    kv_format: str
    #: The KV is identical on every tensor-parallel rank (MLA): keys leave the rank out.
    replicated: bool = False


def describe(t: torch.Tensor) -> str:
    return (f"shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype} on {t.device}")


def _compact_block(t: torch.Tensor) -> bool:
    """Whether each block (dim 0) of ``t`` is one contiguous range of the inner elements."""
    dims = sorted((t.stride(d), t.shape[d]) for d in range(1, t.dim()) if t.shape[d] > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return t.stride(-1) == 1 or t.shape[-1] == 1


def page_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The ``[num_blocks, page_bytes]`` uint8 view of one layer's blocks."""
    page = 1
    for d in range(1, t.dim()):
        page *= t.shape[d]
    es = t.element_size()
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    # `view(uint8)` scales the last dimension and every stride by the element size.
    return raw.as_strided((num_blocks, page * es), (raw.stride(0), 1))


def detect(kv_caches: dict[str, torch.Tensor], block_size: int, *, num_blocks: int | None = None,
           use_mla: bool = False, replicated: bool = False, backend: str = "unknown",
           layout_name: str = "unknown") -> KvCacheLayout:
    """The layout of vLLM's registered KV caches (one tensor per attention layer).

    ``num_blocks`` is the engine's block count (when the backend's kernel blocks are smaller,
    vLLM hands ``num_blocks * ratio`` of them: they are regrouped); ``use_mla`` and
    ``replicated`` come from vLLM's config; ``backend`` and ``layout_name`` name what vLLM
    chose (in errors and in the key).
    """
    if not kv_caches:
        raise ValueError("kvpool: vLLM registered no KV caches")
    seen: dict[tuple, str] = {}
    tensors = []
    for name, t in kv_caches.items():
        ident = (t.data_ptr(), tuple(t.stride()))
        if ident in seen:
            # A layer sharing another's cache (KV sharing): moved once.
            continue
        seen[ident] = name
        tensors.append((name, t))
    _, first = tensors[0]
    for name, t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device \
                or t.stride() != first.stride():
            raise ValueError(f"kvpool: layer {name} has a KV cache with {describe(t)}, unlike the "
                             f"first layer's {describe(first)}")
    if first.dim() == 4 and num_blocks is not None and first.shape[0] != num_blocks \
            and first.shape[0] % num_blocks == 0:
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        tensors = [(n, group_kernel_blocks(t, num_blocks)) for n, t in tensors]
        first = tensors[0][1]
    where = f"{backend} ({layout_name}) with block size {block_size}"
    if first.dim() not in (4, 5):
        raise ValueError(f"kvpool: a KV cache with {describe(first)} from {where} is not a "
                         "layout kvpool knows")
    # [blocks, (ratio,) heads, tokens, content]
    heads, tokens, content = first.shape[-3], first.shape[-2], first.shape[-1]
    if first.dim() == 5:
        tokens *= first.shape[1]
    if tokens != block_size or not _compact_block(first):
        raise ValueError(f"kvpool: a KV cache with {describe(first)} from {where} does not hold "
                         "each block as one contiguous range of bytes; kvpool knows the "
                         "block-compact layouts (LBNHC, LBHNC, BLNHC, BLHNC)")
    nb = first.shape[0]
    kind = "latent" if use_mla else "kv"
    if not use_mla and content % 2:
        raise ValueError(f"kvpool: a K|V content of {content} elements from {where} is odd")
    head_size = content if use_mla else content // 2
    try:
        import vllm

        version = vllm.__version__
    except ImportError:  # kvpool's GPU check runs without vLLM
        version = "none"
    parts = [f"vllm={version}", f"backend={backend}", f"layout={layout_name}",
             f"shape={tuple(first.shape[1:])}", f"stride={tuple(first.stride())}", str(first.dtype)]
    if first.device.type == "cpu":
        parts.insert(1, f"isa={torch.backends.cpu.get_cpu_capability()}")
    planes = [page_view(t, nb) for _, t in tensors]
    return KvCacheLayout(planes=planes, num_layers=len(planes), num_kv_heads=int(heads),
                         head_size=int(head_size), dtype=first.dtype, kind=kind,
                         kv_format="|".join(parts), replicated=replicated and use_mla)


def detect_for(vllm_config: Any, kv_caches: dict[str, torch.Tensor], block_size: int,
               kv_cache_config: Any = None) -> KvCacheLayout:
    """``detect`` with what vLLM's config says about the engine (backend, layout, MLA)."""
    backend = "unknown"
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

        backend = get_current_attn_backend(vllm_config).get_name()
    except Exception:  # noqa: BLE001 - a name for messages and keys only
        pass
    layout_name = "unknown"
    try:
        layout_name = str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    except Exception:  # noqa: BLE001
        pass
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    tp = vllm_config.parallel_config.tensor_parallel_size
    replicas = getattr(kv_cache_config, "kv_tp_replicas", 1) if kv_cache_config else 1
    return detect(kv_caches, block_size,
                  num_blocks=getattr(kv_cache_config, "num_blocks", None),
                  use_mla=use_mla, replicated=use_mla and replicas == tp,
                  backend=backend, layout_name=layout_name)


def hybrid_groups(kv_cache_config: Any) -> str | None:
    """``None`` for a model whose layers form one KV cache group (what kvpool serves); for a
    hybrid model under vLLM's hybrid KV cache manager (several groups: sliding-window and
    full-attention layers, or Mamba / linear-attention state next to attention), a description
    of its groups, e.g. ``"4 groups: FullAttentionSpec x1, SlidingWindowSpec(window 64) x3"``.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        return None
    kinds: dict[str, int] = {}
    for group in groups:
        spec = group.kv_cache_spec
        name = type(spec).__name__
        window = getattr(spec, "sliding_window", None)
        if window:
            name += f"(window {window})"
        kinds[name] = kinds.get(name, 0) + 1
    return f"{len(groups)} groups: " + ", ".join(f"{k} x{n}" for k, n in kinds.items())

