"""`IdChecks`: the worker's checks of the block ids a step's metadata names, before anything is copied.

A job's source and destination lists must be as long as each other, every id in [1, limit) (block 0 is the
null block) and no destination named twice (two copies into one block race). A bad list is a scheduler bug:
`WorkerInvariantError`, naming the event and the ids, nothing submitted. O(ids) per job, no sort: the
duplicate check writes each id's position into a scratch array per id range, kept between calls.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from worker_side.backends.base import JobKind
from worker_side.errors import WorkerInvariantError


class IdChecks:
    def __init__(self) -> None:
        self._scratch: dict[int, np.ndarray] = {}  # per id range: the duplicate check's scratch array

    def checked(self, kind: JobKind, event_id: int, src: Sequence[int], dst: Sequence[int], src_limit: int,
                dst_limit: int) -> tuple[np.ndarray, np.ndarray]:
        """The job's source and destination ids as int64 arrays, checked."""
        if len(src) != len(dst):
            raise WorkerInvariantError(f"{kind} event {event_id}: {len(src)} source vs {len(dst)} destination "
                                       "block ids (scheduler bug)")
        src_a, dst_a = id_array(src), id_array(dst)
        for ids, limit, what in ((src_a, src_limit, "source"), (dst_a, dst_limit, "destination")):
            bad = outside(ids, limit)
            if bad is not None:
                raise WorkerInvariantError(f"{kind} event {event_id}: {what} block ids {bad[:8].tolist()} outside "
                                           f"[1, {limit}) (block 0 is the null block; scheduler bug)")
        if self.has_duplicates(dst_a, dst_limit):
            raise WorkerInvariantError(f"{kind} event {event_id}: a destination block appears twice in "
                                       f"{dst_a.tolist()[:32]} (scheduler bug)")
        return src_a, dst_a

    def valid_destinations(self, ids: np.ndarray, limit: int) -> bool:
        """Every id in [1, limit) and none twice (`checked`'s rule for a destination list)."""
        return outside(ids, limit) is None and not self.has_duplicates(ids, limit)

    def has_duplicates(self, ids: np.ndarray, limit: int) -> bool:
        """O(n) without sorting: write each id's position into a scratch array indexed by id, read it back."""
        scratch = self._scratch.get(limit)
        if scratch is None:
            scratch = self._scratch[limit] = np.zeros(limit, np.int64)
        positions = np.arange(len(ids))
        scratch[ids] = positions
        return bool((scratch[ids] != positions).any())


def outside(ids: np.ndarray, limit: int) -> np.ndarray | None:
    """The ids outside [1, limit) (block 0 is the null block), or None when every id lies inside."""
    if len(ids) and (ids.min() < 1 or ids.max() >= limit):
        return ids[(ids < 1) | (ids >= limit)]
    return None


def id_array(ids: Sequence[int]) -> np.ndarray:
    """`ids` as int64. The metadata's lists go through `array('q')`, about a third faster than `np.asarray` at
    hundreds of ids (no numpy type discovery per item); a float raises TypeError where np.asarray would
    truncate it."""
    if isinstance(ids, list):
        return np.frombuffer(array("q", ids), np.int64)
    return np.asarray(ids, np.int64)
