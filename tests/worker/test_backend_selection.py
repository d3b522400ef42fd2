"""Which copy backend a worker gets: `transfer.backend` names (auto, cuda, cpu), the choice with and without
CUDA, and the options handed to the backend it builds."""

from __future__ import annotations

import pytest
import torch

from offload_connector import load_config
from worker_side import BackendError, CpuBackend, OffloadWorker
from worker_side.backends import select as backend_select


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without CUDA")
def test_backend_names_without_cuda():
    """Found by mutation testing of worker_side/backends/select.py (docs/mutation.md)."""
    assert backend_select.resolve_backend_name("auto") == "cpu"
    assert backend_select.resolve_backend_name("cpu") == "cpu"
    with pytest.raises(BackendError, match="torch sees no CUDA device"):
        backend_select.resolve_backend_name("cuda")
    with pytest.raises(BackendError, match="allowed: auto, cuda, cpu"):
        backend_select.resolve_backend_name("gpu")


class RecordingCudaBackend:
    def __init__(self, num_streams: int, **options) -> None:
        self.num_streams, self.options = num_streams, options


def test_backend_names_and_construction_with_cuda(monkeypatch):
    """Found by mutation testing of worker_side/backends/select.py (docs/mutation.md)."""
    import worker_side.backends.cuda.backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker_side.backends.cuda.backend, "CudaBackend", RecordingCudaBackend)
    assert backend_select.resolve_backend_name("auto") == "cuda"
    assert backend_select.resolve_backend_name("cuda") == "cuda"
    assert backend_select.resolve_backend_name("cpu") == "cpu"
    for requested in ("auto", "cuda"):
        backend = backend_select.make_backend(load_config({"transfer": {"backend": requested, "num_streams": 3}}))
        assert isinstance(backend, RecordingCudaBackend) and backend.num_streams == 3
        assert backend.options == {"kernel_directions": (), "kernel_max_segment_bytes": 28 << 10,
                                   "kernel_min_segments": 16, "kernel_max_sms": 12, "calibrate": True,
                                   "staging_bytes": 64 << 20, "staged_max_ctas": 16}
    transfer = {"backend": "cuda", "kernel_directions": ["store", "load"], "kernel_max_segment_bytes": "1MiB",
                "kernel_min_segments": 2, "kernel_max_sms": 4, "calibrate": False, "staging_bytes": "16MiB",
                "staging_max_sms": 3}
    backend = backend_select.make_backend(load_config({"transfer": transfer}))
    assert backend.options == {"kernel_directions": ("store", "load"), "kernel_max_segment_bytes": 1 << 20,
                               "kernel_min_segments": 2, "kernel_max_sms": 4, "calibrate": False,
                               "staging_bytes": 16 << 20, "staged_max_ctas": 3}
    backend = backend_select.make_backend(load_config({"transfer": {"backend": "cpu", "num_streams": 3}}))
    assert isinstance(backend, CpuBackend) and backend.num_threads == 3
    backend.shutdown()



def test_auto_backend_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    w = OffloadWorker(load_config({"num_cpu_blocks": 4}))
    assert w.backend.name == "cpu"
    w.shutdown()
