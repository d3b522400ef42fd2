"""`LoadReads`: the host-pool blocks that the worker's load jobs in flight read, so that no store job starts
writing one before those loads are over.

The scheduler never sends a store into a host block a load in flight reads, save a slot that its step's
load alone read and lent (`store_after_load`: the worker orders that store after the step's load); this
is the worker's own check of that rule, over every copy it has in flight, whatever step issued it.

Invariants: `_count[b]` is the number of source positions of the jobs in `_sources` that name host block
`b` (a block a job reads twice counts twice); a load job is added once its submission succeeded and taken
out when the worker takes its result (a load past its deadline only when its late copy is over: it reads
until then). `add` and `remove` are O(blocks of the job); `readers` is O(blocks of the store) when no block
is read, plus O(blocks of the loads in flight) when one is. Owned by one `OffloadWorker` (engine thread).
"""

from __future__ import annotations

import numpy as np


class LoadReads:
    __slots__ = ("_count", "_sources")

    def __init__(self, num_cpu_blocks: int) -> None:
        self._count = np.zeros(num_cpu_blocks, np.int32)
        self._sources: dict[int, np.ndarray] = {}  # load job id -> the host blocks it reads

    def add(self, job_id: int, cpu_block_ids: np.ndarray) -> None:
        """Load job `job_id`, just submitted, reads these host blocks until `remove(job_id)`."""
        self._sources[job_id] = cpu_block_ids
        np.add.at(self._count, cpu_block_ids, 1)

    def remove(self, job_id: int) -> None:
        """The job's copies are over (no-op for a job never added)."""
        cpu_block_ids = self._sources.pop(job_id, None)
        if cpu_block_ids is not None:
            np.subtract.at(self._count, cpu_block_ids, 1)

    def readers(self, cpu_block_ids: np.ndarray) -> tuple[int, ...]:
        """The load jobs in flight that read any of these host blocks, in submission order."""
        if not len(cpu_block_ids) or not self._count[cpu_block_ids].any():
            return ()
        written = np.zeros(len(self._count), np.bool_)
        written[cpu_block_ids] = True
        return tuple(job_id for job_id, sources in self._sources.items() if written[sources].any())

    @property
    def num_jobs(self) -> int:
        return len(self._sources)
