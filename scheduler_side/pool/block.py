"""`Block`: one block of a tier's pool, as every eviction policy sees it.

Created once at start-up by `BlockPool` (as the eviction policy's `block_type`, which may add the fields
that policy keeps per block) and moved between the free queue and users. `ref_cnt` counts holders
(requests and in-flight transfers); `block_hash` is the cache key the block's contents answer to, or
None. A block with ref_cnt > 0 is never in the free queue. `prev`/`next` link it into one
`FreeBlockQueue` (set exactly while it is in one); only that class touches them.
"""

from __future__ import annotations


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"
