"""`VllmGpuPool` against the installed vLLM's real `BlockPool` (supported: vLLM 0.32.x, and 0.33.x).

The adapter may use only the public `BlockPool` API named in `CONTRACT`; a vLLM that renames or drops
any of it fails `test_contract_*` loudly, as does one whose `touch` starts doing more than the adapter's
copy of it. Its references are the connector's own, not cache accesses: they must not reach vLLM's
`KVCacheMetricsCollector` (the residency histograms).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

from offload_connector.vllm.compat import free_queue_reader  # noqa: E402
from offload_connector.vllm.gpu_pool import GpuPoolError, VllmGpuPool  # noqa: E402

BS = 16
NUM_BLOCKS = 10  # block 0 is vLLM's null block; 1..9 start in the free queue in id order

# Everything of vLLM's the adapter may touch, by owner.
CONTRACT = {
    "BlockPool": ("blocks", "free_blocks", "get_num_free_blocks", "free_block_queue", "cached_block_hash_to_block"),
    "FreeKVCacheBlockQueue": ("remove", "prepend_n", "iter_blocks_after"),
    "KVCacheBlock": ("block_id", "ref_cnt", "block_hash", "is_null"),
}


# ---------------------------------------------------------------- helpers
def make_pool(metrics: bool = False) -> BlockPool:
    collector = KVCacheMetricsCollector(sample_rate=1.0) if metrics else None  # sample every block
    return BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS,
                     metrics_collector=collector)


def queue_ids(pool: BlockPool) -> list[int]:
    """vLLM's free queue, head (evicted first) to tail, read with vLLM's own accessor."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def snapshot(pool: BlockPool) -> tuple:
    return ref_cnts(pool), queue_ids(pool), pool.get_num_free_blocks(), [b.block_hash for b in pool.blocks]


def check_pool(pool: BlockPool) -> None:
    """vLLM's invariant: a non-null block is in the free queue iff nobody holds it."""
    in_queue = set(queue_ids(pool))
    assert pool.get_num_free_blocks() == len(in_queue)
    for block in pool.blocks[1:]:
        assert (block.ref_cnt == 0) == (block.block_id in in_queue), block
        assert block.ref_cnt >= 0, block


def key(n: int) -> bytes:
    return make_block_hash_with_group_id(bytes([n]) * 32, 0)


def run_request(pool: BlockPool, num_blocks: int, first_hash: int = 1) -> list[int]:
    """The engine allocates `num_blocks`, caches them full (hashes first_hash, +1, ...) and frees them
    the way vLLM's manager does (last block first), so they sit at the queue's tail in LRU order."""
    blocks = pool.get_new_blocks(num_blocks)
    request = SimpleNamespace(block_hashes=[bytes([first_hash + i]) * 32 for i in range(num_blocks)])
    pool.cache_full_blocks(request, blocks, 0, num_blocks, BS, 0)
    pool.free_blocks(reversed(blocks))
    return [b.block_id for b in blocks]


class ContractOnly:
    """Exposes only the attributes `CONTRACT` names for `kind`; anything else fails the test."""

    def __init__(self, target: object, kind: str) -> None:
        self._target, self._kind = target, kind

    def __getattr__(self, name: str) -> object:
        if name not in CONTRACT[self._kind]:
            raise AssertionError(f"the adapter used {self._kind}.{name}, outside the vLLM contract")
        value = getattr(self._target, name)
        return ContractOnly(value, "FreeKVCacheBlockQueue") if name == "free_block_queue" else value


# ---------------------------------------------------------------- the contract
def test_contract_names_exist_in_installed_vllm() -> None:
    pool = make_pool()
    owners = {"BlockPool": pool, "FreeKVCacheBlockQueue": pool.free_block_queue, "KVCacheBlock": pool.blocks[1]}
    assert isinstance(pool.free_block_queue, FreeKVCacheBlockQueue)
    assert isinstance(pool.blocks[1], KVCacheBlock)
    missing = [f"{kind}.{name}" for kind, names in CONTRACT.items() for name in names
               if not hasattr(owners[kind], name)]
    assert not missing, f"vLLM changed the API VllmGpuPool relies on: {missing}"
    assert pool.blocks[0] is pool.null_block and pool.null_block.is_null


def test_contract_adapter_uses_nothing_else() -> None:
    pool = make_pool()
    run_request(pool, 2)
    view = VllmGpuPool(ContractOnly(pool, "BlockPool"))
    view.touch([3, 1, 5])
    view.free([3], front=True)
    view.free([1])
    view.free([5], after=3)  # (links outside the contract: at the head instead)
    frontier = list(view.eviction_candidates())
    assert view.frontier(2, after=frontier[0][0])[0] == [i for i, _ in frontier[1:3]]
    assert view.is_free(5) and view.cached_block(key(2)) == 2 and view.cached_block(key(99)) is None
    assert view.num_free_blocks() == NUM_BLOCKS - 1
    check_pool(pool)


def test_contract_touch_is_vllm_touch_minus_the_access_report() -> None:
    # Twin pools, same history: vLLM's touch on one, ours on the other, must leave the same state.
    pools = [make_pool(), make_pool()]
    for pool in pools:
        run_request(pool, 3)
        pool.get_new_blocks(2)  # 4 5: held by the engine
    ids = [1, 4, 1, 9]  # free, engine-held, twice, free
    pools[0].touch([pools[0].blocks[i] for i in ids])
    VllmGpuPool(pools[1]).touch(ids)
    assert snapshot(pools[0]) == snapshot(pools[1])
    check_pool(pools[1])


def test_free_after_links_blocks_behind_a_free_block_as_prepend_n_does_at_the_head() -> None:
    """`free(after=...)` writes vLLM's free-list links itself (compat.free_queue_inserter): the queue it
    leaves must be the one vLLM's public `remove` and `prepend_n` give for the same order, and vLLM's own
    invariants must hold."""
    pools = [make_pool(), make_pool()]
    for pool in pools:
        run_request(pool, 4)  # 1..4 hashed at the tail: 5 6 7 8 9 4 3 2 1
    ours = VllmGpuPool(pools[0])
    ours.touch([6, 2])
    ours.free([6, 2], after=9)
    assert queue_ids(pools[0]) == [5, 7, 8, 9, 6, 2, 4, 3, 1]
    # the same order through vLLM's public API only: everything behind 9 off, then back in order
    queue = pools[1].free_block_queue
    tail = [b for b in queue.get_all_free_blocks() if b.block_id in (4, 3, 1, 6, 2)]
    for block in tail:
        queue.remove(block)
    queue.append_n([pools[1].blocks[i] for i in (6, 2, 4, 3, 1)])
    assert snapshot(pools[0]) == snapshot(pools[1])
    check_pool(pools[0])
    assert free_queue_reader(pools[0])(9, None)[0] == queue_ids(pools[0])


# ---------------------------------------------------------------- metrics (regression)
def test_protection_references_are_not_cache_accesses() -> None:
    """vLLM's `touch` records an access per block (last access time, reuse gaps) in the pool's metrics
    collector; evicting the block then reports fake reuse gaps and a reset idle time. Ours must not."""
    pool = make_pool(metrics=True)
    collector = pool.metrics_collector
    view = VllmGpuPool(pool)
    ids = run_request(pool, 2)
    state = {i: collector.block_metrics[i] for i in ids}  # sampled at allocation (rate 1.0)
    births = {i: s.last_access_ns for i, s in state.items()}
    # 1. Two stores of the same blocks: take and drop a protection reference twice.
    for _ in range(2):
        view.touch(ids)
        view.free(ids, front=True)
    # 2. No access was recorded ...
    assert all(not state[i].access_history for i in ids)
    assert {i: s.last_access_ns for i, s in state.items()} == births
    # 3. ... so when the engine reuses every free block, the evictions report no reuse.
    pool.get_new_blocks(pool.get_num_free_blocks())
    events = collector.drain_events()
    assert len(events) == len(ids)  # the sampled blocks
    assert all(e.reuse_gaps_seconds == () for e in events)


def test_vllm_touch_does_count_as_an_access() -> None:
    """The premise of the test above, on the installed vLLM (if it fails, re-read `BlockPool.touch`)."""
    pool = make_pool(metrics=True)
    (gpu_block_id,) = run_request(pool, 1)
    block = pool.blocks[gpu_block_id]
    for _ in range(2):
        pool.touch([block])
        pool.free_blocks([block])
    assert len(pool.metrics_collector.block_metrics[gpu_block_id].access_history) == 2


# ---------------------------------------------------------------- every GpuPool method
def test_references_keep_blocks_out_of_the_free_queue() -> None:
    pool = make_pool()
    view = VllmGpuPool(pool)
    # 1. A free block leaves the queue with our first reference and comes back with our last.
    view.touch([5])
    view.touch([5])
    assert pool.blocks[5].ref_cnt == 2 and 5 not in queue_ids(pool)
    view.free([5])
    assert pool.blocks[5].ref_cnt == 1 and 5 not in queue_ids(pool)
    view.free([5])
    assert pool.blocks[5].ref_cnt == 0 and 5 in queue_ids(pool)
    # 2. A block the engine holds stays out until both the engine and we let go.
    (held,) = [b.block_id for b in pool.get_new_blocks(1)]
    view.touch([held])
    view.free([held], front=True)
    assert pool.blocks[held].ref_cnt == 1 and held not in queue_ids(pool)
    pool.free_blocks([pool.blocks[held]])
    assert held in queue_ids(pool)
    assert view.num_free_blocks() == pool.get_num_free_blocks() == NUM_BLOCKS - 1
    check_pool(pool)


def test_free_puts_blocks_at_vllms_place_or_at_the_head() -> None:
    pool = make_pool()
    view = VllmGpuPool(pool)
    a = run_request(pool, 2, first_hash=1)  # hashed
    assert queue_ids(pool)[-2:] == a[::-1]
    # 1. Without front, vLLM's own order: hashed blocks to the tail (LRU), unhashed ones to the head.
    view.touch([a[0], 9])
    view.free([a[0], 9])
    assert queue_ids(pool)[0] == 9 and queue_ids(pool)[-1] == a[0]
    # 2. With front, every block reaching zero goes to the head, the first listed nearest it.
    view.touch([a[1], a[0], 9])
    view.free([a[0], a[1], 9], front=True)
    assert queue_ids(pool)[:3] == [a[0], a[1], 9]
    # 3. A block listed twice is freed twice and placed once.
    view.touch([a[1], a[1]])
    view.free([a[1], a[1]], front=True)
    assert queue_ids(pool)[:3] == [a[1], a[0], 9]
    check_pool(pool)


def test_eviction_candidates_walk_the_free_queue_from_its_head() -> None:
    pool = make_pool()
    view = VllmGpuPool(pool)
    a = run_request(pool, 2, first_hash=1)
    candidates = view.eviction_candidates()
    assert next(candidates) == (queue_ids(pool)[0], None)  # lazy: a prefix costs only the prefix
    assert list(view.eviction_candidates()) == [(b.block_id, b.block_hash)
                                                for b in pool.free_block_queue.get_all_free_blocks()]
    assert list(view.eviction_candidates())[-2:] == [(a[1], key(2)), (a[0], key(1))]
    assert 0 not in [i for i, _ in view.eviction_candidates()]


def test_frontier_reads_the_first_blocks_of_the_free_queue_as_two_lists() -> None:
    pool = make_pool()
    view = VllmGpuPool(pool)
    run_request(pool, 2, first_hash=1)
    walk = list(view.eviction_candidates())
    assert view.frontier(3) == ([i for i, _ in walk[:3]], [k for _, k in walk[:3]])
    assert view.frontier(len(walk) + 5) == ([i for i, _ in walk], [k for _, k in walk])  # a shorter queue
    assert view.frontier(0) == ([], [])


def public_frontier(pool: BlockPool, num: int) -> tuple[list[int], list]:
    blocks = pool.free_block_queue.get_all_free_blocks()[:num]
    return [b.block_id for b in blocks], [b.block_hash for b in blocks]


def test_frontier_walks_the_free_list_links_and_reads_what_the_public_walk_reads() -> None:
    """`compat.free_queue_reader` walks the free list's links on the installed vLLM (its fast path), and
    reads the same ids and hashes as vLLM's public accessors after allocations, cache hits, frees, front
    frees and moves; the public fallback (a queue without those links) reads the same."""
    rng = random.Random(7)
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    view = VllmGpuPool(pool)
    assert free_queue_reader(pool).__name__ == "read_links"
    public = free_queue_reader(ContractOnly(pool, "BlockPool"))
    assert public.__name__ == "read_public"
    held: list[int] = []
    next_hash = 1
    for _ in range(300):
        op = rng.randrange(5)
        if op == 0 and pool.get_num_free_blocks() > 8:
            n = rng.randint(1, 6)
            blocks = pool.get_new_blocks(n)
            request = SimpleNamespace(block_hashes=[h.to_bytes(32, "big") for h in range(next_hash, next_hash + n)])
            pool.cache_full_blocks(request, blocks, 0, rng.randint(0, n), BS, 0)
            next_hash += n
            held += [b.block_id for b in blocks]
        elif op == 1 and held:
            rng.shuffle(held)
            n = rng.randint(1, len(held))
            pool.free_blocks([pool.blocks[i] for i in held[:n]])  # the engine's free: hashed blocks to the tail
            del held[:n]
        elif op == 2:
            free = public_frontier(pool, 64)[0]
            if free:
                picked = rng.sample(free, rng.randint(1, min(4, len(free))))
                view.touch(picked)
                held += picked
        elif op == 3 and held:
            n = rng.randint(1, len(held))
            view.free(held[:n], front=True)
            del held[:n]
        elif held:  # our free behind a free block (the free-list links written by compat)
            free = public_frontier(pool, 64)[0]
            if free:
                n = rng.randint(1, len(held))
                view.free(held[:n], after=rng.choice(free))
                del held[:n]
        num = rng.randint(0, 70)
        assert view.frontier(num) == public_frontier(pool, num) == public(num)
        free = public_frontier(pool, 64)[0]
        if free:
            after = rng.choice(free)
            walk = pool.free_block_queue.iter_blocks_after(pool.blocks[after])
            expected = [b.block_id for b, _ in zip(walk, range(num), strict=False)]
            assert view.frontier(num, after)[0] == expected == public(num, pool.blocks[after])[0]
        check_pool(pool)


# ---------------------------------------------------------------- misuse changes nothing
@pytest.mark.parametrize("call", [
    lambda view: view.touch([0]),
    lambda view: view.free([0]),
    lambda view: view.touch([2, NUM_BLOCKS]),
    lambda view: view.free([2, -1], front=True),
    lambda view: view.free([3]),  # never touched: ref_cnt 0
    lambda view: view.free([2, 3], front=True),  # 2 is ours, 3 is not
    lambda view: view.free([2, 2]),  # one reference, two frees
    lambda view: view.free([2], after=2),  # behind a block that is not free
    lambda view: view.frontier(3, after=2),
])
def test_misuse_is_refused_before_anything_changes(call) -> None:
    pool = make_pool()
    view = VllmGpuPool(pool)
    run_request(pool, 2)
    view.touch([2])
    before = snapshot(pool)
    with pytest.raises(GpuPoolError):
        call(view)
    assert snapshot(pool) == before
    assert pool.null_block.ref_cnt == 0 and 0 not in queue_ids(pool)
    check_pool(pool)


def test_unbound_view_says_so() -> None:
    with pytest.raises(GpuPoolError, match="not bound"):
        VllmGpuPool().num_free_blocks()
