"""Step fences: the CUDA events that order the backend's copy streams after the engine's compute.

A part of the CUDA backend (backend.py), which calls it on the engine thread with the KV cache's device
current. Owns a pool of reusable events and the step fence:
- `begin_step()` (vLLM's `bind_connector_metadata`, before the forward is launched) records the step fence
  on the compute stream: the work that may still read blocks this step's loads overwrite (vLLM #47282);
- `order(kind, stream)` makes a copy stream wait before a job: a load for the step fence only, so it
  overlaps this step's forward (which never reads a block being loaded: those requests wait); a store, or
  a load outside a step, for a fence recorded now, after everything launched so far, including the forward
  that wrote the blocks it reads (vLLM #45704);
- `end_step()` hands the step fence back.
An event goes back to the pool (`reuse`) only once every wait on it is enqueued or the work it marks
completed, so recording it again never changes what an enqueued wait waits for.
"""

from __future__ import annotations

from worker_side.backends.base import JobKind
from worker_side.backends.cuda.api import CudaRuntime, Event, Stream


class StepFences:
    def __init__(self, rt: CudaRuntime) -> None:
        self.rt = rt
        self._free: list[Event] = []  # events no enqueued wait or pending job refers to
        self._step_fence: Event | None = None  # recorded by begin_step, until end_step

    def event(self) -> Event:
        """An event from the pool, or a new one."""
        return self._free.pop() if self._free else self.rt.create_event()

    def reuse(self, event: Event) -> None:
        """Give `event` back: its waits are enqueued, or the work it marks completed."""
        self._free.append(event)

    def begin_step(self) -> None:
        """Record the fence this step's loads wait on: all compute launched before this step's forward."""
        if self._step_fence is None:
            self._step_fence = self.event()
        self.rt.record_event(self._step_fence, self.rt.compute_stream())

    def end_step(self) -> None:
        if self._step_fence is not None:
            self._free.append(self._step_fence)  # its waits are enqueued: safe to record again
            self._step_fence = None

    def order(self, kind: JobKind, stream: Stream) -> None:
        """Make `stream` wait for the compute a `kind` job must follow (see the module docstring)."""
        if kind == "load" and self._step_fence is not None:
            self.rt.wait_event(stream, self._step_fence)
            return
        fence = self.event()  # a store, or a load outside begin_step/end_step: everything launched so far
        self.rt.record_event(fence, self.rt.compute_stream())
        self.rt.wait_event(stream, fence)
        self._free.append(fence)  # the wait is enqueued: safe to record again
