"""The admission filter (scheduler_side/admission/filter.py): superseded branches, sessions, `store: false`."""

from __future__ import annotations

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
