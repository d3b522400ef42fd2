"""Edges of the scheduler side's data structures that the complete mutation run of `scheduler_side/` left
untested (docs/mutation.md): the admission filter's smallest capacity, `BlockPool.reserve` with lists of
different lengths, and the free queue after a refused append."""

from __future__ import annotations

import pytest

from scheduler_side import BlockPool
from scheduler_side.admission.filter import AdmissionFilter
from scheduler_side.pool.free_queue import Block, FreeBlockQueue


def test_an_admission_filter_of_capacity_one_remembers_one_key() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        AdmissionFilter(0)
    f = AdmissionFilter(1)
    assert f.admit_request([b"a"]) == [] and f.capacity == 1


def test_reserve_of_more_blocks_than_keys_is_refused_and_reserves_nothing() -> None:
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.reserve([a, b], [b"ka"])
    assert pool.reserved == {} and a.block_hash is None and b.block_hash is None
    pool.check_integrity()


def test_appending_a_block_already_queued_is_refused_and_leaves_the_queue_walkable() -> None:
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks[:2])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append_n([blocks[2], blocks[0]])  # blocks[0] is queued already
    walked = list(queue)
    assert walked[:2] == blocks[:2] and blocks[2] in walked and len(walked) == len(queue)
    assert queue.popleft() is blocks[0]


def test_storing_a_key_again_drops_its_ghost_among_the_reused() -> None:
    """A reused key evicted from the CPU leaves a ghost in `b2`; stored again, it is on the CPU and no
    longer a ghost (a key is on the CPU or a ghost, never both: a stale ghost would skew ARC's target)."""
    pool = BlockPool(3, eviction="arc")  # 2 usable blocks
    q = pool.free_queue
    for k in range(3):
        (block,) = pool.allocate(1)
        pool.cache(block, k.to_bytes(4, "little"))
        pool.free([block])
        pool.note_reuse(k.to_bytes(4, "little"))  # reused: filed in t2, its eviction leaves a b2 ghost
    ghost = next(iter(q.b2))
    (block,) = pool.allocate(1)
    pool.cache(block, ghost)
    assert ghost not in q.b2 and ghost not in q.b1 and pool.lookup(ghost) is block
