"""Copies of a host pool that could not be pinned, issued from a thread of their own.

Why a thread: a `cuMemcpyAsync` between device and pageable host memory is not asynchronous. Device ->
pageable host returns only once the copy is done, so it first waits for everything queued before it on
its stream, which for a store is the forward it is fenced on; pageable host -> device is staged through
the driver's bounce buffers chunk by chunk, which for anything but small copies also waits for the
stream. Issued from the engine thread, either would stall the engine for the rest of the forward. A
pinned staging buffer would need its own pinning (which just failed) and a host copy after the DMA (on
some thread anyway); so one copy thread per backend issues the copies instead, and the engine thread only
enqueues the fences (which must be taken at submission, on the engine's compute stream) and polls.

Invariants: work is issued in submission order, one job at a time; for each job the thread makes the
stream wait for the completion events of the jobs it must follow (`after`: recorded by this same thread
earlier, so the wait captures the right record), issues the job's copies, records its completion event,
then sets `Ticket.issued`. A job is complete once its ticket is issued and its event has completed; a
copy that raised is reported in `Ticket.error` (the job fails), and the event is still recorded, so later
jobs keep their order. `close()` issues what is queued, then ends the thread.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from worker_side.backends.cuda.api import CudaRuntime, Event, Stream
from worker_side.copy_plan import Segments


@dataclass(slots=True)
class Ticket:
    issued: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass(slots=True)
class _Work:
    segments: Segments
    stream: Stream
    done: Event
    after: list[Event]
    ticket: Ticket


class PageableCopier:
    def __init__(self, rt: CudaRuntime, device: int) -> None:
        self.rt, self.device = rt, device
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"offload-pageable-copy-{device}", daemon=True)
        self._thread.start()
        self._closed = False
        self.num_copy_calls = 0

    def submit(self, segments: Segments, stream: Stream, done: Event, after: list[Event]) -> Ticket:
        """Queue the job's copies; `done` is recorded on `stream` after them (by the copy thread)."""
        ticket = Ticket()
        self._queue.put(_Work(segments, stream, done, after, ticket))
        return ticket

    def _run(self) -> None:
        broken = None  # the thread could not make its device current: every job fails, in order
        try:
            if self.rt.get_device() != self.device:
                self.rt.set_device(self.device)
        except Exception as exc:
            broken = f"the copy thread could not make device {self.device} current ({type(exc).__name__}: {exc})"
        while (work := self._queue.get()) is not None:
            if broken is not None:
                work.ticket.error = broken
                work.ticket.issued.set()
                continue
            try:
                for event in work.after:
                    self.rt.wait_event(work.stream, event)
                segs = work.segments
                for d, s, n in zip(segs.dst.tolist(), segs.src.tolist(), segs.nbytes.tolist(), strict=True):
                    self.rt.memcpy(d, s, n, work.stream, pageable=True)
                    self.num_copy_calls += 1
            except Exception as exc:  # a driver error: this job fails, later ones still run in order
                work.ticket.error = f"{type(exc).__name__}: {exc}"
            try:
                self.rt.record_event(work.done, work.stream)
            except Exception as exc:
                work.ticket.error = work.ticket.error or f"{type(exc).__name__}: {exc}"
                try:  # no completion event: wait here, so the job is not reported while it may still copy
                    self.rt.synchronize_stream(work.stream)
                except Exception:
                    pass
            work.ticket.issued.set()

    def close(self) -> None:
        """Issue every queued job, then end the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
