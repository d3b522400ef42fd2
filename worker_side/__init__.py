"""worker_side: moves KV block bytes between the engine's KV cache and the host pool, asynchronously.

Imports nothing from `scheduler_side`; shares only `offload_connector` types (config, metadata, sizing).
Public API: `OffloadWorker` (see worker.py), the `TransferBackend` interface with `CpuBackend` and
`CudaBackend` (backends/cuda/backend.py, imported lazily: it needs CUDA at construction, not at import),
`resolve_backend_name` (what `transfer.backend` means in this process) and the errors. The test doubles
(the simulated CUDA device, `FaultyBackend`) live in worker_side/testing/.
"""

from worker_side.backends.base import CopyJob, JobResult, TransferBackend
from worker_side.backends.cpu import CpuBackend
from worker_side.backends.select import resolve_backend_name
from worker_side.errors import (
    BackendError,
    HostPoolError,
    LayoutError,
    WorkerClosedError,
    WorkerInvariantError,
)
from worker_side.host_pool import HostPool
from worker_side.worker import OffloadWorker

__all__ = [
    "BackendError", "CopyJob", "CpuBackend", "HostPool", "HostPoolError", "JobResult", "LayoutError",
    "OffloadWorker", "TransferBackend", "WorkerClosedError", "WorkerInvariantError", "resolve_backend_name",
]
