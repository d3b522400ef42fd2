"""Turn a job's block-id pairs into byte segments: the logic every backend shares.

`CopyGeometry` is built once per direction when the backend binds: for every *plane* (one chunk of one
tensor, see block_layout and host_pool; chunks back to back on both sides merged into one plane,
`merge_adjacent_planes`) the source and destination base pointers and block strides, so a
job's segments come from a handful of numpy operations over all planes at once, never a Python loop over
tensors or blocks. `coalesce_runs` merges pairs whose source and destination ids both advance by one into
runs (cut where the host pool's registrations are cut); a plane whose consecutive blocks sit back to back on
both sides (`block_stride == chunk_bytes`: every vLLM layout, and the host pool's chunk-major planes) gets
one segment per run, any other plane one per block. `split_segments` cuts segments into `n` shards of
about equal bytes for parallel workers. All arrays are numpy int64; nothing here touches tensor memory, so
the plan the CPU backend executes in CI is the plan the CUDA backend submits.
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


_EMPTY = np.zeros(0, np.int64)


def coalesce_runs(src_ids: np.ndarray, dst_ids: np.ndarray, cut_every: int | None = None,
                  cut_src: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_starts, dst_starts, lengths) of maximal runs where both ids advance by one.

    With `cut_every`, a run also ends where the destination ids (the source ids with `cut_src`) cross a
    multiple of `cut_every`: the host pool's registration cuts."""
    if len(src_ids) == 0:
        return _EMPTY, _EMPTY, _EMPTY
    brk = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    if cut_every is not None:
        host = src_ids if cut_src else dst_ids
        brk |= (host[1:] % cut_every) == 0
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    lengths = np.diff(np.concatenate((starts, [len(src_ids)])))
    return src_ids[starts], dst_ids[starts], lengths


@dataclass(frozen=True, slots=True)
class _PlaneGroup:
    """Planes that are all run-contiguous or all not: bases and strides as (P, 1) columns."""
    runs: bool
    src_base: np.ndarray
    dst_base: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    chunk_bytes: np.ndarray


@dataclass(frozen=True, slots=True)
class CopyGeometry:
    """Where every plane's blocks live on the source and the destination side of one copy direction."""
    groups: tuple[_PlaneGroup, ...]
    cut_every: int | None = None  # host registration cut (rows), on the destination side unless cut_src
    cut_src: bool = False
    num_planes: int = 0
    bytes_per_block: int = 0  # sum of the planes' chunk bytes

    @staticmethod
    def build(src_views: Sequence[TensorBlockView], dst_views: Sequence[TensorBlockView],
              cut_every: int | None = None, cut_src: bool = False) -> CopyGeometry:
        rows: list[tuple[int, int, int, int, int]] = []
        for sv, dv in zip(src_views, dst_views, strict=True):
            if sv.num_chunks != dv.num_chunks or sv.chunk_bytes != dv.chunk_bytes:
                raise WorkerInvariantError(
                    f"tensor {sv.name!r}: source and destination block geometry differ ({sv.num_chunks} x "
                    f"{sv.chunk_bytes} vs {dv.num_chunks} x {dv.chunk_bytes} bytes); our bug")
            for s_off, d_off in zip(sv.chunk_offsets.tolist(), dv.chunk_offsets.tolist(), strict=True):
                rows.append((sv.base_ptr + s_off, dv.base_ptr + d_off, sv.block_stride, dv.block_stride,
                             sv.chunk_bytes))
        cols: dict[bool, list[tuple[int, int, int, int, int]]] = {True: [], False: []}
        for row in merge_adjacent_planes(rows):
            cols[row[2] == row[4] and row[3] == row[4]].append(row)
        groups = []
        for runs, group_rows in cols.items():
            if group_rows:
                a = np.array(group_rows, np.int64).T[:, :, None]  # 5 x P x 1
                groups.append(_PlaneGroup(runs, a[0], a[1], a[2], a[3], a[4]))
        return CopyGeometry(tuple(groups), cut_every, cut_src, num_planes=sum(len(g.src_base) for g in groups),
                            bytes_per_block=int(sum(g.chunk_bytes.sum() for g in groups)))

    def plane_table(self, max_piece: int | None = None) -> np.ndarray:
        """(num_planes, 5) int64 rows `(src_base, dst_base, src_stride, dst_stride, chunk_bytes)`: what the
        block-copy kernels need to find chunk `p` of block pair `(s, d)` themselves, from block ids alone.
        With `max_piece` (a multiple of 16), a plane larger than that becomes several rows of at most
        `max_piece` bytes each, so the work a kernel hands one warp stays bounded."""
        cols = [np.concatenate([getattr(g, f)[:, 0] for g in self.groups])
                for f in ("src_base", "dst_base", "src_stride", "dst_stride", "chunk_bytes")]
        table = np.ascontiguousarray(np.stack(cols, axis=1), dtype=np.int64)
        if max_piece is None or not len(table) or table[:, 4].max() <= max_piece:
            return table
        if max_piece <= 0 or max_piece % 16:
            raise WorkerInvariantError(f"plane_table: max_piece={max_piece} must be a positive multiple of 16 (our bug)")
        pieces = -(-table[:, 4] // max_piece)
        rows = np.repeat(table, pieces, axis=0)
        within = np.arange(len(rows)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        offset = within * max_piece
        rows[:, 0] += offset
        rows[:, 1] += offset
        rows[:, 4] = np.minimum(rows[:, 4] - offset, max_piece)
        return np.ascontiguousarray(rows)

    def runs(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The job's runs (see coalesce_runs), cut where the host pool's registrations are cut."""
        return coalesce_runs(src_ids, dst_ids, self.cut_every, self.cut_src)

    def num_segments(self, num_blocks: int, num_runs: int) -> int:
        """How many segments `segments()` returns for a job of `num_blocks` blocks in `num_runs` runs."""
        return sum((num_runs if g.runs else num_blocks) * len(g.src_base) for g in self.groups)

    def segments(self, src_ids: np.ndarray, dst_ids: np.ndarray,
                 runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> Segments:
        """Byte segments copying block src_ids[i] to dst_ids[i] in every plane (`runs`: from `runs()`)."""
        if len(src_ids) == 0 or not self.groups:
            return Segments(_EMPTY, _EMPTY, _EMPTY)
        dsts, srcs, sizes = [], [], []
        for g in self.groups:
            if g.runs:
                if runs is None:
                    runs = self.runs(src_ids, dst_ids)
                s_start, d_start, lengths = runs
            else:
                s_start, d_start, lengths = src_ids, dst_ids, np.ones(len(src_ids), np.int64)
            srcs.append((g.src_base + s_start * g.src_stride).ravel())
            dsts.append((g.dst_base + d_start * g.dst_stride).ravel())
            sizes.append((lengths * g.chunk_bytes).ravel())
        if len(sizes) == 1:
            return Segments(dsts[0], srcs[0], sizes[0])
        return Segments(np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes))


def merge_adjacent_planes(rows: Sequence[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    """Planes `(src_base, dst_base, src_stride, dst_stride, chunk_bytes)` with the chunks that sit back to
    back on both sides (same strides, the second starting where the first ends, on both sides) merged into
    one: every layer of a block-outermost engine block (vLLM's BLHNC) into a `blocks` host pool is one
    plane, so a block (and a run of them) is one segment. Valid for every block because the strides agree."""
    merged: list[list[int]] = []
    for row in sorted(rows, key=lambda r: (r[2], r[3], r[0])):
        last = merged[-1] if merged else None
        if (last is not None and last[2] == row[2] and last[3] == row[3]
                and last[0] + last[4] == row[0] and last[1] + last[4] == row[1]):
            last[4] += row[4]
        else:
            merged.append(list(row))
    return [(a, b, c, d, e) for a, b, c, d, e in merged]


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
