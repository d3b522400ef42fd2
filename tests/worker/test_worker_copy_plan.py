"""The shared copy plan: runs of block ids (cut at id gaps and at host registration boundaries), the
geometry that pairs source and destination planes into segments, and shards that keep every byte exactly
once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_helpers import random_bytes

from worker_side import WorkerInvariantError
from worker_side.block_layout import tensor_block_view
from worker_side.copy_plan import CopyGeometry, Segments, coalesce_runs, split_segments
from worker_side.host_pool import HostPool

NUM_GPU_BLOCKS = 16


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


def test_runs_are_cut_where_the_host_registrations_are_cut():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    src = np.arange(1, 11, dtype=np.int64)  # 1..10
    dst = np.arange(3, 13, dtype=np.int64)  # 3..12
    # 1. cut on the destination side (a store into the host pool): before ids 4, 8 and 12
    s, d, n = coalesce_runs(src, dst, cut_every=4)
    assert d.tolist() == [3, 4, 8, 12] and s.tolist() == [1, 2, 6, 10] and n.tolist() == [1, 4, 4, 1]
    # 2. cut on the source side (a load out of the host pool): before ids 4 and 8
    s, d, n = coalesce_runs(src, dst, cut_every=4, cut_src=True)
    assert s.tolist() == [1, 4, 8] and n.tolist() == [3, 4, 3]
    # 3. a geometry built with a cut applies it to every job
    views = [tensor_block_view("l", torch.zeros(16, 8, dtype=torch.uint8))]
    for cut_src, starts in ((False, [3, 4, 8, 12]), (True, [3, 6, 10])):
        geometry = CopyGeometry.build(views, views, cut_every=4, cut_src=cut_src)
        assert geometry.runs(src, dst)[1].tolist() == starts
        assert len(geometry.segments(src, dst)) == len(starts)



def test_runs_end_at_id_gaps_as_well_as_at_registration_cuts():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    src, dst = np.array([1, 2, 5, 6, 7, 8], np.int64), np.array([1, 2, 3, 4, 5, 6], np.int64)
    starts_s, starts_d, lengths = coalesce_runs(src, dst, cut_every=4)
    assert starts_s.tolist() == [1, 5, 6] and starts_d.tolist() == [1, 3, 4] and lengths.tolist() == [2, 1, 3]
    starts_s, _, lengths = coalesce_runs(src, dst, cut_every=4, cut_src=True)
    assert starts_s.tolist() == [1, 5, 8] and lengths.tolist() == [2, 3, 1]



def mixed_views() -> list:
    """One tensor whose blocks are back to back (one segment per run) and one with padding between blocks
    (one segment per block): the two kinds of planes a geometry groups separately."""
    dense = random_bytes((NUM_GPU_BLOCKS, 2, 512), 4)
    padded = random_bytes((NUM_GPU_BLOCKS, 3, 512), 5)[:, :2]
    return [tensor_block_view("dense", dense), tensor_block_view("padded", padded)]


def test_plane_table_and_segment_count_agree_with_the_segments():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    views = mixed_views()
    host = [tensor_block_view(f"h{i}", torch.zeros(8, v.block_bytes, dtype=torch.uint8)) for i, v in enumerate(views)]
    geometry = CopyGeometry.build(views, host)
    assert geometry.num_planes == 2 and geometry.bytes_per_block == sum(v.block_bytes for v in views)
    table = geometry.plane_table()
    assert table.dtype == np.int64 and table.flags.c_contiguous and table.shape == (2, 5)
    by_base = {row[0]: row for row in table.tolist()}
    for v, h in zip(views, host, strict=True):
        assert by_base[v.base_ptr] == [v.base_ptr, h.base_ptr, v.block_stride, h.block_stride, v.chunk_bytes]
    src = np.array([1, 2, 3, 9], np.int64)
    dst = np.array([4, 5, 6, 2], np.int64)
    segments = geometry.segments(src, dst)
    assert geometry.num_segments(len(src), len(geometry.runs(src, dst)[0])) == len(segments) == 2 + 4
    assert segments.total_bytes == len(src) * geometry.bytes_per_block
    empty = geometry.segments(src[:0], dst[:0])
    assert len(empty) == 0 and empty.total_bytes == 0 and len(empty.dst) == len(empty.src) == 0


def test_a_run_of_blocks_is_one_segment_per_plane_when_both_sides_keep_blocks_adjacent():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    dense = tensor_block_view("dense", torch.zeros(NUM_GPU_BLOCKS, 2, 256, dtype=torch.uint8))
    kv_first = tensor_block_view("kv", torch.zeros(2, NUM_GPU_BLOCKS, 256, dtype=torch.uint8), NUM_GPU_BLOCKS)
    host = [tensor_block_view(f"h{i}", torch.zeros(8, 512, dtype=torch.uint8)) for i in range(2)]
    src, dst = np.arange(3, 9, dtype=np.int64), np.arange(1, 7, dtype=np.int64)  # one run of 6 blocks
    assert len(CopyGeometry.build([dense], host[:1]).segments(src, dst)) == 1
    host_kv = HostPool([kv_first], 8).views
    assert len(CopyGeometry.build([kv_first], host_kv).segments(src, dst)) == 2  # the K and the V plane
    padded = tensor_block_view("padded", torch.zeros(NUM_GPU_BLOCKS, 3, 256, dtype=torch.uint8)[:, :2])
    for pair in (([padded], host[:1]), (host[:1], [padded])):  # padding on either side: one per block
        assert len(CopyGeometry.build(*pair).segments(src, dst)) == 6


def test_a_geometry_refuses_tensors_that_do_not_pair_up():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    a = tensor_block_view("a", torch.zeros(4, 64, dtype=torch.uint8))
    b = tensor_block_view("b", torch.zeros(4, 32, dtype=torch.uint8))
    kv = tensor_block_view("kv", torch.zeros(2, 4, 32, dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        CopyGeometry.build([a, a], [a])
    with pytest.raises(WorkerInvariantError, match="geometry differ"):
        CopyGeometry.build([a], [b])  # same chunk count, other chunk size
    with pytest.raises(WorkerInvariantError, match="geometry differ"):
        CopyGeometry.build([kv], [a])  # same block bytes, other chunk count


def test_a_geometry_cuts_on_the_destination_side_unless_told_otherwise():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    views = [tensor_block_view("l", torch.zeros(16, 8, dtype=torch.uint8))]
    src, dst = np.arange(1, 7, dtype=np.int64), np.arange(2, 8, dtype=np.int64)
    assert CopyGeometry.build(views, views, 4).runs(src, dst)[1].tolist() == [2, 4]



def test_the_segment_count_matches_the_segments_for_planes_of_several_chunks():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    src = tensor_block_view("s", torch.zeros(2, NUM_GPU_BLOCKS, 16), layout="kv_first")
    dst = tensor_block_view("d", torch.zeros(2, NUM_GPU_BLOCKS, 16), layout="kv_first")
    geometry = CopyGeometry.build([src], [dst])
    ids_s, ids_d = np.array([1, 2, 3, 9], np.int64), np.array([4, 5, 6, 11], np.int64)
    segments = geometry.segments(ids_s, ids_d)
    assert geometry.num_segments(num_blocks=4, num_runs=2) == len(segments) == 4  # 2 runs x 2 chunks
    assert isinstance(geometry.num_segments(4, 2), int)


def test_a_geometry_without_planes_copies_nothing():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    segments = CopyGeometry.build([], []).segments(np.array([1, 2], np.int64), np.array([3, 4], np.int64))
    assert len(segments) == 0 and segments.total_bytes == 0


def segments_of(sizes: list[int]) -> Segments:
    nbytes = np.array(sizes, np.int64)
    starts = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    return Segments(dst=10_000 + starts, src=20_000 + starts, nbytes=nbytes)


def shard_sizes(shards: list[Segments]) -> list[list[int]]:
    return [s.nbytes.tolist() for s in shards]


def test_shards_cut_segments_into_equal_bytes_only_above_the_minimum_piece():
    """Found by mutation testing of worker_side/copy_plan.py (docs/mutation.md)."""
    one = split_segments(segments_of([1000]), 2, min_piece=1)
    assert shard_sizes(one) == [[500], [500]]
    assert [s.dst.tolist() for s in one] == [[10_000], [10_500]] and [s.src.tolist() for s in one] == [[20_000], [20_500]]
    assert shard_sizes(split_segments(segments_of([100, 100, 100]), 2, min_piece=1)) == [[100, 100], [100]]
    assert shard_sizes(split_segments(segments_of([100] * 4), 4, min_piece=1)) == [[100]] * 4
    assert shard_sizes(split_segments(segments_of([100, 100]), 2, min_piece=200)) == [[100, 100]]  # at the minimum
    assert shard_sizes(split_segments(segments_of([100, 100]), 2, min_piece=1000)) == [[100, 100]]
    assert shard_sizes(split_segments(segments_of([1000]), 1, min_piece=1)) == [[1000]]
    assert split_segments(segments_of([]), 2) == []
