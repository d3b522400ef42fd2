"""The simulated device's streams and events, and the scheduler that decides when queued work runs.

Part of the simulated CUDA device (cuda_sim.py), for tests and benchmarks only. A stream is a FIFO of work
items; an event's record is (stream, items enqueued so far), done once the stream has run that many; a wait
is an item that blocks its stream until its event's record at enqueue time is done. `StreamScheduler` runs
runnable heads in the order its `schedule` prefers (seeded): "copy_first" runs copies whenever they may run,
"compute_first" the forward, "random" either, "copy_lag" copies only rarely (deep queues). `tick` runs a
few items (called at every API call), `run_until` as many as a condition needs (synchronization): a wait
whose event is done counts as progress, so a queue of satisfied waits is drained, never called a deadlock.
Exceptions raised by work (the fake model's IntegrityError) are kept in `errors`, never raised here.

Simulated time: every stream has a `clock` (seconds) that each item it runs advances by the item's
`seconds` (the cost model of cuda_sim's `SimTiming`); a copy's bytes also hold its device's link in its
direction (`links`), so copies on several streams overlap their fixed costs but share the bandwidth; a consumed wait moves the waiting stream's clock up to
the clock of the stream it waited on (an upper bound of when the awaited work ended: enough for timing
work on one stream, which is what the calibration does). A timing event records the clock at which its
stream reached the recorded item.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker_side.backends.cuda.api import CudaError

SCHEDULES = ("copy_first", "compute_first", "random", "copy_lag")


@dataclass(eq=False)
class SimStream:
    device: int
    name: str
    compute: bool
    queue: deque = field(default_factory=deque)
    enqueued: int = 0  # items ever enqueued (waits included)
    completed: int = 0  # items ever run, in order
    clock: float = 0.0  # simulated seconds of the work this stream ran
    timers: dict[int, list[SimEvent]] = field(default_factory=dict)  # item count -> timing events waiting for it


@dataclass(eq=False)
class SimEvent:
    device: int
    timing: bool = False
    target: tuple[SimStream, int] | None = None  # the latest record: done once the stream ran this many items
    time: float | None = None  # timing events: the stream's clock when the recorded item ran

    def done(self) -> bool:
        return _done(self.target)

    def record(self, stream: SimStream) -> None:
        """Capture the work enqueued on `stream` so far (cuda_sim calls this under its lock)."""
        self.target, self.time = (stream, stream.enqueued), None
        if not self.timing:
            return
        if stream.completed >= stream.enqueued:
            self.time = stream.clock
        else:
            stream.timers.setdefault(stream.enqueued, []).append(self)

    def elapsed_s(self, end: SimEvent) -> float:
        """Seconds from this event to `end` on the simulated clocks (`cuEventElapsedTime`'s refusals)."""
        for e in (self, end):
            if not e.timing:
                raise CudaError("cuEventElapsedTime: an event created without timing (CUDA_ERROR_INVALID_HANDLE)")
            if e.time is None:
                raise CudaError("cuEventElapsedTime: an event not recorded or not complete (CUDA_ERROR_NOT_READY)")
        return end.time - self.time  # type: ignore[operator]


def _done(target: tuple[SimStream, int] | None) -> bool:
    return target is None or target[0].completed >= target[1]


@dataclass(slots=True)
class SimWork:
    kind: str  # "wait" | "copy" | "kernel" | "compute"
    run: Callable[[], None] | None = None
    wait: tuple[SimStream, int] | None = None
    seconds: float = 0.0  # simulated duration (cuda_sim's SimTiming); for a copy, its fixed costs
    link: tuple[int, str] | None = None  # a copy's (device, direction): its bytes share that PCIe link
    link_seconds: float = 0.0  # the time its bytes take on the link


def _complete(s: SimStream, seconds: float) -> None:
    s.clock += seconds
    s.completed += 1
    for event in s.timers.pop(s.completed, ()):
        if event.target == (s, s.completed):  # not re-recorded since
            event.time = s.clock


class StreamScheduler:
    def __init__(self, schedule: str, seed: int, burst: int) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
        self.schedule, self.burst = schedule, burst
        self._rng = random.Random(seed)
        self.streams: list[SimStream] = []
        self.errors: list[BaseException] = []  # raised by work (e.g. the fake model's IntegrityError)
        self.links: dict[tuple[int, str], float] = {}  # (device, direction) -> when its PCIe link is free

    def push(self, stream: SimStream, work: SimWork) -> None:
        stream.queue.append(work)
        stream.enqueued += 1

    def consume_waits(self) -> int:
        """Pop every wait at a queue's head whose event is done; returns how many (progress)."""
        consumed = 0
        for s in self.streams:
            while s.queue and s.queue[0].kind == "wait" and _done(s.queue[0].wait):
                waited = s.queue.popleft().wait
                _complete(s, max(0.0, waited[0].clock - s.clock) if waited is not None else 0.0)
                consumed += 1
        return consumed

    def runnable(self) -> list[SimStream]:
        self.consume_waits()
        return [s for s in self.streams if s.queue and s.queue[0].kind != "wait"]

    def _pick(self, runnable: list[SimStream]) -> SimStream | None:
        if self.schedule == "copy_lag":
            compute = [s for s in runnable if s.compute]
            if compute:
                return self._rng.choice(compute)
            return self._rng.choice(runnable) if self._rng.random() < 0.1 else None
        if self.schedule != "random":
            prefer_compute = self.schedule == "compute_first"
            preferred = [s for s in runnable if s.compute == prefer_compute]
            runnable = preferred or runnable
        return self._rng.choice(runnable)

    def step(self, forced: bool = False) -> bool:
        """Run one item (consuming satisfied waits first); False when nothing moved."""
        consumed = self.consume_waits()
        runnable = [s for s in self.streams if s.queue and s.queue[0].kind != "wait"]
        if not runnable:
            return consumed > 0
        s = self._pick(runnable)
        if s is None:
            if not forced:
                return consumed > 0
            s = self._rng.choice(runnable)
        work = s.queue.popleft()
        try:
            if work.run is not None:
                work.run()
        except Exception as exc:  # work of the fake model: surfaced to the engine by SimCompute
            self.errors.append(exc)
        if work.link is None:
            _complete(s, work.seconds)
        else:  # the fixed costs on its own engine, then the bytes after whatever holds the link
            end = max(s.clock + work.seconds, self.links.get(work.link, 0.0)) + work.link_seconds
            self.links[work.link] = end
            _complete(s, end - s.clock)
        self.consume_waits()  # consume waits that just became satisfied
        return True

    def tick(self) -> None:
        for _ in range(self._rng.randint(0, self.burst)):
            if not self.step():
                break

    def run_until(self, condition: Callable[[], bool], op: str) -> None:
        while not condition():
            if not self.step(forced=True):
                raise CudaError(f"{op}: deadlock: work is queued but nothing can run "
                                f"({[(s.name, len(s.queue)) for s in self.streams if s.queue]})")

    def drain(self) -> None:
        """Run every queued item (tests, end of a run)."""
        self.run_until(lambda: all(not s.queue for s in self.streams), "drain")

    @property
    def num_queued(self) -> int:
        return sum(len(s.queue) for s in self.streams)
