"""A direction's second DMA stream, joined to the copy stream on both sides of a job (copy_paths, staging).

A part of the CUDA backend. Copies of one job may take turns on the direction's copy stream and this helper
(two copy engines overlap their per-call and per-segment costs). `follow(stream)` makes the helper wait for
everything `stream` waited for so far (the fences, the loads in `job.after`); `rejoin(stream)` makes `stream`
wait for everything the helper was given: to every other party the job is on `stream` alone. The two events
are permanent: each is re-recorded only after the wait on its previous record was enqueued (each call
records and waits at once), so a direct DMA job and a staged one may share them.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_side.backends.cuda.api import CudaRuntime, Event, Stream


@dataclass(frozen=True, slots=True)
class Helper:
    stream: Stream
    go: Event
    joined: Event

    @staticmethod
    def make(rt: CudaRuntime, low_priority: bool) -> Helper:
        return Helper(rt.create_stream(low_priority=low_priority), rt.create_event(), rt.create_event())

    def follow(self, rt: CudaRuntime, stream: Stream) -> None:
        rt.record_event(self.go, stream)
        rt.wait_event(self.stream, self.go)

    def rejoin(self, rt: CudaRuntime, stream: Stream) -> None:
        rt.record_event(self.joined, self.stream)
        rt.wait_event(stream, self.joined)
