"""The host pool: one flat uint8 buffer holding `num_cpu_blocks` blocks of every registered tensor.

Layout: one region per registered tensor, in registration order; region t is `num_cpu_blocks` rows of that
tensor's `block_bytes`, so CPU block id == row index (row 0 is the reserved null block, allocated but never
copied) and a run of consecutive CPU blocks is one contiguous byte range per tensor. A block's bytes are the
concatenation of its rows across regions, which is what `pool[cpu_block_id]` returns.

Invariants: the buffer is exactly `num_cpu_blocks * bytes_per_block` bytes and is never resized; sizes are
checked (>= 2 blocks, fits in MemAvailable) before anything is allocated. Only the backend's copies write it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from worker_side.block_layout import TensorBlockView
from worker_side.errors import HostPoolError

MEMINFO = "/proc/meminfo"


def mem_available_bytes(path: str = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where the kernel does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_pool_size(num_cpu_blocks: int, bytes_per_block: int, available: int | None) -> int:
    """Validate a pool size before allocating; return its bytes or raise HostPoolError."""
    if num_cpu_blocks < 2:
        raise HostPoolError(f"host pool of num_cpu_blocks={num_cpu_blocks} is too small; allowed: >= 2 "
                            "(block 0 is the reserved null block); raise cpu_bytes or num_cpu_blocks")
    if bytes_per_block <= 0:
        raise HostPoolError(f"bytes_per_block={bytes_per_block}; register non-empty KV caches first")
    nbytes = num_cpu_blocks * bytes_per_block
    if available is not None and nbytes > available:
        raise HostPoolError(
            f"host pool of {num_cpu_blocks} blocks x {bytes_per_block} bytes = {nbytes} bytes does not fit in "
            f"available memory ({available} bytes, MemAvailable); allowed: cpu_bytes / num_cpu_blocks "
            f"giving <= {available // bytes_per_block} blocks")
    return nbytes


class HostPool:
    """Per-tensor regions over one exact-size host buffer; index it with a CPU block id."""

    def __init__(self, views: Sequence[TensorBlockView], num_cpu_blocks: int,
                 allocate: Callable[[int], torch.Tensor], available: int | None = None) -> None:
        self.bytes_per_block = sum(v.block_bytes for v in views)
        self.num_blocks = num_cpu_blocks
        nbytes = check_pool_size(num_cpu_blocks, self.bytes_per_block,
                                 mem_available_bytes() if available is None else available)
        buffer = allocate(nbytes)
        if buffer.dtype != torch.uint8 or buffer.numel() != nbytes or buffer.device.type != "cpu":
            raise HostPoolError(f"backend allocated {buffer.numel()} {buffer.dtype} on {buffer.device}; "
                                f"expected exactly {nbytes} uint8 bytes on cpu (our bug)")
        self.buffer = buffer
        self.views: list[TensorBlockView] = []
        offset = 0
        for v in views:
            region = buffer[offset:offset + num_cpu_blocks * v.block_bytes]
            self.views.append(TensorBlockView(
                name=v.name, tensor=region, num_blocks=num_cpu_blocks, base_ptr=region.data_ptr(),
                block_stride=v.block_bytes, chunk_offsets=np.arange(v.num_chunks, dtype=np.int64) * v.chunk_bytes,
                chunk_bytes=v.chunk_bytes))
            offset += num_cpu_blocks * v.block_bytes

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_blocks, self.bytes_per_block)

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, cpu_block_id: int) -> torch.Tensor:
        """A copy of CPU block `cpu_block_id`'s bytes across all regions (uint8, bytes_per_block long)."""
        if not 0 <= cpu_block_id < self.num_blocks:
            raise IndexError(f"cpu_block_id {cpu_block_id} out of range [0, {self.num_blocks})")
        return torch.cat([v.tensor[cpu_block_id * v.block_bytes:(cpu_block_id + 1) * v.block_bytes]
                          for v in self.views])
