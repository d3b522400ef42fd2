"""The transfer backend interface: submit a job's block copies, learn when jobs finish.

A job copies `src_ids[i]` to `dst_ids[i]` for every registered tensor; `kind` says the direction (store:
engine KV cache -> host pool; load: host pool -> engine KV cache). Contract for implementations:
- `numa_node(device_views)` may name the host NUMA node the pool should live on (None: anywhere) and
  `host_layout(device_views)` the pool's physical layout (host_pool.py: `planes` or `blocks`); then the
  worker allocates the `HostPool` and calls `bind()` once, before any `submit()`. `bind` pins the pool
  where the backend needs it, synchronously (vLLM captures CUDA graphs right after registration).
- `submit()` never blocks on the copy; each submitted job produces exactly one `JobResult`, returned by
  exactly one `poll()` call, after its copies finished (or failed). A failed job lists the destination
  block ids whose bytes are not valid (all of them when unsure).
- `wait(job_ids, timeout)` blocks until those jobs have finished (their results are still returned by
  `poll()`), or `timeout` seconds passed (None: no limit).
- `sync_loads`: whether the engine thread should wait for a step's loads in `get_finished` (CPU: the copy
  is the only work in flight, and waiting makes a CPU hit resume the next step) or only poll (CUDA: loads
  overlap the forward and the engine thread never blocks on them).
- `job.after` names earlier jobs whose copies must be over before this job's copies start (a store
  writing host blocks that a load of the same step still reads); one no longer in flight, or unknown to
  the backend, is no constraint. A job waiting on a failed one still runs.
- `shutdown()` lets copies already running finish, fails queued ones, and is idempotent.
Shared bookkeeping (segments, job records, reports) lives outside the backends so CPU and CUDA agree.
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from worker_side.block_layout import TensorBlockView
from worker_side.host_pool import PLANES, HostPool

JobKind = Literal["load", "store"]


@dataclass(frozen=True, slots=True)
class CopyJob:
    job_id: int
    kind: JobKind
    event_id: int
    src_ids: np.ndarray  # int64; gpu ids for a store, cpu ids for a load
    dst_ids: np.ndarray  # int64; cpu ids for a store, gpu ids for a load
    after: tuple[int, ...] = ()  # job ids whose copies must be over before this job's start

    @property
    def num_blocks(self) -> int:
        return len(self.dst_ids)


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: int
    failed_dst_ids: tuple[int, ...] = ()  # empty: every block copied
    error: str | None = None
    finished_at: float = 0.0  # time.perf_counter() when the copies completed
    extra: dict[str, float] = field(default_factory=dict)
    path: str = ""  # the copy path it took (CUDA: staged, kernel, batch, per_segment, pageable; "" elsewhere)

    @property
    def ok(self) -> bool:
        return not self.failed_dst_ids and self.error is None


class TransferBackend(abc.ABC):
    """Moves block bytes between the engine's KV tensors and the host pool."""

    name: str = "abstract"
    sync_loads: bool = True

    def numa_node(self, device_views: list[TensorBlockView]) -> int | None:
        """The host NUMA node the pool should prefer (the GPU's), or None."""
        return None

    def host_layout(self, device_views: list[TensorBlockView]) -> str:
        """The host pool's physical layout this backend copies best (host_pool.HOST_LAYOUTS)."""
        return PLANES

    @abc.abstractmethod
    def bind(self, device_views: list[TensorBlockView], pool: HostPool) -> None:
        """Remember the engine tensors' and the host pool's block geometry (same order); pin the pool."""

    def begin_step(self) -> None:
        """A step begins: its forward is about to be launched (vLLM's bind_connector_metadata)."""
        return  # nothing to fence on backends without a compute stream

    def end_step(self) -> None:
        """The step's transfers are submitted and its completions collected."""
        return

    @abc.abstractmethod
    def submit(self, job: CopyJob) -> None:
        """Start the job's copies; never waits for them."""

    @abc.abstractmethod
    def poll(self) -> list[JobResult]:
        """Results of jobs finished since the previous poll (each job once)."""

    @abc.abstractmethod
    def wait(self, job_ids: Collection[int] | None = None, timeout: float | None = None) -> None:
        """Block until the given jobs (all submitted jobs when None) have finished, at most `timeout` s."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop: running copies finish, queued jobs fail. Idempotent."""
