"""Which KV cache layouts kvpool knows, and how each becomes the planes the transfer path
moves: per layer, one or two ``[num_blocks, plane_block_bytes]`` uint8 views of vLLM's
tensors. A layout kvpool does not know is refused with what it saw (never guessed).

Known:

- vLLM's CPU backend: per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
  contiguous; a block is opaque bytes (K precedes V within a head; with the AVX2 kernels K is
  transposed), so it is one plane, tagged with the instruction set.

The layout description (backend, instruction set, shape, strides, dtype) is part of every
key, so two layouts never share a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KvCacheLayout:
    """What the worker tells kvpool about vLLM's KV caches."""

    #: Planes in order (every layer's planes, in layer order).
    planes: list[torch.Tensor]
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    #: ``"kv"`` or ``"latent"`` (MLA).
    kind: str
    #: The block format tag bound into every key.
    kv_format: str


def refuse(what: str, tensor: torch.Tensor, block_size: int) -> ValueError:
    return ValueError(
        f"kvpool: {what}: KV cache of shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
        f"{tensor.dtype} on {tensor.device} with block size {block_size} is not a layout kvpool "
        f"knows (see kvpool.vllm.layouts)")


def detect(kv_caches: dict[str, torch.Tensor], block_size: int) -> KvCacheLayout:
    """The layout of vLLM's registered KV caches (one tensor per attention layer)."""
    if not kv_caches:
        raise ValueError("kvpool: vLLM registered no KV caches")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    for n, t in zip(names, tensors):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device \
                or t.stride() != first.stride():
            raise ValueError(f"kvpool: layer {n} has KV cache {tuple(t.shape)} {t.stride()} "
                             f"{t.dtype} {t.device}, unlike {tuple(first.shape)} "
                             f"{first.stride()} {first.dtype} {first.device}")
    if first.device.type == "cpu":
        return _cpu(tensors, block_size)
    raise NotImplementedError(
        f"kvpool: KV caches on {first.device} ({tuple(first.shape)}, strides {first.stride()}): "
        "this version moves the CPU backend's caches only; CUDA layouts are not accepted yet")


def _cpu(tensors: list[torch.Tensor], block_size: int) -> KvCacheLayout:
    import vllm

    first = tensors[0]
    if first.dim() != 4 or first.shape[2] != block_size or first.shape[3] % 2 \
            or not first.is_contiguous():
        raise refuse("vLLM's CPU backend", first, block_size)
    num_blocks, num_kv_heads, _, twice_head = first.shape
    kv_format = (f"vllm-cpu|vllm={vllm.__version__}|isa={torch.backends.cpu.get_cpu_capability()}"
                 f"|shape={tuple(first.shape[1:])}|stride={tuple(first.stride())}|{first.dtype}")
    planes = [t.view(num_blocks, -1).view(torch.uint8) for t in tensors]
    return KvCacheLayout(planes=planes, num_layers=len(tensors), num_kv_heads=int(num_kv_heads),
                         head_size=int(twice_head) // 2, dtype=first.dtype, kind="kv",
                         kv_format=kv_format)
