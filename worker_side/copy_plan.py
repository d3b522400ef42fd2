"""Turn a job's block-id pairs into byte segments: the logic every backend shares.

`coalesce_runs` merges pairs whose source and destination ids both advance by one into runs;
`build_segments` turns runs into `(dst_ptr, src_ptr, nbytes)` arrays, one segment per run for tensors whose
runs are contiguous, else one per block chunk; `split_segments` cuts the segments into `n` shards of about
equal bytes for parallel workers. All arrays are numpy int64; nothing here touches tensor memory, so the
plan the CPU backend executes in CI is the plan the CUDA backend submits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker_side.block_layout import TensorBlockView
from worker_side.errors import WorkerInvariantError


@dataclass(frozen=True, slots=True)
class Segments:
    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def coalesce_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_starts, dst_starts, lengths) of maximal runs where both ids advance by one."""
    if len(src_ids) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src_ids)])))
    return src_ids[starts], dst_ids[starts], lengths


def build_segments(src_views: Sequence[TensorBlockView], dst_views: Sequence[TensorBlockView],
                   src_ids: np.ndarray, dst_ids: np.ndarray) -> Segments:
    """Byte segments copying block src_ids[i] to dst_ids[i] in every (src, dst) tensor pair."""
    src_starts, dst_starts, lengths = coalesce_runs(src_ids, dst_ids)
    dsts, srcs, sizes = [], [], []
    for sv, dv in zip(src_views, dst_views, strict=True):
        if sv.block_bytes != dv.block_bytes or sv.chunk_bytes != dv.chunk_bytes:
            raise WorkerInvariantError(f"tensor {sv.name!r}: source and destination block geometry differ "
                             f"({sv.block_bytes}/{sv.chunk_bytes} vs {dv.block_bytes}/{dv.chunk_bytes}); our bug")
        if sv.runs_are_contiguous and dv.runs_are_contiguous:
            srcs.append(sv.base_ptr + src_starts * sv.block_stride)
            dsts.append(dv.base_ptr + dst_starts * dv.block_stride)
            sizes.append(lengths * sv.block_bytes)
            continue
        # one segment per (block, chunk); the host side's chunks sit back to back
        s_blocks, d_blocks = src_ids, dst_ids
        s_base = (sv.base_ptr + s_blocks * sv.block_stride)[:, None] + sv.chunk_offsets[None, :]
        d_base = (dv.base_ptr + d_blocks * dv.block_stride)[:, None] + dv.chunk_offsets[None, :]
        srcs.append(s_base.ravel())
        dsts.append(d_base.ravel())
        sizes.append(np.full(s_base.size, sv.chunk_bytes, np.int64))
    if not sizes:
        empty = np.zeros(0, np.int64)
        return Segments(empty, empty, empty)
    return Segments(np.concatenate(dsts).astype(np.int64), np.concatenate(srcs).astype(np.int64),
                    np.concatenate(sizes).astype(np.int64))


def split_segments(segments: Segments, num_shards: int, min_piece: int = 256 * 1024) -> list[Segments]:
    """Cut segments into at most `num_shards` shards of about equal bytes (large segments are split)."""
    total = segments.total_bytes
    if num_shards <= 1 or total <= min_piece:
        return [segments] if len(segments) else []
    target = max(min_piece, -(-total // num_shards))
    pieces = -(-segments.nbytes // target)  # ceil: pieces per segment
    idx = np.repeat(np.arange(len(segments)), pieces)
    within = np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = within * target
    nbytes = np.minimum(segments.nbytes[idx] - offset, target)
    dst, src = segments.dst[idx] + offset, segments.src[idx] + offset
    ends = np.cumsum(nbytes)
    cuts = np.searchsorted(ends, np.arange(1, num_shards) * (total / num_shards), side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.minimum(cuts, len(nbytes)), [len(nbytes)])))
    return [Segments(dst[a:b], src[a:b], nbytes[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
