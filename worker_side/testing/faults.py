"""Fault injection for tests: a backend wrapper that fails, delays or holds chosen jobs.

`FaultyBackend(inner, ...)` forwards to `inner` and changes what `poll()` reports:
- a failed job is never handed to `inner` (its destination blocks keep stale bytes) and reports all its
  destination ids as failed; `fail_load_gpu_blocks` fails only those GPU blocks of a load (the rest copy);
- a delayed job's result is held back `delay_s` seconds after submission;
- a held job (`hold(job)` true) is reported only after `release(job_id)` / `release_all()`, which lets
  tests complete jobs in any order without timing assumptions;
- a stalled job (`stall(job)` true) is not even handed to `inner` before `release(job_id)` /
  `release_all()`: its copy runs late, reading its source and writing its destination then (a copy
  stuck in a queue or on a hung link). A job that must follow a stalled one (`job.after`) is stalled
  with it and handed on once every stalled job it follows was (with its `after` kept: the inner backend
  still orders them).
Which jobs fail: `fail_loads` / `fail_stores` (True for all, or a collection of event ids), `predicate(job)`,
or `fail_rate` with a seeded RNG. Invariant: each submitted job still yields exactly one result.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from worker_side.backends.base import CopyJob, JobResult, TransferBackend
from worker_side.block_layout import TensorBlockView
from worker_side.errors import WorkerInvariantError
from worker_side.host_pool import HostPool

INJECTED = "injected failure"


@dataclass(slots=True)
class _Fate:
    job: CopyJob
    failed: tuple[int, ...]
    release_at: float
    held: bool
    stalled: CopyJob | None = None  # a stalled job, handed to the inner backend at its release
    result: JobResult | None = None  # set once the inner backend (or the injection) finished it
    chosen: bool = False  # stalled by `stall` (waits for `release`), not only behind stalled jobs
    behind: set[int] = field(default_factory=set)  # stalled jobs it must follow, not handed on yet


class FaultyBackend(TransferBackend):
    def __init__(self, inner: TransferBackend, *, fail_loads: bool | Collection[int] = False,
                 fail_stores: bool | Collection[int] = False, fail_load_gpu_blocks: Collection[int] = (),
                 fail_rate: float = 0.0, seed: int = 0, predicate: Callable[[CopyJob], bool] | None = None,
                 delay_s: float | Callable[[CopyJob], float] = 0.0,
                 hold: Callable[[CopyJob], bool] | None = None,
                 stall: Callable[[CopyJob], bool] | None = None) -> None:
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.fail_loads, self.fail_stores = fail_loads, fail_stores
        self.fail_load_gpu_blocks = frozenset(fail_load_gpu_blocks)
        self.fail_rate, self.predicate, self.delay_s, self.hold = fail_rate, predicate, delay_s, hold
        self.stall = stall
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fates: dict[int, _Fate] = {}

    @staticmethod
    def _matches(rule: bool | Collection[int], event_id: int) -> bool:
        return rule if isinstance(rule, bool) else event_id in rule

    def _fails(self, job: CopyJob) -> bool:
        rule = self.fail_loads if job.kind == "load" else self.fail_stores
        if self._matches(rule, job.event_id) or (self.predicate is not None and self.predicate(job)):
            return True
        return self.fail_rate > 0 and self._rng.random() < self.fail_rate

    @property
    def sync_loads(self) -> bool:  # type: ignore[override]
        return self.inner.sync_loads

    def numa_node(self, device_views: list[TensorBlockView]) -> int | None:
        return self.inner.numa_node(device_views)

    def bind(self, device_views: list[TensorBlockView], pool: HostPool) -> None:
        self.inner.bind(device_views, pool)

    def begin_step(self) -> None:
        self.inner.begin_step()

    def end_step(self) -> None:
        self.inner.end_step()

    def submit(self, job: CopyJob) -> None:
        delay = self.delay_s(job) if callable(self.delay_s) else self.delay_s
        held = self.hold is not None and self.hold(job)
        fate = _Fate(job, (), time.perf_counter() + delay, held)
        if self._fails(job):
            fate.failed = tuple(int(i) for i in job.dst_ids)
            fate.result = JobResult(job.job_id, fate.failed, INJECTED, time.perf_counter())
        elif job.kind == "load" and self.fail_load_gpu_blocks:
            keep = ~np.isin(job.dst_ids, list(self.fail_load_gpu_blocks))
            fate.failed = tuple(int(i) for i in job.dst_ids[~keep])
            job = CopyJob(job.job_id, job.kind, job.event_id, job.src_ids[keep], job.dst_ids[keep])
        with self._lock:
            if fate.result is None:
                fate.chosen = self.stall is not None and self.stall(job)
                fate.behind = {j for j in job.after if j in self._fates and self._fates[j].stalled is not None}
                if fate.chosen or fate.behind:
                    fate.stalled = job
            self._fates[job.job_id] = fate
        if fate.result is None and fate.stalled is None:
            self.inner.submit(job)

    def release(self, job_id: int) -> None:
        with self._lock:
            if job_id not in self._fates:
                raise WorkerInvariantError(f"release({job_id}): no such job in flight")
            fate = self._fates[job_id]
            fate.held = fate.chosen = False
            ready = self._hand_on([job_id])
        for job in ready:
            self.inner.submit(job)

    def release_all(self) -> None:
        with self._lock:
            for fate in self._fates.values():
                fate.held = fate.chosen = False
                fate.behind.clear()
            ready = self._hand_on(list(self._fates))
        for job in ready:
            self.inner.submit(job)

    def _hand_on(self, job_ids: list[int]) -> list[CopyJob]:
        """The stalled jobs among `job_ids` that may go to the inner backend now, then the jobs behind them
        that may follow, in an order that keeps every job after those it follows. Caller holds the lock."""
        ready: list[CopyJob] = []
        todo = sorted(job_ids)
        while todo:
            fate = self._fates.get(todo.pop(0))
            if fate is None or fate.stalled is None or fate.chosen or fate.behind:
                continue
            job, fate.stalled = fate.stalled, None
            ready.append(job)
            for other_id, other in self._fates.items():
                if job.job_id in other.behind:
                    other.behind.discard(job.job_id)
                    todo.append(other_id)
        return ready

    def held_job_ids(self) -> list[int]:
        """Jobs held or stalled: waiting for `release`."""
        with self._lock:
            return [j for j, f in self._fates.items() if f.held or f.stalled is not None]

    def poll(self) -> list[JobResult]:
        now = time.perf_counter()
        out: list[JobResult] = []
        with self._lock:
            for r in self.inner.poll():
                fate = self._fates[r.job_id]
                failed = tuple(sorted(set(fate.failed) | set(r.failed_dst_ids)))
                error = "; ".join(e for e in (INJECTED if fate.failed else None, r.error) if e) or None
                fate.result = JobResult(r.job_id, failed, error, r.finished_at)
            for job_id, fate in list(self._fates.items()):
                if fate.result is not None and not fate.held and now >= fate.release_at:
                    out.append(fate.result)
                    del self._fates[job_id]
        return out

    def wait(self, job_ids: Collection[int] | None = None, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._lock:
            ids = list(self._fates) if job_ids is None else [j for j in job_ids if j in self._fates]
            held = [j for j in ids if self._fates[j].held or self._fates[j].stalled is not None]
            release_at = max((self._fates[j].release_at for j in ids), default=0.0)
        if held and deadline is None:
            raise WorkerInvariantError(f"wait() on held jobs {held} would block forever; release them first")
        self.inner.wait([j for j in ids if j not in held], timeout)
        if held:  # they cannot finish before their release: the wait lasts its whole timeout
            release_at = deadline
        elif deadline is not None:
            release_at = min(release_at, deadline)
        time.sleep(max(0.0, release_at - time.perf_counter()))

    def shutdown(self) -> None:
        self.inner.shutdown()
