"""`GpuPool` over vLLM's GPU `BlockPool`: the narrow view the scheduler side borrows.

The engine owns the pool. Through this view the connector only ever
- takes one reference on a block (`touch`) while a transfer of it is in flight, and
- drops exactly the references it took (`free`), optionally putting blocks that reach zero at the *head*
  of vLLM's free queue (evicted first) instead of the tail, and
- reads the free queue from its head (the eviction frontier) for lazy stores, and puts blocks it saved
  back at their place in that order (`move_to_front`).

Invariants kept: a block with a connector reference has ref_cnt > 0, so it is never in vLLM's free queue
and never handed to another request; the null block (id 0) is never touched or freed here. A failed
`free` (a block with ref_cnt 0: our bug) raises before changing anything.

Imports nothing from vLLM at module level: it works on any object shaped like vLLM 0.32's `BlockPool`
(`blocks`, `touch`, `free_blocks`, `free_block_queue` with `fake_free_list_head/tail` and `prepend_n`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class GpuPoolError(RuntimeError):
    """The connector misused vLLM's GPU block pool (a double free or the null block): always our bug."""


class VllmGpuPool:
    """Adapter implementing `scheduler_side.GpuPool` on vLLM's `BlockPool` (bound after construction)."""

    def __init__(self, block_pool: Any | None = None) -> None:
        self._pool = block_pool

    def bind(self, block_pool: Any) -> None:
        self._pool = block_pool

    @property
    def pool(self) -> Any:
        if self._pool is None:
            raise GpuPoolError("vLLM's GPU block pool was not bound yet (bind_gpu_block_pool not called)")
        return self._pool

    def _blocks(self, gpu_block_ids: Sequence[int]) -> list[Any]:
        blocks = self.pool.blocks
        if gpu_block_ids and (min(gpu_block_ids) <= 0 or max(gpu_block_ids) >= len(blocks)):
            bad = next(i for i in gpu_block_ids if i <= 0 or i >= len(blocks))
            raise GpuPoolError(
                f"GPU block id {bad} is the null block or out of range 1..{len(blocks) - 1} (our bug)"
            )
        return [blocks[i] for i in gpu_block_ids]

    def touch(self, gpu_block_ids: Sequence[int]) -> None:
        self.pool.touch(self._blocks(gpu_block_ids))

    def free(self, gpu_block_ids: Sequence[int], front: bool = False) -> None:
        blocks = self._blocks(gpu_block_ids)
        for block in blocks:
            if block.ref_cnt <= 0:
                raise GpuPoolError(f"free of GPU block {block.block_id} with ref_cnt {block.ref_cnt} (our bug)")
        if not front:
            # vLLM's own order: hashed blocks to the tail (LRU), unhashed ones to the head.
            self.pool.free_blocks(blocks)
            return
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        # prepend_n keeps list order: the first listed block ends up nearest the head.
        self.pool.free_block_queue.prepend_n(released)

    def eviction_candidates(self) -> Iterator[tuple[int, bytes | None]]:
        """(gpu_block_id, cache key or None) of free blocks, walking from the head of vLLM's free queue.

        Callers must stop iterating before changing the pool (the walk follows live links).
        """
        queue = self.pool.free_block_queue
        tail = queue.fake_free_list_tail
        block = queue.fake_free_list_head.next_free_block
        while block is not None and block is not tail:
            yield block.block_id, block.block_hash
            block = block.next_free_block

    def move_to_front(self, blocks: Sequence[tuple[int, bytes | None]]) -> None:
        """Put these free blocks at the head of vLLM's free queue, first listed nearest the head.

        A block that is held now, or whose hash changed since it was listed, stays where it is.
        """
        queue = self.pool.free_block_queue
        moved = []
        for gpu_block_id, key in blocks:
            block = self.pool.blocks[gpu_block_id]
            if block.ref_cnt == 0 and block.block_hash == key and block.prev_free_block is not None:
                queue.remove(block)
                moved.append(block)
        queue.prepend_n(moved)

    def num_free_blocks(self) -> int:
        return self.pool.free_block_queue.num_free_blocks
