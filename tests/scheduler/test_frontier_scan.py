"""`scan_frontier` decides exactly what the block-by-block walk of the lazy policy decides: the blocks
scanned, the blocks picked and their order, for any budget, pick cost and room (floating point included)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_side.policies.frontier_scan import scan_frontier


def walk_block_by_block(keys, unsaved, budget, pick_cost, room, picked):
    """The rule as lazy.py states it, one block at a time."""
    scanned, positions = 0, []
    for i, key in enumerate(keys):
        if budget <= 0:
            break
        scanned += 1
        if room > 0 and key is not None and key not in picked and key in unsaved:
            picked.add(key)
            positions.append(i)
            room -= 1
            budget -= pick_cost
        else:
            budget -= 1
    return scanned, positions, budget > 0 and scanned == len(keys)


frontiers = st.lists(st.one_of(st.none(), st.integers(0, 12).map(lambda i: b"k%d" % i)), max_size=60)


@settings(max_examples=400, deadline=None)
@given(keys=frontiers, unsaved_ids=st.sets(st.integers(0, 12)), budget=st.floats(-2, 40),
       pick_cost=st.one_of(st.floats(0, 1), st.sampled_from([0.0, 0.2, 1 - 0.8 ** 7, 1.0])),
       room=st.integers(-1, 20), picked_ids=st.sets(st.integers(0, 12), max_size=3))
def test_scan_frontier_matches_the_block_by_block_walk(keys, unsaved_ids, budget, pick_cost, room, picked_ids):
    unsaved = {b"k%d" % i for i in unsaved_ids}
    picked = {b"k%d" % i for i in picked_ids}
    candidates = [i for i, key in enumerate(keys) if key is not None and key in unsaved]
    expected_picked, got_picked = set(picked), set(picked)
    expected = walk_block_by_block(keys, unsaved, budget, pick_cost, room, expected_picked)
    assert scan_frontier(keys, candidates, budget, pick_cost, room, got_picked) == expected
    assert got_picked == expected_picked


def test_a_run_of_saved_blocks_costs_one_each_and_a_pick_its_cost() -> None:
    keys = [b"s"] * 3 + [b"u1", b"u2"] + [b"s"] * 10
    # budget 5: three saved blocks (3), two picks at 0.5 (1): 1 left, so one more saved block is scanned
    assert scan_frontier(keys, [3, 4], 5.0, 0.5, 10, set()) == (6, [3, 4], False)
    # no room: the unsaved blocks cost 1 like the others and nothing is picked
    assert scan_frontier(keys, [3, 4], 5.0, 0.5, 0, set()) == (5, [], False)
    # the prefix read runs out with budget left: the caller reads a longer one
    assert scan_frontier(keys[:5], [3, 4], 50.0, 0.5, 10, set()) == (5, [3, 4], True)
