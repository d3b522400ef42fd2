"""Where each block of a registered KV tensor lives, in bytes.

`TensorBlockView` describes one tensor as `num_blocks` blocks, each made of `num_chunks` contiguous byte
chunks of `chunk_bytes` each, at `base_ptr + block * block_stride + chunk_offsets[k]`. A block's bytes are
copied exactly (padding between blocks is never read or written); their physical order is kept, so a
round trip through the host pool is bit exact for any dtype (fp32, fp16, bf16, fp8 are all just bytes).

Supported layouts (found from shape and strides, never guessed):
- block dim first: `(num_blocks, ...)`, including vLLM's per-layer views (logical `[B, H, N, C]` with any
  of vLLM's `KVCacheLayout` stride orders; the CPU backend's LBHNC view is `(B, H, N, 2*head)` dense);
- K/V first: `(2, num_blocks, ...)` (each block is two chunks: its K part and its V part);
- a cross-layer tensor with the block dim first;
- kernel-block splitting: a block dim of `k * num_gpu_blocks` rows, grouped `k` rows per block.
The bytes inside a block must be dense in some dim order; anything else raises `LayoutError`.
Heads: given the head dim (vLLM's views: logical dim 1 of [B, H, N, C]; others say which), a view whose
heads lie inside each chunk records `num_heads` and `head_bytes` (the byte stride of the head dim): each
chunk is then (outer, num_heads, head_bytes) bytes, the split the lower tiers' per-head records use
(worker_side/tiers/head_rows.py). Heads outside the chunks (vLLM's LHBNC) or an unknown head dim leave
`num_heads` = 0.
This module only reads tensor metadata; it never copies or allocates tensor memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from worker_side.errors import LayoutError

BLOCK_FIRST = "block_first"
KV_FIRST = "kv_first"
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
ALLOWED_LAYOUTS = ("auto", BLOCK_FIRST, KV_FIRST, *VLLM_LAYOUTS)


@dataclass(frozen=True, slots=True)
class TensorBlockView:
    """Byte geometry of one tensor's blocks. Holds the tensor so its memory outlives every copy."""

    name: str
    tensor: torch.Tensor
    num_blocks: int
    base_ptr: int
    block_stride: int  # bytes between block b and b + 1
    chunk_offsets: np.ndarray  # int64 byte offsets of each chunk inside a block, ascending
    chunk_bytes: int
    num_heads: int = 0  # KV heads inside each chunk (0: unknown, or not inside the chunks)
    head_bytes: int = 0  # bytes between consecutive heads inside a chunk (the head dim's stride)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_offsets)

    @property
    def block_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def runs_are_contiguous(self) -> bool:
        """True when blocks b..b+n-1 form one contiguous byte range (one copy per run)."""
        return self.num_chunks == 1 and int(self.chunk_offsets[0]) == 0 and self.block_stride == self.chunk_bytes

    def block_tensor(self, block: int) -> torch.Tensor:
        """A copy of block `block`'s bytes (uint8, chunks in order); for tests and debugging."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks}) for tensor {self.name!r}")
        flat = _byte_view(self.tensor)
        start = self.base_ptr - flat.data_ptr() + block * self.block_stride
        return torch.cat([flat[start + int(o):start + int(o) + self.chunk_bytes] for o in self.chunk_offsets])


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The whole untyped storage of `t` as a flat uint8 tensor."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _normalize_hint(layout: object) -> str:
    """A layout hint as a string; vLLM's `KVCacheLayout` enum members are accepted by name."""
    hint = "auto" if layout is None else layout
    if not isinstance(hint, str) and isinstance(getattr(hint, "name", None), str):
        hint = hint.name
    if hint not in ALLOWED_LAYOUTS:
        raise LayoutError(f"unknown KV cache layout hint {layout!r}; allowed: {', '.join(ALLOWED_LAYOUTS)}")
    return hint


def _find_block_dim(name: str, shape: tuple[int, ...], num_gpu_blocks: int | None, hint: str) -> int:
    """Index of the block dim of `shape`, or raise LayoutError naming the shape and what is allowed."""
    if hint in VLLM_LAYOUTS:
        if len(shape) != 4:
            raise LayoutError(f"tensor {name!r}: layout {hint} means a 4D per-layer view [B, H, N, C]; "
                              f"got shape {shape}")
        return 0
    if hint == BLOCK_FIRST:
        return 0
    if hint == KV_FIRST:
        if len(shape) < 3 or shape[0] != 2:
            raise LayoutError(f"tensor {name!r}: layout kv_first needs shape (2, num_blocks, ...); got {shape}")
        return 1
    kv_possible = len(shape) >= 3 and shape[0] == 2
    if num_gpu_blocks is None:
        if kv_possible:
            raise LayoutError(
                f"tensor {name!r} of shape {shape} is ambiguous: (2, num_blocks, ...) or (num_blocks=2, ...); "
                f"pass num_gpu_blocks or layout= one of {', '.join(ALLOWED_LAYOUTS)}")
        return 0
    exact = [d for d, ok in ((0, shape[0] == num_gpu_blocks), (1, kv_possible and shape[1] == num_gpu_blocks)) if ok]
    if len(exact) == 1:
        return exact[0]
    if not exact:
        grouped = [d for d, ok in ((0, shape[0] % num_gpu_blocks == 0),
                                   (1, kv_possible and shape[1] % num_gpu_blocks == 0)) if ok]
        if len(grouped) == 1:
            return grouped[0]
        if not grouped:
            raise LayoutError(
                f"tensor {name!r} of shape {shape}: no block dim of size num_gpu_blocks={num_gpu_blocks} "
                f"(or a multiple) at dim 0 (block_first) or dim 1 after a K/V dim of 2 (kv_first)")
    raise LayoutError(f"tensor {name!r} of shape {shape} with num_gpu_blocks={num_gpu_blocks} is ambiguous "
                      f"(block_first or kv_first); pass layout= one of {', '.join(ALLOWED_LAYOUTS)}")


def tensor_block_view(name: str, tensor: torch.Tensor, num_gpu_blocks: int | None = None,
                      layout: object = None, head_dim: int | None = None) -> TensorBlockView:
    """Work out the block geometry of `tensor`; raise LayoutError rather than guess. `head_dim`: the dim
    holding the KV heads (default: 1 for vLLM's [B, H, N, C] views, unknown otherwise)."""
    hint = _normalize_hint(layout)
    if head_dim is None and hint in VLLM_LAYOUTS:
        head_dim = 1
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"KV cache {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() == 0 or tensor.dim() < 2:
        raise LayoutError(f"tensor {name!r}: need a non-empty tensor with a block dim and block contents; "
                          f"got shape {tuple(tensor.shape)}")
    shape, strides = list(tensor.shape), list(tensor.stride())
    dim = _find_block_dim(name, tuple(shape), num_gpu_blocks, hint)
    num_blocks = shape[dim] if num_gpu_blocks is None else num_gpu_blocks
    if shape[dim] % num_blocks:
        raise LayoutError(f"tensor {name!r}: block dim {dim} has {shape[dim]} rows, not a multiple of "
                          f"num_gpu_blocks={num_blocks}")
    group = shape[dim] // num_blocks
    if group > 1:  # kernel blocks: k consecutive rows form one block
        shape[dim:dim + 1] = [num_blocks, group]
        strides[dim:dim + 1] = [strides[dim] * group, strides[dim]]
    block_stride = strides[dim]
    others = [(s, n) for i, (n, s) in enumerate(zip(shape, strides, strict=True)) if i != dim and n > 1]
    inner = sorted((s, n) for s, n in others if s < block_stride)
    outer = sorted((s, n) for s, n in others if s >= block_stride)
    expected = 1
    for s, n in inner:
        if s != expected:
            raise LayoutError(f"tensor {name!r} shape {tuple(tensor.shape)} strides {tuple(tensor.stride())}: "
                              f"the bytes inside a block are not dense (stride {s}, expected {expected}); "
                              "supported: dense blocks in any dim order")
        expected *= n
    extent = (num_blocks - 1) * block_stride + expected
    if block_stride < expected and num_blocks > 1:
        raise LayoutError(f"tensor {name!r}: blocks overlap (block stride {block_stride} < {expected} elements)")
    for s, n in outer:
        if s < extent:
            raise LayoutError(f"tensor {name!r} shape {tuple(tensor.shape)} strides {tuple(tensor.stride())}: "
                              "overlapping or interleaved dims; supported: block_first, kv_first, vLLM views")
        extent += (n - 1) * s
    elem = tensor.element_size()
    offsets = [sum(i * s for i, (s, _) in zip(idx, outer, strict=True)) * elem
               for idx in itertools.product(*(range(n) for _, n in outer))]
    num_heads, head_bytes = _heads_in_chunk(tensor, head_dim, dim, block_stride, expected)
    return TensorBlockView(name=name, tensor=tensor, num_blocks=num_blocks, base_ptr=tensor.data_ptr(),
                           block_stride=block_stride * elem, chunk_offsets=np.array(sorted(offsets), np.int64),
                           chunk_bytes=expected * elem, num_heads=num_heads, head_bytes=head_bytes * elem)


def _heads_in_chunk(tensor: torch.Tensor, head_dim: int | None, block_dim: int, block_stride: int,
                    chunk_elems: int) -> tuple[int, int]:
    """(num_heads, head stride in elements) when the head dim lies inside each chunk, else (0, 0). Inside
    a dense chunk, the dims of smaller stride than the head dim's make exactly its stride, so a chunk is
    (outer, num_heads, stride) elements."""
    if head_dim is None or not -tensor.dim() <= head_dim < tensor.dim():
        return 0, 0
    head_dim %= tensor.dim()
    heads, stride = int(tensor.shape[head_dim]), int(tensor.stride(head_dim))
    if head_dim == block_dim:
        return 0, 0
    if heads == 1:
        return 1, chunk_elems
    if stride >= block_stride or chunk_elems % (heads * stride):
        return 0, 0
    return heads, stride
