"""The admission filter, session closes and hints: behaviours no test pinned until mutation testing
(docs/mutation.md) showed the gap. One behaviour per test; the filter's keys are chained as in
test_admission.py (key i names the whole prefix up to block i)."""

from __future__ import annotations

import pytest

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import small_config
from scheduler_side import BlockPool
from scheduler_side.admission.filter import AdmissionFilter
from scheduler_side.admission.hints import RequestHints, parse_hints, session_params


def k(*path: int) -> list[bytes]:
    """Chained keys of a request whose blocks are `path`."""
    return [bytes(str(path[:i + 1]), "ascii") for i in range(len(path))]


# ---- admit_request ---------------------------------------------------------------------------------------
def test_store_false_without_first_new_makes_every_new_key_dead() -> None:
    """`first_new` defaults to 0: a `store: false` request whose blocks are all new stores none of them."""
    f = AdmissionFilter(100)
    keys = k(1, 2, 3)
    assert f.admit_request(keys, session="s", store=False) == []
    assert [f.is_dead(key) for key in keys] == [True, True, True]


def test_store_false_keeps_the_first_computed_block_dead_when_it_was_dead() -> None:
    """With `store: false`, a dead key before `first_new` (a block the request hit) revives, and the dead
    key at `first_new` (the first block it computes) stays dead."""
    f = AdmissionFilter(100)
    keys = k(1, 2, 3)
    f.admit_request(keys, store=False)  # all dead
    f.admit_request(keys, store=False, first_new=1)
    assert [f.is_dead(key) for key in keys] == [False, True, True]
    assert f.num_revived == 1


def test_revivals_are_counted_one_per_key() -> None:
    """`num_revived` counts every dead key requested again, across calls."""
    f = AdmissionFilter(100)
    f.admit_request(k(1, 2, 3))
    f.admit_request(k(1, 4))  # 2 and 3 die
    f.admit_request(k(1, 2))  # 2 revives
    assert f.num_revived == 1
    f.admit_request(k(1, 2, 3))  # 3 revives
    assert f.num_revived == 2 and not f.is_dead(k(1, 2, 3)[-1])


def test_output_blocks_admitted_from_start_1_hang_below_their_parent() -> None:
    """The connector admits a finished request's output as [parent, new...] with start=1: the first output
    block is linked below the parent, so the next turn that extends the parent supersedes it."""
    f = AdmissionFilter(100)
    f.admit_request(k(1, 2))
    out = k(1, 2, 7)
    assert f.admit_request(out[1:], start=1, extends=False) == []
    assert f.children_of(out[1]) == [out[2]]
    assert f.admit_request(k(1, 2, 8)) == [out[2]]


def test_a_key_whose_parent_was_forgotten_is_linked_again_when_the_parent_returns() -> None:
    """A parent forgotten over capacity and requested again gets its old child back: extending the parent
    with a new child then supersedes that old child's subtree."""
    f = AdmissionFilter(3)
    a = k(1, 2, 3)
    f.admit_request(a)
    f.admit_request(k(5))  # 4 keys > 3: key 1 is forgotten, 2 loses its parent
    assert f.children_of(a[0]) == [] and len(f) == 3
    f.admit_request(a)  # 1 is new again, 2 is known: linked below it (5 is forgotten now)
    assert f.children_of(a[0]) == [a[1]]
    f.check_integrity()
    assert f.admit_request(k(1, 9)) == a[1:]  # 1 had exactly one child: 2 and 3 die


def test_the_parent_of_the_first_admitted_key_may_be_forgotten() -> None:
    """Only the keys a request uses (`keys[start:]`) are kept over capacity, not the parent before them."""
    f = AdmissionFilter(2)
    f.admit_request(k(1, 2))  # 1 is the oldest
    out = k(1, 3)
    f.admit_request(out, start=1, extends=False)  # uses 3 only; 1 is its parent
    assert len(f) == 2 and f.children_of(out[0]) == []
    f.check_integrity()


# ---- counters ----------------------------------------------------------------------------------------------
def test_superseded_keys_are_counted_one_per_key() -> None:
    """`num_superseded` counts each key killed as a superseded branch, across calls."""
    f = AdmissionFilter(100)
    f.admit_request(k(1, 2, 3, 4))
    assert len(f.admit_request(k(1, 5))) == 3
    assert f.num_superseded == 3
    f.admit_request(k(1, 5, 6))
    assert len(f.admit_request(k(1, 5, 7))) == 1
    assert f.num_superseded == 4


def test_session_close_kills_are_counted_across_sessions() -> None:
    """`num_session_closed` counts the keys each close killed, summed over closes."""
    f = AdmissionFilter(100, branch_filter=False)
    f.admit_request(k(1, 2), session="a")
    f.admit_request(k(5, 6, 7), session="b")
    assert len(f.close_session("a")) == 2 and f.num_session_closed == 2
    assert len(f.close_session("b")) == 3 and f.num_session_closed == 5


# ---- sessions ----------------------------------------------------------------------------------------------
def test_session_keys_lists_the_keys_only_that_session_used() -> None:
    """`session_keys`: the keys one session used alone, oldest first; [] for an unknown session."""
    f = AdmissionFilter(100, branch_filter=False)
    f.admit_request(k(1, 2), session="a")
    f.admit_request(k(1, 3), session="b")  # 1 is shared now
    assert f.session_keys("a") == [k(1, 2)[1]]
    assert f.session_keys("b") == [k(1, 3)[1]]
    assert f.session_keys("nobody") == []


def test_a_session_key_forgotten_over_capacity_leaves_its_session() -> None:
    """A forgotten key no longer belongs to its session: closing the session kills only the keys still
    known (and does not fail on the forgotten one)."""
    f = AdmissionFilter(3, branch_filter=False)
    f.admit_request(k(1, 2), session="a")
    f.admit_request(k(5, 6), session="b")  # 4 keys > 3: a's key 1 is forgotten
    assert f.session_keys("a") == [k(1, 2)[1]]
    f.check_integrity()
    assert f.close_session("a") == [k(1, 2)[1]]


# ---- check_integrity (a test oracle: it must see each broken invariant) -------------------------------
def two_sessions() -> AdmissionFilter:
    f = AdmissionFilter(100, branch_filter=False)
    f.admit_request(k(1, 2), session="a")
    f.admit_request(k(1, 3), session="b")
    f.check_integrity()
    return f


def test_check_integrity_sees_a_child_that_lost_its_parent_link() -> None:
    """A child listed under a parent whose `parent` points elsewhere is a broken child link."""
    f = two_sessions()
    f._nodes[k(1, 2)[1]].parent = None  # noqa: SLF001
    with pytest.raises(RuntimeError, match="child link"):
        f.check_integrity()


def test_check_integrity_sees_a_key_missing_from_its_session() -> None:
    """A key owned by a session that does not list it (here: no such session) is reported as such."""
    f = two_sessions()
    f._nodes[k(1, 2)[1]].owner = "ghost"  # noqa: SLF001
    with pytest.raises(RuntimeError, match="missing from its session"):
        f.check_integrity()


def test_check_integrity_sees_a_session_listing_a_shared_key() -> None:
    """A session that lists a key now owned by nobody in particular (shared) is reported."""
    f = two_sessions()
    f._nodes[k(1, 2)[1]].owner = ""  # noqa: SLF001  (SHARED; "a" still lists it)
    with pytest.raises(RuntimeError, match="does not own"):
        f.check_integrity()


# ---- the connector's session close (admission_hooks.py) and BlockPool.demote ---------------------------------
def run(engine: FakeEngine, request_id: str, prompt: list[int], params: dict | None = None) -> None:
    engine.add_request(request_id, prompt, 2, params)
    engine.run()
    engine.drain()


def test_closing_sessions_returns_and_counts_the_demoted_copies() -> None:
    """`close_session` returns how many CPU copies it moved to the eviction end; the stats sum the moved
    copies and the closes over several sessions."""
    with FakeEngine(small_config(num_gpu_blocks=40, num_cpu_blocks=64)) as engine:
        # 1. session a stores 4 blocks, session b 3
        run(engine, "a1", list(range(100, 116)), session_params("a"))
        run(engine, "b1", list(range(300, 312)), session_params("b"))
        sched = engine.connector
        # 2. each close moves exactly its own copies
        assert sched.close_session("a") == 4
        assert (sched.stats.num_demoted_blocks, sched.stats.num_closed_sessions) == (4, 1)
        assert sched.close_session("b") == 3
        assert (sched.stats.num_demoted_blocks, sched.stats.num_closed_sessions) == (7, 2)
        assert engine.check() == 0


def test_demote_moves_only_a_free_block_and_says_so() -> None:
    """`demote` returns False and moves nothing for a held block; True for a free one, now evicted first."""
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


# ---- hints -------------------------------------------------------------------------------------------------
def test_session_params_with_store_false_parse_as_store_false() -> None:
    """The helper's `store=False` reaches the connector as the `store: false` hint."""
    params = session_params("s", store=False)
    assert params == {"session": "s", "store": False}
    assert parse_hints(params) == (RequestHints(store=False, session="s", close_session=False), None)
