"""The CUDA backend's submitted, unreported jobs: one queue per direction, in submission order.

A part of the CUDA backend (backend.py). Each direction's jobs run on one stream, in order, so a queue's
head completes first: `completed` takes jobs from the heads only, and a job leaves its queue exactly once,
when the backend makes its result. A job id is in flight at most once (`job_id in jobs`). With a pageable
host pool, loads and stores share one stream and one copy thread: then a store may wait for an earlier
load named in `job.after` (`done_events`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from worker_side.backends.base import CopyJob, JobKind
from worker_side.backends.cuda.api import Event
from worker_side.backends.cuda.pageable_copier import Ticket


@dataclass(slots=True)
class InFlight:
    job: CopyJob
    done: Event | None  # recorded after the job's copies (None only while it is being submitted)
    ring_entries: int  # kernel-argument entries the job holds until `done` fired
    error: str | None = None  # the job failed at submission (its result says so)
    ticket: Ticket | None = None  # pageable jobs: set once the copy thread issued them
    path: str = ""  # the copy path the job took (copy_paths.PATHS)

    def issued(self) -> bool:
        return self.ticket is None or self.ticket.issued.is_set()


class InFlightJobs:
    def __init__(self) -> None:
        self._queues: dict[JobKind, deque[InFlight]] = {"load": deque(), "store": deque()}
        self._job_ids: set[int] = set()

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._job_ids

    def add(self, entry: InFlight) -> None:
        self._queues[entry.job.kind].append(entry)
        self._job_ids.add(entry.job.job_id)

    def completed(self, is_complete: Callable[[InFlight], bool]) -> Iterator[InFlight]:
        """Jobs whose completion `is_complete` confirms, each queue's from its head until one is not; each
        asked about only after the previous one was taken out (and its result made by the caller)."""
        for queue in self._queues.values():
            while queue and is_complete(queue[0]):
                entry = queue.popleft()
                self._job_ids.discard(entry.job.job_id)
                yield entry

    def done_events(self, job_ids: Collection[int]) -> list[Event]:
        """Completion events of these jobs still in flight. O(jobs in flight) per job named."""
        out = []
        for job_id in job_ids:
            for queue in self._queues.values():
                earlier = next((f for f in queue if f.job.job_id == job_id), None)
                if earlier is not None:
                    out.append(earlier.done)
                    break
        return out

    def select(self, job_ids: Collection[int] | None) -> list[InFlight]:
        """The jobs in flight among `job_ids` (None: all), loads first."""
        return [f for queue in self._queues.values() for f in queue if job_ids is None or f.job.job_id in job_ids]
