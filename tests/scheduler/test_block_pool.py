"""Block pool: LRU order, touch from the middle, eviction drops the hash, ref counts, null block, reservations
(reserve, commit, abort), discard and demote, the free queue's refusals, and the integrity check."""

import pytest

from scheduler_side import BlockPool, PoolError
from scheduler_side.pool.free_queue import Block, FreeBlockQueue


def ids(blocks):
    return [b.block_id for b in blocks]


def test_initial_order_and_null_block_never_handed_out():
    pool = BlockPool(5)
    assert ids(pool.free_queue) == [1, 2, 3, 4]
    assert ids(pool.allocate(4)) == [1, 2, 3, 4]
    assert pool.allocate(1) is None
    pool.check_integrity()


def test_failed_allocate_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1)
    before = ids(pool.free_queue)
    assert pool.allocate(3) is None
    assert ids(pool.free_queue) == before
    pool.check_integrity()


def test_free_appends_at_tail_and_front_at_head():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.free([b])
    assert ids(pool.free_queue) == [4, 5, 2]
    pool.free([a, c], front=True)
    assert ids(pool.free_queue) == [1, 3, 4, 5, 2]  # first listed nearest the head
    pool.check_integrity()


def test_free_after_puts_blocks_behind_a_free_block_and_walks_on_from_it():
    pool = BlockPool(7)
    a, b, c = pool.allocate(3)
    pool.free([a, c], after=pool.blocks[5])
    assert ids(pool.free_queue) == [4, 5, 1, 3, 6]  # first listed nearest the anchor
    queue = pool.free_queue
    assert ids(queue.iter_after(pool.blocks[5])) == [1, 3, 6] and ids(queue.iter_after(None)) == ids(queue)
    assert FreeBlockQueue.contains(pool.blocks[3]) and not FreeBlockQueue.contains(b)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        list(queue.iter_after(b))
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.insert_after(b, [])
    with pytest.raises(PoolError, match="caller bug"):
        pool.free([b], after=b)
    assert b.ref_cnt == 1
    pool.check_integrity()


def test_free_after_is_refused_on_a_pool_with_an_eviction_policy():
    pool = BlockPool(4, eviction="lru")
    a, b = pool.allocate(2)
    with pytest.raises(PoolError, match="caller bug"):
        pool.free([a], after=pool.blocks[3])


def test_touch_removes_from_middle_and_counts_refs():
    pool = BlockPool(5)
    blocks = pool.blocks
    pool.touch([blocks[3]])
    assert ids(pool.free_queue) == [1, 2, 4]
    pool.touch([blocks[3]])
    assert blocks[3].ref_cnt == 2
    pool.free([blocks[3]])
    assert ids(pool.free_queue) == [1, 2, 4]
    pool.free([blocks[3]])
    assert ids(pool.free_queue) == [1, 2, 4, 3]
    pool.check_integrity()


def test_eviction_drops_hash_and_reports_it():
    evicted = []
    pool = BlockPool(3, on_evict=lambda key, by_allocation: evicted.append((key, by_allocation)))
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h-a") and pool.cache(b, b"h-b")
    pool.free([a, b])
    assert pool.lookup(b"h-a") is a  # a free cached block is still a hit
    (c,) = pool.allocate(1)
    assert c is a and c.block_hash is None
    assert pool.lookup(b"h-a") is None and pool.lookup(b"h-b") is b
    assert evicted == [(b"h-a", True)] and pool.num_evictions == 1
    pool.uncache(b)
    assert evicted[-1] == (b"h-b", False) and pool.num_evictions == 1  # a drop, not an eviction
    pool.check_integrity()


def test_an_allocations_evictions_are_told_once_in_eviction_order_when_a_batch_listener_is_set():
    per_key, batches = [], []
    pool = BlockPool(5, on_evict=lambda key, by_allocation: per_key.append(key), eviction="lru")
    blocks = pool.allocate(4)
    for block, key in zip(blocks, (b"k1", b"k2", b"k3", b"k4"), strict=True):
        assert pool.cache(block, key)
    pool.free(blocks)
    pool.on_evict_keys = batches.append
    assert ids(pool.allocate(3)) == [1, 2, 3]
    assert batches == [[b"k1", b"k2", b"k3"]] and per_key == [] and pool.num_evictions == 3
    pool.on_evict_keys = None  # without it: `on_evict` hears each
    pool.allocate(1)
    assert per_key == [b"k4"] and pool.num_evictions == 4
    pool.check_integrity()


def test_discard_forgets_the_content_and_puts_the_block_first_in_line_under_every_eviction_policy():
    for eviction in ("lru", "arc"):
        dropped: list[tuple[bytes, bool]] = []
        pool = BlockPool(5, on_evict=lambda key, by_allocation, out=dropped: out.append((key, by_allocation)),
                         eviction=eviction)
        blocks = pool.allocate(4)
        for block, key in zip(blocks, (b"k1", b"k2", b"k3", b"k4"), strict=True):
            assert pool.cache(block, key)
        pool.free(blocks[:2])  # 1, 2 free and cached; 3, 4 held
        assert pool.discard(blocks[1]) and not pool.discard(blocks[2])  # a held copy stays
        assert blocks[1].block_hash is None and pool.lookup(b"k2") is None and dropped == [(b"k2", False)]
        assert ids(pool.free_queue)[0] == 2  # empty room, taken before any cached block
        pool.check_integrity()


def test_cache_refuses_second_block_for_same_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h")
    assert not pool.cache(b, b"h")
    assert pool.lookup(b"h") is a and b.block_hash is None


def test_double_free_and_null_block_misuse_raise():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(PoolError, match="double free"):
        pool.free([a])
    with pytest.raises(PoolError, match="null block"):
        pool.touch([pool.null_block])
    with pytest.raises(PoolError, match="null block"):
        pool.free([pool.null_block])
    pool.check_integrity()


def test_integrity_detects_a_leak():
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = 0
    pool.free_queue.remove(pool.blocks[1])
    with pytest.raises(PoolError, match="leaked"):
        pool.check_integrity()


def test_blocks_use_slots():
    assert not hasattr(Block(1), "__dict__")


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_reserve_commit_abort_keep_the_key_in_the_pool():
    """An in-flight store's key: reserved (not hit-able), then cached on commit or forgotten on abort."""
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    pool.reserve([a, b], [b"ka", b"kb"])
    assert pool.lookup(b"ka") is None and pool.reserved == {b"ka": a, b"kb": b}
    pool.check_integrity()
    assert pool.commit([a]) == [b"ka"] and pool.lookup(b"ka") is a
    pool.abort([b])
    assert pool.reserved == {} and b.block_hash is None and pool.lookup(b"kb") is None
    pool.free([a, b])
    pool.check_integrity()


def test_reserve_refuses_without_changing_anything():
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    pool.cache(b, b"kb")
    with pytest.raises(PoolError, match="held and empty"):
        pool.reserve([a, b], [b"ka", b"kx"])  # b holds content already
    with pytest.raises(PoolError, match="held and empty"):
        pool.reserve([a], [b"kb"])  # the key is cached
    assert pool.reserved == {} and a.block_hash is None
    free_block = pool.blocks[5]
    with pytest.raises(PoolError, match="held and empty"):
        pool.reserve([free_block], [b"kf"])
    with pytest.raises(PoolError, match="no reservation"):
        pool.commit([a])


def test_commit_of_a_key_cached_meanwhile_caches_nothing():
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    pool.reserve([a], [b"k"])
    pool.cache(b, b"k")  # another block got the same content first
    assert pool.commit([a]) == [] and pool.lookup(b"k") is b and a.block_hash is None


def test_integrity_detects_a_broken_reservation():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.reserve([a], [b"k"])
    a.block_hash = b"other"
    with pytest.raises(PoolError, match="reservation"):
        pool.check_integrity()


def test_discard_leaves_a_held_block_and_its_content_alone():
    """Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    pool = BlockPool(4)
    (held,) = pool.allocate(1)
    assert pool.cache(held, b"k")
    assert pool.discard(held) is False
    assert pool.lookup(b"k") is held and held.ref_cnt == 1
    pool.free([held])
    assert pool.discard(held) is True
    assert pool.lookup(b"k") is None and next(iter(pool.free_queue)) is held  # first to be reused
    pool.check_integrity()


def test_recaching_a_block_under_another_key_forgets_the_old_one_and_only_that():
    """Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    evicted = []
    pool = BlockPool(4, on_evict=lambda key, by_allocation: evicted.append(key))
    (block,) = pool.allocate(1)
    assert pool.cache(block, b"k1") and pool.cache(block, b"k1")  # the same key again: nothing dropped
    assert evicted == [] and pool.lookup(b"k1") is block
    assert pool.cache(block, b"k2")
    assert evicted == [b"k1"] and pool.lookup(b"k1") is None and pool.lookup(b"k2") is block
    pool.free([block])
    pool.check_integrity()


def test_commit_or_abort_of_a_block_without_a_reservation_is_refused():
    """Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, b"k")  # cached, not reserved
    for op in (pool.commit, pool.abort):
        with pytest.raises(PoolError, match="holds no reservation"):
            op([block])
    assert pool.lookup(b"k") is block



def test_reserve_of_more_blocks_than_keys_is_refused_and_reserves_nothing() -> None:
    """Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.reserve([a, b], [b"ka"])
    assert pool.reserved == {} and a.block_hash is None and b.block_hash is None
    pool.check_integrity()



def test_pool_integrity_sees_the_null_block_in_the_free_queue_and_bad_reservations():
    """Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    for count in (0, 2):  # the null block's count changed by a bug (it never enters the free queue)
        pool = BlockPool(4)
        pool.null_block.ref_cnt = count
        with pytest.raises(PoolError, match="null block"):
            pool.check_integrity()
    for breakage in ("freed", "also cached"):
        pool = BlockPool(4)
        (a,) = pool.allocate(1)
        pool.reserve([a], [b"k"])
        if breakage == "freed":
            a.ref_cnt = 0  # a reservation whose block nobody holds
            pool.free_queue.append(a)
        else:
            pool.cached[b"k"] = a  # a reservation that is hit-able already
        with pytest.raises(PoolError, match="reservation"):
            pool.check_integrity()



def test_demote_moves_only_a_free_block_and_says_so() -> None:
    """`demote` returns False and moves nothing for a held block; True for a free one, now evicted first.

    Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    pool = BlockPool(4)
    held, free = pool.allocate(2)
    assert pool.cache(held, b"h") and pool.cache(free, b"f")
    pool.free([free])
    order = list(pool.free_queue)
    assert pool.demote(held) is False
    assert list(pool.free_queue) == order and held.ref_cnt == 1
    assert pool.demote(free) is True
    assert next(iter(pool.free_queue)) is free and pool.lookup(b"f") is free
    pool.check_integrity()



def test_popping_an_empty_free_queue_is_refused():
    """Found by mutation testing of scheduler_side/pool/free_queue.py (docs/mutation.md)."""
    with pytest.raises(RuntimeError, match="empty queue"):
        FreeBlockQueue([]).popleft()



def test_appending_a_block_already_queued_is_refused_and_leaves_the_queue_walkable() -> None:
    """Found by mutation testing of scheduler_side/pool/free_queue.py (docs/mutation.md)."""
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks[:2])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append_n([blocks[2], blocks[0]])  # blocks[0] is queued already
    walked = list(queue)
    assert walked[:2] == blocks[:2] and blocks[2] in walked and len(walked) == len(queue)
    assert queue.popleft() is blocks[0]


# --- empty_first (the CPU tier's LRU): no cached block is evicted while an empty block is free -----------

def cached_pool(num_blocks: int, num_cached: int) -> BlockPool:
    """An empty-first pool whose blocks 1..num_cached hold content, free, least recently used first."""
    pool = BlockPool(num_blocks, eviction="lru")
    blocks = pool.allocate(num_cached)
    for block in blocks:
        pool.cache(block, b"h%d" % block.block_id)
    pool.free(blocks)
    return pool


def test_empty_first_takes_every_empty_block_before_any_cached_one():
    pool = cached_pool(7, 3)
    assert ids(pool.free_queue) == [4, 5, 6, 1, 2, 3]  # empty ones first, then cached in LRU order
    assert ids(pool.allocate(4)) == [4, 5, 6, 1] and pool.num_evictions == 1
    pool.check_integrity()


def test_empty_first_a_cached_block_freed_to_the_front_goes_behind_the_empty_ones():
    # A loaded block's copy given up (lazy, tier not full): evicted before older content, never before room.
    pool = cached_pool(7, 3)
    copy = pool.blocks[3]
    pool.touch([copy])
    pool.free([copy], front=True)
    assert ids(pool.free_queue) == [4, 5, 6, 3, 1, 2]
    assert ids(pool.allocate(3)) == [4, 5, 6] and pool.num_evictions == 0
    assert ids(pool.allocate(1)) == [3] and pool.num_evictions == 1
    pool.check_integrity()


def test_empty_first_demote_goes_behind_the_empty_ones_and_a_forgotten_block_comes_first():
    pool = cached_pool(7, 3)
    assert pool.demote(pool.blocks[2])  # a closed session's copy
    assert ids(pool.free_queue) == [4, 5, 6, 2, 1, 3]
    pool.uncache(pool.blocks[3])  # forgotten while free: free room, taken first
    assert ids(pool.free_queue) == [3, 4, 5, 6, 2, 1]
    assert pool.discard(pool.blocks[1])
    assert ids(pool.free_queue) == [1, 3, 4, 5, 6, 2]
    pool.check_integrity()


def test_empty_first_integrity_sees_a_cached_block_ahead_of_an_empty_one():
    pool = cached_pool(5, 1)
    pool.free_queue.lru.remove(pool.blocks[1])  # our bug, simulated: the cached block filed as empty
    pool.free_queue.empty.appendleft(pool.blocks[1])
    with pytest.raises(PoolError, match="would be evicted before the empty"):
        pool.check_integrity()


def test_without_empty_first_one_lru_order_holds_every_block():
    # The fake engine's GPU pool, like vLLM's: a block freed to the front is taken first, cached or not.
    pool = BlockPool(5)
    a = pool.allocate(1)[0]
    pool.cache(a, b"h")
    pool.free([a], front=True)
    assert ids(pool.free_queue) == [1, 2, 3, 4]
    pool.check_integrity()
