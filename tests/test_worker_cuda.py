"""CUDA backend: imports everywhere; round trips and compute ordering run only where a GPU exists."""

from __future__ import annotations

import pytest
import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import BackendError, OffloadWorker

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_backend_imports_without_cuda():
    from worker_side.cuda_backend import CudaBackend

    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="allowed here"):
            CudaBackend()
        with pytest.raises(BackendError):
            OffloadWorker(load_config({"transfer": {"backend": "cuda"}}))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_round_trip_after_pending_compute(dtype):
    w = OffloadWorker(load_config({"num_cpu_blocks": 16, "transfer": {"backend": "cuda"}}))
    kv = {f"l{i}": torch.zeros(32, 2, 16, 64, dtype=dtype, device="cuda") for i in range(2)}
    w.register_kv_caches(kv)
    assert w.backend.name == "cuda" and w.host_pool.nbytes == 16 * w.bytes_per_block
    # 1. the "forward" writes blocks 3..5 behind a long kernel; the store must see its result
    big = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        big = big @ big.T / 2048
    for t in kv.values():
        t[3:6] = 7
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[3, 4, 5], store_cpu_blocks=[1, 2, 3]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    # 2. load into blocks an earlier kernel still reads: the read sees the old value
    snapshot = torch.cat([t[10:13].float().sum().reshape(1) for t in kv.values()])
    w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=[10, 11, 12], load_cpu_blocks=[1, 2, 3],
                                  load_event_reqs=["r"], load_req_num_blocks=[3]))
    report = w.get_finished()
    assert report.finished_load_reqs == ["r"] and not report.failed_load_gpu_blocks
    assert snapshot.sum().item() == 0
    for t in kv.values():
        assert torch.equal(t[10:13], t[3:6])
    w.shutdown()


def test_a_failed_pin_fails_every_submit_not_just_the_first() -> None:
    """Runs without a GPU: the check precedes any CUDA call. A pool that could not be pinned must never be
    copied from as if it were (the first submit used to clear the error along with the pin thread)."""
    import numpy as np

    from worker_side.backend import CopyJob
    from worker_side.cuda_backend import CudaBackend
    from worker_side.errors import BackendError

    backend = CudaBackend.__new__(CudaBackend)  # no device here: set up only what submit reads first
    backend._closed, backend._device_views, backend._host_views = False, [], []
    backend._pin_thread, backend._pin_error = None, RuntimeError("cudaHostRegister: out of memory")
    backend._inflight = {}
    job = CopyJob(1, "store", 0, np.array([1]), np.array([1]))
    for _ in range(2):
        with pytest.raises(BackendError, match="pinning the host pool failed"):
            backend.submit(job)
