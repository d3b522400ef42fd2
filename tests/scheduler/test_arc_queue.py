"""The CPU tier's ARC replacement (`eviction: arc`): scan resistance, ghosts and the target they move
(Megiddo & Modha's step), the history of reused keys over both tiers, pool invariants, and the scheduler
feeding it hits and misses under its KV-cache group."""

from __future__ import annotations

import random

import pytest
from helpers import FakeRequest, admit, finish, make_scheduler, report, step_done
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offload_connector.config import load_config
from offload_connector.hashing import with_group_id
from offload_connector.metadata import WorkerReport
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler, StepRequest
from scheduler_side.pool.eviction.arc import EMPTY, HELD, T1, T2, ArcBlock, ArcEviction

BS = 4


def key(i: int) -> bytes:
    return i.to_bytes(4, "little")


def store(pool: BlockPool, k: int) -> None:
    """What a store does: allocate a block, cache the key while held, release it."""
    (block,) = pool.allocate(1)
    pool.cache(block, key(k))
    pool.free([block])


def test_reused_blocks_survive_a_burst_of_blocks_used_once() -> None:
    pool = BlockPool(9, eviction="arc")  # 8 usable blocks
    for k in range(4):
        store(pool, k)
        pool.note_reuse(key(k))  # a GPU or CPU hit: these move to t2
    for k in range(100, 140):  # a long scan of blocks nobody reuses
        store(pool, k)
    assert all(pool.lookup(key(k)) is not None for k in range(4))
    lru = BlockPool(9)
    for k in [*range(4), *range(100, 140)]:
        store(lru, k)
    assert all(lru.lookup(key(k)) is None for k in range(4))  # plain LRU lost them


def test_ghost_hits_move_the_target_both_ways() -> None:
    pool = BlockPool(5, eviction="arc")  # 4 usable blocks
    q = pool.free_queue
    for k in range(2):
        store(pool, k)
        pool.note_reuse(key(k))
    for k in range(10, 16):
        store(pool, k)  # t1 overflows: its oldest keys become ghosts in b1
    assert q.p == 0 and key(10) in q.b1 and pool.lookup(key(10)) is None
    pool.note_miss(key(10))  # a request wanted a seen-once block we dropped: give t1 more room
    assert q.p >= 1 and key(10) not in q.b1 and key(10) in q.recent
    store(pool, 10)  # stored again, now as reused
    assert pool.lookup(key(10)).seg in (T2, HELD)
    before = q.p
    for k in range(20, 40):
        store(pool, k)
        pool.note_reuse(key(k))  # reused blocks crowd out t2's old ones into b2
    ghost = next(iter(q.b2))
    pool.note_miss(ghost)
    assert q.p < before or q.p == 0


def test_only_the_first_miss_of_a_lookup_adapts() -> None:
    pool = BlockPool(3, eviction="arc")
    q = pool.free_queue
    for k in range(5):
        store(pool, k)
    assert list(q.b1) == [key(1), key(2)]  # at most `capacity` ghosts: key 0 is forgotten
    pool.note_miss(key(1), adapt=False)
    assert q.p == 0 and key(1) in q.recent and key(1) not in q.b1
    pool.note_miss(key(0))  # no ghost: nothing to learn
    assert q.p == 0 and key(0) not in q.recent


def test_uncached_blocks_are_taken_before_cached_ones() -> None:
    pool = BlockPool(4, eviction="arc")
    store(pool, 1)
    store(pool, 2)
    (block,) = pool.allocate(1)
    pool.free([block])  # never cached: an empty block
    assert block.seg == EMPTY
    (again,) = pool.allocate(1)
    assert again is block and pool.lookup(key(1)) is not None and pool.lookup(key(2)) is not None


def test_discard_and_uncache_move_a_free_block_to_the_empty_list() -> None:
    pool = BlockPool(4, eviction="arc")
    store(pool, 1)
    block = pool.lookup(key(1))
    assert block.seg == T1
    pool.note_reuse(key(1))
    assert block.seg == T2
    assert pool.discard(block) and block.seg == EMPTY and block.block_hash is None and not block.reused
    pool.check_integrity()


def arc_with_ghosts(num_blocks: int, reused: list[int]) -> tuple[BlockPool, list[bytes]]:
    """An ARC pool of `num_blocks` usable blocks that stored keys 0..num_blocks-1 (those in `reused` hit
    again), then had every block taken: seen-once keys are `b1` ghosts, reused ones `b2` ghosts."""
    pool = BlockPool(num_blocks + 1, eviction="arc")
    keys = [b"key%d" % k for k in range(num_blocks)]
    for k in keys:
        (block,) = pool.allocate(1)
        pool.cache(block, k)
        pool.free([block])
    for k in reused:
        pool.note_reuse(keys[k])
    pool.allocate(num_blocks)
    return pool, keys


def test_arc_moves_its_target_by_the_ratio_of_the_ghost_lists_at_least_one():
    """Megiddo & Modha: a hit on a seen-once ghost raises p by max(1, |b2| / |b1|), a hit on a reused ghost
    lowers it by max(1, |b1| / |b2|) (list sizes after the hit ghost left, at least 1), never below 0.

    Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
    pool, keys = arc_with_ghosts(5, reused=[2, 3, 4])  # b1: 0 1, b2: 2 3 4
    q = pool.free_queue
    pool.note_miss(keys[0])
    assert q.p == 3.0  # |b2| 3 / |b1| 1
    pool.note_miss(keys[2])
    assert q.p == 2.0  # max(1, |b1| 1 / |b2| 2)
    pool, keys = arc_with_ghosts(5, reused=[3, 4])  # b1: 0 1 2, b2: 3 4
    pool.note_miss(keys[0])
    assert pool.free_queue.p == 1.0  # max(1, 2 / 2)
    pool, keys = arc_with_ghosts(6, reused=[5])  # b1: 0..4, b2: 5
    for k in (0, 1, 2):
        pool.note_miss(keys[k])
    assert pool.free_queue.p == 3.0
    pool.note_miss(keys[5])
    assert pool.free_queue.p == 1.0  # |b1| 2 / max(1, |b2| 0)


def test_arc_keeps_no_more_ghosts_than_it_has_blocks_and_drops_a_ghost_stored_again():
    """Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
    pool = BlockPool(2, eviction="arc")  # one usable block
    for k in (b"a", b"b"):
        (block,) = pool.allocate(1)  # evicts the previous key
        pool.cache(block, k)
        pool.free([block])
    pool.allocate(1)
    q = pool.free_queue
    assert list(q.b1) == [b"b"]  # a's ghost made room for b's
    pool = BlockPool(4, eviction="arc")
    (block,) = pool.allocate(1)
    pool.cache(block, b"k")
    pool.free([block])
    taken = pool.allocate(3)  # k is evicted: a ghost
    assert b"k" in pool.free_queue.b1
    pool.free(taken[:1])
    (again,) = pool.allocate(1)
    pool.reserve([again], [b"k"])
    pool.commit([again])  # stored again: no longer a ghost, and no adaptation
    assert b"k" not in pool.free_queue.b1 and pool.free_queue.p == 0.0


def test_storing_a_key_again_drops_its_ghost_among_the_reused() -> None:
    """A reused key evicted from the CPU leaves a ghost in `b2`; stored again, it is on the CPU and no
    longer a ghost (a key is on the CPU or a ghost, never both: a stale ghost would skew ARC's target).

    Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
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


def test_arc_remembers_exactly_its_history_of_reused_keys_newest_first():
    """Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
    def seg_when_stored(pool: BlockPool, key: bytes) -> int:
        (block,) = pool.allocate(1)
        pool.reserve([block], [key])
        pool.commit([block])
        pool.free([block])
        return block.seg

    for reuses, first_remembered in ((8, True), (9, False)):
        pool = BlockPool(6, eviction="arc", history=8)
        for k in range(reuses):
            pool.note_reuse(b"key%d" % k)
        assert seg_when_stored(pool, b"key0") == (T2 if first_remembered else T1)
        assert seg_when_stored(pool, b"key%d" % (reuses - 1)) == T2  # the newest is always remembered


def test_arc_files_a_committed_store_of_a_recently_reused_key_as_reused():
    """Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
    pool = BlockPool(6, eviction="arc")
    pool.note_reuse(b"hot")  # a GPU hit: the key is reused, its block is not on the CPU
    blocks = pool.allocate(2)
    pool.reserve(blocks, [b"hot", b"cold"])
    assert pool.commit(blocks) == [b"hot", b"cold"]
    pool.free(blocks)
    assert (blocks[0].seg, blocks[1].seg) == (T2, T1)


def test_caching_a_free_block_files_it_as_seen_once():
    """Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
    pool = BlockPool(4, eviction="arc")
    block = pool.blocks[2]
    assert block.seg == EMPTY
    assert pool.cache(block, b"k")
    assert block.seg == T1 and block in list(pool.free_queue.t1)
    pool.check_integrity()


def test_the_arc_queue_refuses_to_remove_a_held_block() -> None:
    """Found by mutation testing of scheduler_side/pool/eviction/arc.py (docs/mutation.md)."""
    blocks = [ArcBlock(i) for i in range(1, 4)]
    queue = ArcEviction(blocks)
    queue.remove(blocks[0])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])


def test_unknown_eviction_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed: lru, arc"):
        BlockPool(4, eviction="fifo")


class ArcPoolMachine(RuleBasedStateMachine):
    """Random pool traffic under ARC: ref counts, the three lists and the cache map stay consistent, and
    what is evicted is always a free block (never held, never the null block)."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[bytes] = []
        self.pool = BlockPool(7, eviction="arc", history=8,
                              on_evict=lambda k, by_alloc: by_alloc and self.evicted.append(k))
        self.held: list = []  # one entry per reference we hold
        self.next_key = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        free_before, num_evicted = self.pool.num_free_blocks, len(self.evicted)
        out = self.pool.allocate(n)
        q = self.pool.free_queue
        assert all(k in q.b1 or k in q.b2 for k in self.evicted[num_evicted:])  # evicted keys become ghosts
        if n > free_before:
            assert out is None and self.pool.num_free_blocks == free_before
            return
        assert out is not None and all(b.ref_cnt == 1 and b.block_hash is None and b.seg == HELD for b in out)
        self.held.extend(out)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), front=st.booleans())
    def free(self, data: st.DataObject, front: bool) -> None:
        block = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free([block], front=front)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), reuse=st.integers(0, 30))
    def cache(self, data: st.DataObject, reuse: int) -> None:
        block = data.draw(st.sampled_from(self.held))
        if block.block_hash is None:
            k = key(reuse if reuse < 10 else 1000 + self.next_key)
            self.next_key += 1
            self.pool.cache(block, k)

    @rule(k=st.integers(0, 40))
    def note_reuse(self, k: int) -> None:
        self.pool.note_reuse(key(k if k < 10 else 1000 + k))

    @rule(k=st.integers(0, 1100), adapt=st.booleans())
    def note_miss(self, k: int, adapt: bool) -> None:
        self.pool.note_miss(key(k), adapt)

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        block = self.pool.cached[data.draw(st.sampled_from(sorted(self.pool.cached)))]
        self.pool.touch([block])
        self.held.append(block)

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data(), discard=st.booleans())
    def forget(self, data: st.DataObject, discard: bool) -> None:
        block = self.pool.cached[data.draw(st.sampled_from(sorted(self.pool.cached)))]
        if discard:
            self.pool.discard(block)
        else:
            self.pool.uncache(block)

    @invariant()
    def consistent(self) -> None:
        pool, q = self.pool, self.pool.free_queue
        pool.check_integrity()
        assert pool.num_free_blocks + len({id(b) for b in self.held}) == pool.num_blocks - 1
        held_refs = {}
        for b in self.held:
            held_refs[b.block_id] = held_refs.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            assert b.ref_cnt == held_refs.get(b.block_id, 0)
            if b.ref_cnt:
                assert b.seg == HELD
            elif b.block_hash is None:
                assert b.seg == EMPTY
            else:
                assert b.seg == (T2 if b.reused else T1)
        assert q.empty.num_free_blocks + q.t1.num_free_blocks + q.t2.num_free_blocks == pool.num_free_blocks
        assert 0 <= q.p <= q.capacity and len(q.b1) <= q.capacity and len(q.b2) <= q.capacity
        assert len(q.recent) <= q.history
        assert not (set(q.b1) | set(q.b2)) & set(pool.cached)  # a key is on the CPU or a ghost, not both


TestArcPool = ArcPoolMachine.TestCase
TestArcPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_scheduler_feeds_arc_with_hits_and_misses() -> None:
    """Under `eviction: arc` a CPU hit files the block as reused, and a lookup that misses a key the CPU
    evicted lately (a ghost) adapts the target, through the scheduler's own lookup and allocation."""
    bs = 4
    sched, gpu = make_scheduler(num_gpu_blocks=64, num_cpu_blocks=6, block_size=bs, eviction="arc")
    pool, q = sched.cpu_pool, sched.cpu_pool.free_queue

    def complete_stores() -> None:
        sched.update_connector_output(WorkerReport(completed_store_events=sorted(sched.transfers.store_events)))

    def run(req_id: str, tokens: list[int]) -> FakeRequest:
        """Admit, load if hit, compute, store (eager), finish; our GPU pool keeps no prefix cache."""
        req = FakeRequest(req_id, tokens, bs)
        hit, _, ids = admit(sched, gpu, req)
        if hit:
            sched.build_connector_meta([])
            sched.update_connector_output(WorkerReport(finished_load_reqs=[req_id]))
        sched.build_connector_meta([StepRequest(req_id, ids, len(tokens), True)])
        complete_stores()
        sched.request_finished(req)
        gpu.free([gpu.blocks[i] for i in ids])
        return req

    def first_key(tokens: list[int]) -> bytes:
        return with_group_id(FakeRequest("k", tokens, bs).block_hashes[0])

    prefix = list(range(9))  # 2 full blocks
    run("a", prefix)
    assert pool.lookup(first_key(prefix)).seg == T1  # stored, seen once
    run("a2", prefix)  # a CPU hit on both blocks: reused now
    assert pool.lookup(first_key(prefix)).seg == T2
    others = [[1000 * (n + 1) + t for t in range(9)] for n in range(4)]
    for n, tokens in enumerate(others):  # blocks nobody reuses replace each other; the prefix stays
        run(f"x{n}", tokens)
    assert pool.lookup(first_key(prefix)) is not None
    assert first_key(others[0]) in q.b1  # evicted seen-once blocks are remembered as ghosts
    p_before = q.p
    assert sched.get_num_new_matched_tokens(FakeRequest("again", others[0], bs), 0) == (0, False)
    assert q.p > p_before and first_key(others[0]) in q.recent and first_key(others[0]) not in q.b1


def test_arc_hints_use_the_schedulers_group_id():
    """Found by mutation testing of scheduler_side/lookups.py (docs/mutation.md)."""
    group = 3
    gpu = BlockPool(64)
    sched = OffloadScheduler(load_config({"store_policy": "eager", "num_cpu_blocks": 6, "eviction": "arc"}), BS, 6, BlockPoolGpuView(gpu),
                             group_id=group)
    q = sched.cpu_pool.free_queue

    def run(req_id: str, tokens: list[int], gpu_hit_tokens: int = 0) -> None:
        req = FakeRequest(req_id, tokens, BS)
        hit, _, ids = admit(sched, gpu, req, gpu_hit_tokens)
        if hit:
            sched.build_connector_meta([])
            sched.update_connector_output(report(finished_load_reqs=[req_id]))
        meta = sched.build_connector_meta([step_done(req_id, ids, len(tokens))])
        if meta.store_event is not None:
            sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        finish(sched, gpu, req, ids)

    def key(tokens: list[int], i: int = 0) -> bytes:
        return with_group_id(FakeRequest("k", tokens, BS).block_hashes[i], group)

    prefix = list(range(9))
    run("a", prefix)
    run("a2", prefix)  # a CPU hit: reused, under the group's key
    assert sched.cpu_pool.lookup(key(prefix)).seg == T2
    others = [[1000 * (n + 1) + t for t in range(13)] for n in range(2)]  # 3 blocks each: x1 evicts x0
    for n, tokens in enumerate(others):
        run(f"x{n}", tokens)
    ghost0, ghost1 = key(others[0], 0), key(others[0], 1)
    assert ghost0 in q.b1 and ghost1 in q.b1
    # a lookup whose GPU hit covers block 0: only blocks 1.. missed on the CPU, the first of them adapts
    p_before = q.p
    req = FakeRequest("again", others[0], BS)
    assert sched.get_num_new_matched_tokens(req, BS) == (0, False)
    assert q.p > p_before
    assert ghost1 in q.recent and ghost1 not in q.b1
    assert ghost0 in q.b1 and ghost0 not in q.recent  # never looked up on the CPU
    sched.request_finished(req)


def test_arc_remembers_reused_keys_of_both_tiers():
    """ARC keeps the keys reused lately for the GPU's blocks and the CPU's: a key reused long ago (here 30
    reuses ago, more than the CPU holds) still files its block as reused when it is stored again.

    Found by mutation testing of scheduler_side/pool/block_pool.py (docs/mutation.md)."""
    sched = OffloadScheduler(load_config({"store_policy": "eager", "num_cpu_blocks": 6, "eviction": "arc"}), BS, 6,
                             BlockPoolGpuView(BlockPool(40)), num_gpu_blocks=40)
    pool = sched.cpu_pool
    for k in range(30):
        pool.note_reuse(b"key%02d" % k)
    (block,) = pool.allocate(1)
    pool.reserve([block], [b"key00"])
    pool.commit([block])
    pool.free([block])
    assert block.seg == T2


def test_arc_adapts_its_target_once_per_lookup_however_many_ghosts_it_misses():
    """Megiddo & Modha: a lookup is one reference; three missed seen-once ghosts move p one step.

    Found by mutation testing of scheduler_side/lookups.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(num_gpu_blocks=64, num_cpu_blocks=7, eviction="arc")

    def run(req_id: str, tokens: list[int]) -> None:
        req = FakeRequest(req_id, tokens, BS)
        _, _, ids = admit(sched, gpu, req)
        meta = sched.build_connector_meta([step_done(req_id, ids, len(tokens))])
        sched.update_connector_output(report(completed_store_events=[meta.store_event]))
        assert sched.request_finished(req) == (False, None)
        gpu.free([gpu.blocks[i] for i in reversed(ids)])

    first, second = list(range(13)), [1000 + t for t in range(25)]  # 3 blocks, then 6 evicting them
    run("a", first)
    run("b", second)
    q = sched.cpu_pool.free_queue
    ghosts = [with_group_id(h, 0) for h in FakeRequest("k", first, BS).block_hashes]
    assert all(g in q.b1 for g in ghosts)
    p_before, b1, b2 = q.p, len(q.b1), len(q.b2)
    again = FakeRequest("again", first, BS)
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
    assert q.p == min(6.0, p_before + max(1.0, b2 / max(1, b1 - 1)))
    assert not any(g in q.b1 for g in ghosts)  # all three were noted as reused
    sched.request_finished(again)


@pytest.mark.parametrize("seed", range(40))
def test_batched_allocation_takes_what_one_at_a_time_would(seed: int) -> None:
    """ARC's batched `popleft_n` takes what n calls of `popleft` would, under the same traffic: same
    blocks, same ghosts, same target, at every step."""
    rng = random.Random(seed)
    batched, single = (BlockPool(13, eviction="arc", history=16) for _ in range(2))
    q = single.free_queue
    q.popleft_n = lambda n: [q.popleft() for _ in range(n)]  # the reference: one `popleft` at a time
    next_key = 100
    for _ in range(400):
        op = rng.random()
        if op < 0.5:  # a store of n new blocks; some keys come back later
            n = rng.randint(1, 12)
            keys = [key(rng.randrange(40) if rng.random() < 0.5 else next_key + i) for i in range(n)]
            next_key += n
            got = batched.allocate(n)
            want = single.allocate(n)
            assert (None if got is None else [b.block_id for b in got]) == (
                None if want is None else [b.block_id for b in want])
            for pool, blocks in ((batched, got), (single, want)):
                for block, k in zip(blocks or [], keys, strict=False):
                    pool.cache(block, k)
                pool.free(blocks or [])
        elif op < 0.75:
            k = key(rng.randrange(40))
            batched.note_reuse(k)
            single.note_reuse(k)
        else:
            ghosts = list(batched.free_queue.b1) + list(batched.free_queue.b2)
            k = rng.choice(ghosts) if ghosts and rng.random() < 0.8 else key(rng.randrange(200))
            batched.note_miss(k)
            single.note_miss(k)
        qb, qs = batched.free_queue, single.free_queue
        assert (list(qb.b1), list(qb.b2), qb.p) == (list(qs.b1), list(qs.b2), qs.p)
        assert [b.block_id for b in qb] == [b.block_id for b in qs]
