"""`HostRows`: a host pool's blocks as bytes, for tiers that keep whole blocks (worker_side/tiers/base.py).

A block's bytes are every KV plane's chunks of that block, planes in registration order, chunks in offset
order: `HostPool[cpu_block_id]` order, the same on every instance with the same layout (what a
`TierIdentity`'s layout fingerprint names). `read` copies a block out (the caller owns the bytes);
`write` fills one from a buffer of exactly `bytes_per_block` bytes. Allocates nothing but `read`'s result.
"""

from __future__ import annotations

import numpy as np

from worker_side.host_pool import HostPool


class HostRows:
    """Read and write whole blocks of a host pool as bytes, in `HostPool[cpu_block_id]` order."""

    def __init__(self, pool: HostPool) -> None:
        self.bytes_per_block = pool.bytes_per_block
        self._planes = [(v.tensor.numpy(), int(v.block_stride), [int(o) for o in v.chunk_offsets], v.chunk_bytes)
                        for v in pool.views]

    def read(self, cpu_block_id: int) -> bytes:
        return b"".join(region[cpu_block_id * stride + o:cpu_block_id * stride + o + size].tobytes()
                        for region, stride, offsets, size in self._planes for o in offsets)

    def write(self, cpu_block_id: int, payload: memoryview) -> None:
        src = np.frombuffer(payload, np.uint8)
        pos = 0
        for region, stride, offsets, size in self._planes:
            for o in offsets:
                start = cpu_block_id * stride + o
                region[start:start + size] = src[pos:pos + size]
                pos += size
