"""`GpuPool` over vLLM's GPU `BlockPool`: the narrow view the scheduler side borrows.

The engine owns the pool. Through this view the connector only ever
- takes one reference on a block (`touch`) while a transfer of it is in flight, and
- drops exactly the references it took (`free`), optionally putting blocks that reach zero at the *head*
  of vLLM's free queue (evicted first) instead of vLLM's own place for them, and
- reads the free queue from its head (the eviction frontier), or on from a free block, for lazy stores.

Invariants kept: a block with a connector reference has ref_cnt > 0, so it is never in vLLM's free queue
and never handed to another request; the null block (id 0) is never touched or freed here. A failed
`touch` or `free` (the null block, an id out of range, or more frees than references: our bug) raises
before changing anything. Every call costs O(blocks named), never O(pool).

Our references are not cache accesses. vLLM's `BlockPool.touch` also reports each block to the pool's
`KVCacheMetricsCollector` (`on_block_accessed`), which feeds the residency histograms
(`vllm:kv_block_idle_before_evict_seconds`, `vllm:kv_block_reuse_gap_seconds`). So `touch` here does
what vLLM's `touch` does minus that report: it takes the block out of the free queue with the queue's
public `remove` when its count is zero and adds one to `ref_cnt`. `BlockPool` has no public method for
that; `tests/vllm_adapter/test_vllm_gpu_pool.py` pins the equivalence against the installed vLLM.

Only public vLLM API (the contract, checked by that test; vLLM 0.32): `BlockPool.blocks`, `free_blocks`,
`get_num_free_blocks`, `free_block_queue` with `remove`, `prepend_n` and `iter_blocks_after`,
`cached_block_hash_to_block.get_one_block`, and a block's `block_id`, `ref_cnt`, `block_hash` and
`is_null`; except two calls in compat.py: `frontier` reads the free list's links (`free_queue_reader`, the
same blocks as `iter_blocks_after`, faster), and `free(after=...)` writes them behind a given block as
vLLM's `prepend_n` writes them at the head (`free_queue_inserter`; where vLLM's queue lacks those links,
at the head). Both are pinned against vLLM's public walk and `prepend_n`/`append_n` by that test. Imports
nothing from vLLM at module level.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any

_ref_cnt = attrgetter("ref_cnt")


class GpuPoolError(RuntimeError):
    """The connector misused vLLM's GPU block pool (a double free or the null block): always our bug."""


class VllmGpuPool:
    """Adapter implementing `scheduler_side.GpuPool` on vLLM's `BlockPool` (bound after construction)."""

    def __init__(self, block_pool: Any | None = None) -> None:
        self._pool: Any | None = None
        self._read_frontier: Callable[[int, Any], tuple[list[int], list[Any]]] | None = None
        self._insert_after: Callable[[Any, list[Any]], None] | None = None
        if block_pool is not None:
            self.bind(block_pool)

    def bind(self, block_pool: Any) -> None:
        from offload_connector.vllm.compat import free_queue_inserter, free_queue_reader

        self._pool = block_pool
        self._read_frontier = free_queue_reader(block_pool)
        self._insert_after = free_queue_inserter(block_pool)

    @property
    def pool(self) -> Any:
        if self._pool is None:
            raise GpuPoolError("vLLM's GPU block pool was not bound yet (bind_gpu_block_pool not called)")
        return self._pool

    def _blocks(self, gpu_block_ids: Sequence[int]) -> list[Any]:
        """The blocks named, refusing the null block and ids out of range before anything changes."""
        blocks = self.pool.blocks
        if gpu_block_ids and (min(gpu_block_ids) <= 0 or max(gpu_block_ids) >= len(blocks)):
            bad = next(i for i in gpu_block_ids if i <= 0 or i >= len(blocks))
            raise GpuPoolError(
                f"GPU block id {bad} is the null block or out of range 1..{len(blocks) - 1} (our bug)"
            )
        return list(map(blocks.__getitem__, gpu_block_ids))  # vLLM's null block is block 0, refused above

    def touch(self, gpu_block_ids: Sequence[int]) -> None:
        """Take one reference on each block: `BlockPool.touch` without its cache-access report."""
        queue = self.pool.free_block_queue
        for block in self._blocks(gpu_block_ids):
            if block.ref_cnt == 0:
                queue.remove(block)  # a free block is always in the queue (vLLM's invariant)
            block.ref_cnt += 1

    def free(self, gpu_block_ids: Sequence[int], front: bool = False, after: int | None = None) -> None:
        """Drop one reference per id listed. At zero vLLM's `free_blocks` queues a block (hashed: tail,
        unhashed: head); with `front` the blocks reaching zero then go to the head, first listed first; with
        `after` (a free block) right behind it, first listed first (at the head where vLLM's queue cannot)."""
        blocks = self._blocks(gpu_block_ids)
        distinct = len(set(gpu_block_ids)) == len(gpu_block_ids)
        if blocks and min(map(_ref_cnt, blocks)) <= 0 or not distinct:
            for gpu_block_id, num_frees in Counter(gpu_block_ids).items():  # the slow path names the block
                ref_cnt = self.pool.blocks[gpu_block_id].ref_cnt
                if ref_cnt < num_frees:
                    raise GpuPoolError(
                        f"{num_frees} free(s) of GPU block {gpu_block_id} with ref_cnt {ref_cnt} (our bug)")
        anchor = None
        if after is not None:
            anchor = self.pool.blocks[after]
            if anchor.ref_cnt != 0 or anchor.is_null:
                raise GpuPoolError(f"free after GPU block {after}, which is not free (our bug)")
        if not front and anchor is None:
            self.pool.free_blocks(blocks)
            return
        # At the head (or behind `anchor`): what `free_blocks` then `remove` and `prepend_n` would do, without queueing each block
        # at vLLM's place first (the blocks are the pool's own, none the null block).
        for block in blocks:
            block.ref_cnt -= 1
        if not distinct:  # a block listed twice is placed once, where it is first listed
            blocks = list(map(self.pool.blocks.__getitem__, dict.fromkeys(gpu_block_ids)))
        released = [block for block in blocks if block.ref_cnt == 0]
        if anchor is not None and self._insert_after is not None:
            self._insert_after(anchor, released)  # the first listed block ends up nearest the anchor
        else:
            self.pool.free_block_queue.prepend_n(released)  # the first listed block ends up nearest the head

    def eviction_candidates(self) -> Iterator[tuple[int, bytes | None]]:
        """(gpu_block_id, cache key or None) of free blocks, walking from the head of vLLM's free queue.

        Callers must stop iterating before changing the pool (the walk follows the live queue).
        """
        for block in self.pool.free_block_queue.iter_blocks_after(None):
            yield block.block_id, block.block_hash

    def frontier(self, num: int, after: int | None = None) -> tuple[list[int], list[bytes | None]]:
        """Ids and cache keys of the first `num` free blocks from the head of vLLM's free queue, or behind
        the free block `after` (what `iter_blocks_after` walks; read by `compat.free_queue_reader`)."""
        read = self._read_frontier
        if read is None:
            raise GpuPoolError("vLLM's GPU block pool was not bound yet (bind_gpu_block_pool not called)")
        if after is None:
            return read(num, None)
        block = self.pool.blocks[after]
        if block.ref_cnt != 0 or block.is_null:
            raise GpuPoolError(f"frontier after GPU block {after}, which is not free (our bug)")
        return read(num, block)

    def is_free(self, gpu_block_id: int) -> bool:
        """In vLLM's free queue: every block with no reference is there, the null block never."""
        block = self.pool.blocks[gpu_block_id]
        return block.ref_cnt == 0 and not block.is_null

    def cached_block(self, key: bytes) -> int | None:
        """vLLM's prefix cache map: a block holding `key` (`BlockHashToBlockMap.get_one_block`)."""
        block = self.pool.cached_block_hash_to_block.get_one_block(key)
        return None if block is None else block.block_id

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()
