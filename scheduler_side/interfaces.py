"""The narrow interfaces the scheduler side needs from the engine it serves.

- `RequestLike`: what we read from an engine request (vLLM's `Request` satisfies it as is).
- `GpuPool`: the engine's GPU block pool, borrowed. We only ever take and drop our *own* references
  (`touch`/`free`) and read the free queue's order for lazy stores; the engine owns everything else.
- `StepRequest`: one scheduled request of this step, as `build_connector_meta` needs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import NamedTuple, Protocol

from scheduler_side.pool.block_pool import BlockPool


class RequestLike(Protocol):
    request_id: str

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


class GpuPool(Protocol):
    def touch(self, gpu_block_ids: Sequence[int]) -> None:
        """Take one reference on each block (a block in the free queue leaves it).

        Our references are not cache accesses: the engine's cache metrics must not count them.
        """

    def free(self, gpu_block_ids: Sequence[int], front: bool = False, after: int | None = None) -> None:
        """Drop one of our references; at zero the block enters the free queue (where the engine puts a freed
        block, or at the head if front, the first listed nearest the head; with `after`, a free block's id,
        right behind that block, the first listed nearest it)."""

    def eviction_candidates(self) -> Iterator[tuple[int, bytes | None]]:
        """(gpu_block_id, cache key or None) of free blocks, from the eviction frontier onwards."""

    def frontier(self, num: int, after: int | None = None) -> tuple[list[int], list[bytes | None]]:
        """The first `num` free blocks from the eviction frontier (fewer when the queue is shorter), or
        with `after` (a free block's id) the first `num` behind that block, as their ids and their cache
        keys (None: no key), both in queue order. Reads only; O(num)."""

    def is_free(self, gpu_block_id: int) -> bool:
        """The block is in the free queue now (O(1))."""

    def cached_block(self, key: bytes) -> int | None:
        """The id of a block whose cache key is `key` (free or held), None if none has it (O(1))."""

    def num_free_blocks(self) -> int:
        """Blocks in the free queue now."""


class StepRequest(NamedTuple):
    """One request scheduled this step.

    `new_gpu_block_ids` are appended to what the connector knows of the request's blocks; with
    `replace_blocks` they are the request's whole block list (new or resumed requests). With several
    KV-cache groups (a hybrid model), `new_gpu_block_ids` holds one such sequence per group.
    `num_computed_tokens` is the count *after* this step's forward has run.

    An adapter may leave out a request that gets no new blocks, is not resumed, completes no block this
    step (`num_computed_tokens // block_size` unchanged) and gets no block hash it lacked before: every
    decision of the connector and its policies depends on whole, hashed blocks only, so
    `RequestState.num_computed_tokens` may lag within a block. vLLM's adapter leaves out such decode steps
    (most of a batch); with speculative decoding a block can be complete before its hash exists, so it
    keeps a request in a step with draft tokens and the step after. The fake engine sends every request.
    """

    request_id: str
    new_gpu_block_ids: Sequence[int]
    num_computed_tokens: int
    replace_blocks: bool = False


class BlockPoolGpuView:
    """`GpuPool` over our own `BlockPool` (the fake engine's GPU pool)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def touch(self, gpu_block_ids: Sequence[int]) -> None:
        blocks = self.pool.blocks
        self.pool.touch(blocks[i] for i in gpu_block_ids)

    def free(self, gpu_block_ids: Sequence[int], front: bool = False, after: int | None = None) -> None:
        blocks = self.pool.blocks
        self.pool.free((blocks[i] for i in gpu_block_ids), front=front,
                       after=None if after is None else blocks[after])

    def eviction_candidates(self) -> Iterator[tuple[int, bytes | None]]:
        for block in self.pool.free_queue:
            yield block.block_id, block.block_hash

    def frontier(self, num: int, after: int | None = None) -> tuple[list[int], list[bytes | None]]:
        start = None if after is None else self.pool.blocks[after]
        blocks = list(islice(self.pool.free_queue.iter_after(start), max(0, num)))
        return [b.block_id for b in blocks], [b.block_hash for b in blocks]

    def is_free(self, gpu_block_id: int) -> bool:
        return self.pool.free_queue.contains(self.pool.blocks[gpu_block_id])

    def cached_block(self, key: bytes) -> int | None:
        block = self.pool.cached.get(key)
        return None if block is None else block.block_id

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
