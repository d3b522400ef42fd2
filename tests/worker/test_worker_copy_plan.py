"""The shared copy plan: run coalescing and shard splitting keep every byte exactly once."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_side.copy_plan import Segments, coalesce_runs, split_segments


def test_coalesce_merges_only_runs_advancing_on_both_sides():
    src = np.array([1, 2, 3, 7, 8, 10], np.int64)
    dst = np.array([5, 6, 9, 10, 11, 3], np.int64)
    s, d, n = coalesce_runs(src, dst)
    assert s.tolist() == [1, 3, 7, 10] and d.tolist() == [5, 9, 10, 3] and n.tolist() == [2, 1, 2, 1]


def covered(segs: list[Segments]) -> list[tuple[int, int]]:
    """(dst_byte, src_byte) pairs every segment copies, for small sizes."""
    out = []
    for s in segs:
        for d0, s0, n in zip(s.dst.tolist(), s.src.tolist(), s.nbytes.tolist(), strict=True):
            out += [(d0 + i, s0 + i) for i in range(n)]
    return sorted(out)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 4), st.integers(1, 16))
def test_split_segments_preserves_bytes(sizes, shards, min_piece):
    nbytes = np.array(sizes, np.int64)
    starts = np.concatenate(([0], np.cumsum(nbytes)[:-1])) * 3
    segs = Segments(starts + 1000, starts, nbytes)
    parts = split_segments(segs, shards, min_piece)
    assert len(parts) <= max(1, shards)
    assert covered(parts) == covered([segs])
