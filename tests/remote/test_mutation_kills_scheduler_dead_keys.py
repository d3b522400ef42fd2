"""Dead keys (refused by the admission filter: `store: false`, a superseded branch, a closed session) in the
lazy policy, the ARC queue's refusal of a double remove, and the lookup thread's last round and shutdown:
behaviours the mutation run found no test for (docs/mutation.md). The lazy policy is driven through a
stand-in `StorePolicyView`, so that exactly one thing differs between a live key and a dead one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from helpers import lazy_under_pressure
from test_mutation_kills_scheduler_remote_lookup import StandInClient, answer, hashes

from offload_connector.hashing import with_group_id
from scheduler_side.pool.eviction.arc import ArcBlock, ArcEviction
from scheduler_side.tiers.remote.lookups import BLOCKS_PER_ROUND, RemoteLookups

BS = 4


class View:
    """A `StorePolicyView` over a hand-made GPU frontier: (gpu id, key) pairs, some keys dead, none saved."""

    def __init__(self, frontier: list[tuple[int, bytes]], dead: set[bytes], cpu_free: int = 100) -> None:
        self.block_size, self.group_id = BS, 0
        self.max_blocks_per_step, self.lazy_lookahead_blocks, self.num_gpu_blocks = None, 8, 100
        self.frontier, self.dead, self.cpu_free = frontier, dead, cpu_free

    def is_saved(self, key: bytes) -> bool:
        return False

    def saved_key_maps(self):
        return frozenset(), frozenset()  # (read with `in` only)

    def is_dead(self, key: bytes) -> bool:
        return key in self.dead

    def may_have_dead(self) -> bool:
        return True

    def is_store_outstanding(self, event_id: int) -> bool:
        return False

    def cpu_num_free_blocks(self) -> int:
        return self.cpu_free

    def gpu_num_free_blocks(self) -> int:
        return len(self.frontier)

    def gpu_eviction_candidates(self):
        return iter(self.frontier)

    def gpu_frontier(self, num: int):
        head = self.frontier[:num]
        return [gpu_id for gpu_id, _ in head], [key for _, key in head]


def keys(n: int) -> list[bytes]:
    return [with_group_id(bytes([i]) * 16) for i in range(n)]


def test_the_frontier_scan_skips_dead_keys() -> None:
    k = keys(3)
    policy = lazy_under_pressure(View([(1, k[0]), (2, k[1]), (3, k[2])], dead={k[1]}))
    picks = policy.pick_stores()
    assert picks.keys == [k[0], k[2]] and picks.gpu_ids == [1, 3]


def request_state(block_keys_hashes: list[bytes], gpu_ids: list[int]):
    request = SimpleNamespace(request_id="r", block_hashes=block_keys_hashes, num_tokens=len(gpu_ids) * BS)
    return SimpleNamespace(request=request, gpu_block_ids=gpu_ids, num_computed_tokens=len(gpu_ids) * BS,
                           request_id="r")


def test_a_finishing_request_holds_no_dead_block() -> None:
    raw = [bytes([i]) * 16 for i in range(3)]
    dead = {with_group_id(raw[1])}
    policy = lazy_under_pressure(View([], dead=dead))  # no free GPU block: under the lookahead, holds
    held = policy.on_request_finished(request_state(raw, [5, 6, 7]))
    assert held == [5, 7]


def test_a_held_block_that_died_meanwhile_is_released_not_stored() -> None:
    raw = [bytes([i]) * 16 for i in range(2)]
    view = View([], dead=set())
    policy = lazy_under_pressure(view)
    assert policy.on_request_finished(request_state(raw, [5, 6])) == [5, 6]
    view.dead.add(with_group_id(raw[0]))  # e.g. its session closed before the next metadata
    picks = policy.pick_stores()
    assert picks.gpu_ids == [6] and sorted(picks.release_gpu_ids) == [5, 6]


def test_dead_blocks_an_admission_would_evict_do_not_defer_it() -> None:
    """Deferring a request one step is worth it only to save blocks worth keeping: unsaved but dead
    frontier blocks are not a reason."""
    k = keys(2)
    policy = lazy_under_pressure(View([(1, k[0]), (2, k[1])], dead=set(k)))
    state = SimpleNamespace(num_deferrals=0, num_gpu_hit_blocks=0, request_id="R",
                            request=SimpleNamespace(num_tokens=2 * BS))
    assert policy.may_admit(state, 0) is True
    live = lazy_under_pressure(View([(1, k[0]), (2, k[1])], dead=set()))
    assert live.may_admit(state, 0) is False  # the same frontier, alive: defer once and save it


def test_the_arc_queue_refuses_to_remove_a_held_block() -> None:
    blocks = [ArcBlock(i) for i in range(1, 4)]
    queue = ArcEviction(blocks)
    queue.remove(blocks[0])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])


def test_a_question_answered_in_full_takes_no_extra_round() -> None:
    client = StandInClient()
    lookups = RemoteLookups(client, "ns", world_size=1)
    try:
        assert answer(lookups, lookups.submit(hashes(1, BLOCKS_PER_ROUND), 0)) == BLOCKS_PER_ROUND
        assert [len(call) for call in client.calls] == [1]
    finally:
        lookups.close()


def test_a_question_cancelled_during_its_round_leaves_nothing_behind() -> None:
    client = StandInClient()
    lookups = RemoteLookups(client, "ns", world_size=1)
    try:
        client.gate.clear()
        ticket = lookups.submit(hashes(2, 2), 0)
        assert client.entered.wait(30)
        lookups.cancel(ticket)  # no answer yet: remembered as cancelled until the round files it
        client.gate.set()
        assert answer(lookups, lookups.submit(hashes(3, 1), 0)) == 1  # that round is over
        assert lookups.take(ticket) is None and not lookups._cancelled and not lookups._answers
    finally:
        lookups.close()


def test_close_returns_while_the_server_does_not_answer() -> None:
    """A stalled server (the thread stuck in a round trip) must not hang the engine's shutdown."""
    client = StandInClient()
    client.gate.clear()
    client.gate_timeout = None  # stalled until the test lets it go
    lookups = RemoteLookups(client, "ns", world_size=1)
    lookups.submit(hashes(4, 1), 0)
    assert client.entered.wait(30)
    closer = threading.Thread(target=lookups.close)
    closer.start()
    closer.join(60)  # a hang detector, not a speed bound: close() waits at most 5 s for the thread
    stuck = closer.is_alive()
    client.gate.set()  # let the thread go, whatever happened
    closer.join()
    assert not stuck
