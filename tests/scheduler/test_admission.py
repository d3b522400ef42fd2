"""The admission filter (scheduler_side/admission/filter.py): superseded branches, sessions, `store: false`,
its capacity, its counters and its integrity check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_side.admission.filter import AdmissionFilter


def k(*path: int) -> list[bytes]:
    """Chained keys of a request whose blocks are `path` (key i names the whole prefix up to block i)."""
    return [bytes(str(path[:i + 1]), "ascii") for i in range(len(path))]


def test_a_new_child_of_a_single_child_key_kills_the_old_subtree() -> None:
    f = AdmissionFilter(1000)
    # 1. turn one: A B C D
    assert f.admit_request(k(1, 2, 3, 4)) == []
    # 2. turn two extends B with E: B had one child (C), so C and D die
    died = f.admit_request(k(1, 2, 5))
    assert died == k(1, 2, 3, 4)[2:]
    assert all(f.is_dead(x) for x in k(1, 2, 3, 4)[2:]) and not any(f.is_dead(x) for x in k(1, 2, 5))
    # 3. B has two children now: a third kills nothing
    assert f.admit_request(k(1, 2, 6)) == []
    assert not f.is_dead(k(1, 2, 5)[-1])


def test_a_key_with_two_children_is_never_killed_nor_what_is_below_it() -> None:
    f = AdmissionFilter(1000)
    # 1. a shared prefix S (under P) with two branches X and Y (Y supersedes X: X dies)
    f.admit_request(k(1, 2, 3))
    assert f.admit_request(k(1, 2, 4)) == [k(1, 2, 3)[-1]]
    assert sorted(f.children_of(k(1, 2)[-1])) == sorted([k(1, 2, 3)[-1], k(1, 2, 4)[-1]])
    # 2. P gets a second child: P's old child S has two children, so nothing dies
    assert f.admit_request(k(1, 9)) == []
    assert not any(f.is_dead(x) for x in k(1, 2, 4))


def test_a_dead_key_requested_again_is_live() -> None:
    f = AdmissionFilter(1000)
    f.admit_request(k(1, 2, 3))
    f.admit_request(k(1, 4))
    assert f.is_dead(k(1, 2)[-1]) and f.is_dead(k(1, 2, 3)[-1])
    # requested again: its whole prompt is live again
    assert f.admit_request(k(1, 2)) == []
    assert not f.is_dead(k(1, 2)[-1])
    assert f.num_revived == 1
    assert f.is_dead(k(1, 2, 3)[-1])  # not requested: still dead


def test_off_switch_kills_nothing() -> None:
    f = AdmissionFilter(1000, branch_filter=False)
    f.admit_request(k(1, 2, 3))
    assert f.admit_request(k(1, 4)) == [] and not f.is_dead(k(1, 2)[-1])


def test_output_blocks_join_without_superseding() -> None:
    f = AdmissionFilter(1000)
    f.admit_request(k(1, 2))
    f.admit_request(k(1, 3))  # 2 dies
    # the request [1, 3] finishes with an output block 7 (extends=False): nothing dies
    keys = k(1, 3, 7)
    assert f.admit_request(keys, start=2, extends=False) == []
    assert f.children_of(keys[1]) == [keys[2]]
    # the next turn extends 3 with 8: 3 had exactly one child (the output block 7), which dies
    assert f.admit_request(k(1, 3, 8)) == [keys[2]]


def test_capacity_forgets_the_oldest_keys() -> None:
    f = AdmissionFilter(4)
    f.admit_request(k(1, 2, 3))
    f.admit_request(k(5, 6, 7))
    assert len(f) == 4
    f.check_integrity()
    assert f.children_of(k(1, 2)[-1]) == [] and not f.is_dead(k(1)[0])  # the two oldest keys are forgotten
    f.admit_request(k(5, 6, 7, 8, 9, 10))  # longer than the capacity: kept whole until the next one
    f.check_integrity()


# --- property test: random prefix trees -------------------------------------------------------

paths = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(paths, st.integers(3, 60), st.booleans())
def test_random_requests_keep_the_filter_rules(requests: list[list[int]], capacity: int, outputs: bool) -> None:
    """After every request: its keys are live; nothing that died had two or more children (before the
    call) or sat below such a key; a dead key requested again is live; the tree's links are consistent."""
    f = AdmissionFilter(capacity)
    for path in requests:
        keys = k(*path)
        before = {key: list(f.children_of(key)) for key in list(f._nodes)}  # noqa: SLF001
        died = f.admit_request(keys)
        for key in died:
            assert len(before.get(key, [])) < 2, "a key with two or more children was killed"
        assert not any(f.is_dead(key) for key in keys), "a requested key stayed dead"
        # nothing killed sits below a key with 2+ children (walk up through the dead keys' parents)
        for key in died:
            dead = f._nodes.get(key)  # noqa: SLF001
            node = dead.parent if dead is not None else None  # (None: forgotten since, over capacity)
            while node is not None and node.dead:
                assert len(before.get(node.key, [])) < 2
                node = node.parent
        if outputs:  # the request finishes with one output block
            out = k(*path, 7)
            f.admit_request(out, start=len(keys), extends=False)
        f.check_integrity()
        assert len(f) <= max(capacity, len(keys) + 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", None]), st.lists(st.integers(0, 3), min_size=1,
                                                                       max_size=5)), min_size=1, max_size=30),
       st.sampled_from(["a", "b"]))
def test_closing_a_session_kills_exactly_the_keys_only_it_used(uses: list, closed: str) -> None:
    f = AdmissionFilter(10_000, branch_filter=False)
    users: dict[bytes, set] = {}
    for session, path in uses:
        for key in k(*path):
            users.setdefault(key, set()).add(session)
        f.admit_request(k(*path), session=session)
        f.check_integrity()
    died = f.close_session(closed)
    assert sorted(died) == sorted(key for key, who in users.items() if who == {closed})
    assert all(f.is_dead(key) for key in died)
    f.check_integrity()
    # requested again (by anyone): live
    if died:
        f.admit_request([died[0]], session="c")
        assert not f.is_dead(died[0])


# ---- admit_request ---------------------------------------------------------------------------------------
def test_store_false_without_first_new_makes_every_new_key_dead() -> None:
    """`first_new` defaults to 0: a `store: false` request whose blocks are all new stores none of them.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100)
    keys = k(1, 2, 3)
    assert f.admit_request(keys, session="s", store=False) == []
    assert [f.is_dead(key) for key in keys] == [True, True, True]


def test_store_false_keeps_the_first_computed_block_dead_when_it_was_dead() -> None:
    """With `store: false`, a dead key before `first_new` (a block the request hit) revives, and the dead
    key at `first_new` (the first block it computes) stays dead.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100)
    keys = k(1, 2, 3)
    f.admit_request(keys, store=False)  # all dead
    f.admit_request(keys, store=False, first_new=1)
    assert [f.is_dead(key) for key in keys] == [False, True, True]
    assert f.num_revived == 1


def test_output_blocks_admitted_from_start_1_hang_below_their_parent() -> None:
    """The connector admits a finished request's output as [parent, new...] with start=1: the first output
    block is linked below the parent, so the next turn that extends the parent supersedes it.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100)
    f.admit_request(k(1, 2))
    out = k(1, 2, 7)
    assert f.admit_request(out[1:], start=1, extends=False) == []
    assert f.children_of(out[1]) == [out[2]]
    assert f.admit_request(k(1, 2, 8)) == [out[2]]


def test_a_key_whose_parent_was_forgotten_is_linked_again_when_the_parent_returns() -> None:
    """A parent forgotten over capacity and requested again gets its old child back: extending the parent
    with a new child then supersedes that old child's subtree.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
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
    """Only the keys a request uses (`keys[start:]`) are kept over capacity, not the parent before them.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(2)
    f.admit_request(k(1, 2))  # 1 is the oldest
    out = k(1, 3)
    f.admit_request(out, start=1, extends=False)  # uses 3 only; 1 is its parent
    assert len(f) == 2 and f.children_of(out[0]) == []
    f.check_integrity()


def test_an_admission_filter_of_capacity_one_remembers_one_key() -> None:
    """Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    with pytest.raises(ValueError, match=">= 1"):
        AdmissionFilter(0)
    f = AdmissionFilter(1)
    assert f.admit_request([b"a"]) == [] and f.capacity == 1


# ---- counters ----------------------------------------------------------------------------------------------
def test_revivals_are_counted_one_per_key() -> None:
    """`num_revived` counts every dead key requested again, across calls.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100)
    f.admit_request(k(1, 2, 3))
    f.admit_request(k(1, 4))  # 2 and 3 die
    f.admit_request(k(1, 2))  # 2 revives
    assert f.num_revived == 1
    f.admit_request(k(1, 2, 3))  # 3 revives
    assert f.num_revived == 2 and not f.is_dead(k(1, 2, 3)[-1])


def test_superseded_keys_are_counted_one_per_key() -> None:
    """`num_superseded` counts each key killed as a superseded branch, across calls.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100)
    f.admit_request(k(1, 2, 3, 4))
    assert len(f.admit_request(k(1, 5))) == 3
    assert f.num_superseded == 3
    f.admit_request(k(1, 5, 6))
    assert len(f.admit_request(k(1, 5, 7))) == 1
    assert f.num_superseded == 4


def test_session_close_kills_are_counted_across_sessions() -> None:
    """`num_session_closed` counts the keys each close killed, summed over closes.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100, branch_filter=False)
    f.admit_request(k(1, 2), session="a")
    f.admit_request(k(5, 6, 7), session="b")
    assert len(f.close_session("a")) == 2 and f.num_session_closed == 2
    assert len(f.close_session("b")) == 3 and f.num_session_closed == 5


# ---- sessions ----------------------------------------------------------------------------------------------
def test_session_keys_lists_the_keys_only_that_session_used() -> None:
    """`session_keys`: the keys one session used alone, oldest first; [] for an unknown session.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = AdmissionFilter(100, branch_filter=False)
    f.admit_request(k(1, 2), session="a")
    f.admit_request(k(1, 3), session="b")  # 1 is shared now
    assert f.session_keys("a") == [k(1, 2)[1]]
    assert f.session_keys("b") == [k(1, 3)[1]]
    assert f.session_keys("nobody") == []


def test_a_session_key_forgotten_over_capacity_leaves_its_session() -> None:
    """A forgotten key no longer belongs to its session: closing the session kills only the keys still
    known (and does not fail on the forgotten one).

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
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
    """A child listed under a parent whose `parent` points elsewhere is a broken child link.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = two_sessions()
    f._nodes[k(1, 2)[1]].parent = None  # noqa: SLF001
    with pytest.raises(RuntimeError, match="child link"):
        f.check_integrity()


def test_check_integrity_sees_a_key_missing_from_its_session() -> None:
    """A key owned by a session that does not list it (here: no such session) is reported as such.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = two_sessions()
    f._nodes[k(1, 2)[1]].owner = "ghost"  # noqa: SLF001
    with pytest.raises(RuntimeError, match="missing from its session"):
        f.check_integrity()


def test_check_integrity_sees_a_session_listing_a_shared_key() -> None:
    """A session that lists a key now owned by nobody in particular (shared) is reported.

    Found by mutation testing of scheduler_side/admission/filter.py (docs/mutation.md)."""
    f = two_sessions()
    f._nodes[k(1, 2)[1]].owner = ""  # noqa: SLF001  (SHARED; "a" still lists it)
    with pytest.raises(RuntimeError, match="does not own"):
        f.check_integrity()
