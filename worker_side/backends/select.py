"""Choosing a transfer backend from `config.transfer` (auto: cuda when torch sees a CUDA device, else cpu)."""

from __future__ import annotations

import torch

from offload_connector.config import OffloadConfig
from worker_side.backends.base import TransferBackend
from worker_side.backends.cpu import CpuBackend
from worker_side.errors import BackendError


def resolve_backend_name(requested: str) -> str:
    if requested not in ("auto", "cuda", "cpu"):
        raise BackendError(f"transfer.backend={requested!r}; allowed: auto, cuda, cpu")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise BackendError("transfer.backend='cuda' but torch sees no CUDA device; allowed here: auto, cpu")
    return requested


def make_backend(config: OffloadConfig) -> TransferBackend:
    name = resolve_backend_name(config.transfer.backend)
    if name == "cuda":
        from worker_side.backends.cuda.backend import CudaBackend

        t = config.transfer
        return CudaBackend(num_streams=t.num_streams, kernel_directions=t.kernel_directions,
                           kernel_max_segment_bytes=int(t.kernel_max_segment_bytes),
                           kernel_min_segments=t.kernel_min_segments, kernel_max_sms=t.kernel_max_sms,
                           calibrate=t.calibrate, staging_bytes=int(t.staging_bytes),
                           staged_max_ctas=t.staging_max_sms)
    return CpuBackend(num_threads=config.transfer.num_streams)
