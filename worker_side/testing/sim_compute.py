"""`SimCompute`: the fake engine's compute queue on a simulated device (cuda_sim.py): the forward runs as
work on the device's compute stream, when the simulator says, so a copy that races it corrupts KV."""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker_side.testing.cuda_sim import SimCudaRuntime


class SimCompute:
    def __init__(self, rt: SimCudaRuntime, device: int = 0) -> None:
        self.rt, self.device = rt, device

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.rt.alloc_device(shape, dtype, self.device)

    def _raise_errors(self) -> None:
        if self.rt.errors:
            raise self.rt.errors[0]

    def launch(self, fn: Callable[[], None]) -> None:
        self._raise_errors()
        if self.rt.get_device() != self.device:
            self.rt.set_device(self.device)
        self.rt.launch_host_work(self.rt.compute_stream(), fn)

    def synchronize(self) -> None:
        if self.rt.get_device() != self.device:
            self.rt.set_device(self.device)
        self.rt.synchronize_stream(self.rt.compute_stream())
        self._raise_errors()
