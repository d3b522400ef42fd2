"""`HeadRows`: a host pool's blocks as one byte string per KV head, the TP-independent record layout of the
lower tiers (offload_connector/tier_identity.py, remote/format.py).

A rank holds heads [a, b) of the model's H KV heads (`rank_heads`). Its block bytes in host-pool order are
every plane's chunks (planes in registration order, chunks in offset order), and each chunk is
(outer, num_heads, head_bytes) bytes (block_layout: e.g. [N, H, C] for vLLM's LBNHC, [H, N, C] for LBHNC,
the fake engine's K or V half [N, H, C]). Head h's part is, in that order, every chunk's [:, h, :] bytes:
    part(h) = concat over planes, chunks of chunk[:, h, :]
The order inside a part does not depend on how many heads the rank holds, so head g's part is the same
bytes on a TP 1 instance (h = g) and on rank r of a TP t instance (h = g - a): a block written at one TP
is read at another, part by part. Parts are `bytes_per_block / num_heads` bytes each.

One head per rank (MLA's latent, every rank holding it whole; or as many ranks as heads) is one part, the
block's bytes in host-pool order, the `HostRows` layout. `read_parts` copies a block out (the caller owns
the result); `write_parts` fills a block from its parts, `write_part` one head of it. Allocates nothing
but `read_parts`' result and `write_parts`' gathered parts. Raises `LayoutError` at construction when a registered tensor does not
hold `num_heads` heads inside its chunks (its head dim unknown, or the heads outside the chunks).
"""

from __future__ import annotations

import numpy as np

from worker_side.errors import LayoutError
from worker_side.host_pool import HostPool


class HeadRows:
    """Read and write a host pool's blocks as `num_heads` parts of `part_bytes` each (module docstring)."""

    def __init__(self, pool: HostPool, num_heads: int) -> None:
        if num_heads < 1 or pool.bytes_per_block % num_heads:
            raise LayoutError(f"{pool.bytes_per_block}-byte blocks do not split into {num_heads} KV heads (our bug)")
        self.num_heads = num_heads
        self.bytes_per_block = pool.bytes_per_block
        self.part_bytes = pool.bytes_per_block // num_heads
        # per chunk of every plane: (plane bytes, block stride, chunk offset, chunk bytes, outer, head bytes)
        self._chunks: list[tuple[np.ndarray, int, int, int, int, int]] = []
        for v in pool.views:
            if num_heads == 1:
                heads, head_bytes = 1, v.chunk_bytes
            else:
                heads, head_bytes = v.num_heads, v.head_bytes
            if heads != num_heads or head_bytes <= 0 or v.chunk_bytes % (heads * head_bytes):
                raise LayoutError(
                    f"KV tensor {v.name!r}: per-head records need its {num_heads} KV heads inside each block's "
                    f"bytes; found {v.num_heads or 'no known'} heads there (head dim unknown or heads outside "
                    "the blocks), though the adapter's tier identity says they split by head (our bug: such "
                    "a layout must be stored per rank, kv_heads=0); remove the lower tier's section meanwhile")
            region = v.tensor.numpy()
            for o in v.chunk_offsets:
                self._chunks.append((region, int(v.block_stride), int(o), v.chunk_bytes,
                                     v.chunk_bytes // (heads * head_bytes), head_bytes))

    def read_parts(self, cpu_block_id: int) -> np.ndarray:
        """A copy of the block's parts: (num_heads, part_bytes) uint8, row h = head h's part."""
        n = self.num_heads
        out = np.empty((n, self.part_bytes), np.uint8)
        pos = 0
        for region, stride, offset, size, outer, head_bytes in self._chunks:
            start = cpu_block_id * stride + offset
            seg = outer * head_bytes
            dst = out[:, pos:pos + seg]
            dst.shape = (n, outer, head_bytes)  # a view, never a copy (raises otherwise)
            np.copyto(dst, region[start:start + size].reshape(outer, n, head_bytes).transpose(1, 0, 2))
            pos += seg
        return out

    def write_parts(self, cpu_block_id: int, payloads: list[memoryview]) -> None:
        """Fill every head of the block from `num_heads` buffers of `part_bytes` each, in head order: the
        parts are gathered once, then each chunk is one strided copy (not one per head and chunk)."""
        n = self.num_heads
        if len(payloads) != n or any(len(p) != self.part_bytes for p in payloads):
            raise LayoutError(f"{len(payloads)} parts of {[len(p) for p in payloads]} bytes instead of {n} of "
                              f"{self.part_bytes} (our bug)")
        if n == 1:
            src = np.frombuffer(payloads[0], np.uint8).reshape(1, -1)
        else:
            src = np.empty((n, self.part_bytes), np.uint8)
            for h, payload in enumerate(payloads):
                src[h] = np.frombuffer(payload, np.uint8)
        pos = 0
        for region, stride, offset, size, outer, head_bytes in self._chunks:
            start = cpu_block_id * stride + offset
            seg = outer * head_bytes
            part = src[:, pos:pos + seg]
            part.shape = (n, outer, head_bytes)  # a view, never a copy (raises otherwise)
            np.copyto(region[start:start + size].reshape(outer, n, head_bytes), part.transpose(1, 0, 2))
            pos += seg

    def write_part(self, cpu_block_id: int, head: int, payload: memoryview | bytes) -> None:
        """Fill head `head` (0-based, of this rank's heads) of the block from `part_bytes` bytes."""
        src = np.frombuffer(payload, np.uint8)
        if len(src) != self.part_bytes or not 0 <= head < self.num_heads:
            raise LayoutError(f"head {head} of {self.num_heads}: {len(src)} bytes instead of {self.part_bytes} "
                              "(our bug)")
        n, pos = self.num_heads, 0
        for region, stride, offset, size, outer, head_bytes in self._chunks:
            start = cpu_block_id * stride + offset
            seg = outer * head_bytes
            region[start:start + size].reshape(outer, n, head_bytes)[:, head, :] = src[pos:pos + seg].reshape(
                outer, head_bytes)
            pos += seg
