"""How one staged job is cut into chunks: the kernel's block ids first, the DMA segments when they are needed.

A part of the staged path (staging.py). A job's pairs are sorted by host block id (consecutive host blocks
then share one DMA segment) and cut into chunks of `slot_blocks` blocks; chunk c takes slot
`(first_slot + c) % num_slots` of its direction's ring, so block i of the sorted job sits at ring position
`base_slot + (first_slot * slot_blocks + i) % (num_slots * slot_blocks)`.
Planning comes in two steps so that a store's first gather is launched before its DMA is planned:
- `plan_ids` (a fixed seven numpy calls): the sorted ids and ring positions, which are the kernel's arguments;
- `plan_dma` (about a dozen numpy calls): the DMA segments, a run of consecutive host blocks within one chunk
  and one host registration each, as uint64 addresses (the batched copy's argument type), and each chunk's
  range of segments.
(Planning a load's chunk 0 apart from the rest was measured: numpy's per-call cost dominates at these sizes,
so it gained little on the first DMA and cost a second plan.)
Neither allocates device memory, touches a stream or depends on anything but its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StagedIds:
    """One job's blocks in host-id order, and where each sits in the staging ring."""
    pairs: np.ndarray  # (2, blocks) int64: row 0 the host block ids, ascending; row 1 each one's ring position
    gpu: np.ndarray  # the GPU block paired with each
    first_slot: int  # the slot chunk 0 takes

    @property
    def host(self) -> np.ndarray:
        return self.pairs[0]

    @property
    def positions(self) -> np.ndarray:
        return self.pairs[1]

    @property
    def num_blocks(self) -> int:
        return self.pairs.shape[1]


@dataclass(frozen=True, slots=True)
class StagedDma:
    """A job's DMA segments: chunk c's are [bounds[c], bounds[c + 1]); addresses are host and ring bytes."""
    host_addr: np.ndarray  # uint64
    ring_addr: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64
    bounds: list[int]


def plan_ids(host_ids: np.ndarray, gpu_ids: np.ndarray, first_slot: int, slot_blocks: int, num_slots: int,
             base_slot: int) -> StagedIds:
    """Sort the pairs by host id and place block i at its ring position (see the module docstring). Equal
    host ids (a load reading one host block into several GPU blocks) keep no particular order."""
    host_ids, gpu_ids = np.asarray(host_ids, np.int64), np.asarray(gpu_ids, np.int64)  # no copy when int64
    order = np.argsort(host_ids)  # not `stable`: numpy's vectorised sort, 3-4x faster on scattered ids
    pairs = np.empty((2, len(order)), np.int64)
    np.take(host_ids, order, out=pairs[0])
    start = first_slot * slot_blocks
    np.remainder(np.arange(start, start + len(order), dtype=np.int64), num_slots * slot_blocks, out=pairs[1])
    pairs[1] += base_slot
    return StagedIds(pairs, gpu_ids[order], first_slot)


def plan_dma(ids: StagedIds, slot_blocks: int, bytes_per_block: int, bases: np.ndarray,
             cut_rows: int | None) -> StagedDma:
    """The DMA segments of `ids`: a new segment where the host ids stop being consecutive, at every chunk's
    first block and at every host registration's first row (`cut_rows`: rows per registration, or None).
    `bases`: (2, 1) int64, the host pool's and the ring's first byte."""
    host, n = ids.host, ids.num_blocks
    brk = np.empty(n, np.bool_)
    if n:  # ufuncs with `out`, not np.diff: its Python wrapper costs more than the work at these sizes
        np.not_equal(np.subtract(host[1:], host[:-1]), 1, out=brk[1:])
        brk[::slot_blocks] = True  # brk[0] among them
        if cut_rows is not None:
            brk[1:] |= host[1:] % cut_rows == 0
    starts = np.flatnonzero(brk)
    addr = ids.pairs[:, starts]  # (2, segments): each segment's first host block and ring position
    addr *= bytes_per_block
    addr += bases
    nbytes = np.empty(len(starts), np.int64)
    if n:
        np.subtract(starts[1:], starts[:-1], out=nbytes[:-1])
        nbytes[-1] = n - starts[-1]
        nbytes *= bytes_per_block
    bounds = np.searchsorted(starts, np.arange(0, n + slot_blocks, slot_blocks)).tolist()
    return StagedDma(addr[0].view(np.uint64), addr[1].view(np.uint64), nbytes.view(np.uint64), bounds)
