"""The simulated device's cost model: how long a copy or a kernel launch takes on a simulated stream.

Part of the simulated CUDA device (cuda_sim.py), for tests and benchmarks only; no figure here was measured
on a GPU. The model has the shape that makes choosing between the block-copy kernel and batched DMA a real
decision: DMA pays a fixed cost per call and per segment and then moves bytes at the copy engines' rate;
the kernel pays one launch and moves bytes at a lower rate. So the kernel wins on many small segments and
DMA on few large ones, with a crossover at `dma_segment_s / (1 / kernel_bytes_per_s - 1 / dma_bytes_per_s)`
bytes per segment (about 24 KiB with the defaults). The staged path's kernel (device memory on both sides)
pays a launch and moves bytes at `device_copy_bytes_per_s`; its host side is DMA of whole blocks. Deterministic: the calibration (calibration.py) run on
the simulated device picks the same thresholds every time, so a test can check that it picks the faster path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimTiming:
    dma_call_s: float = 4e-6  # one cuMemcpyAsync / cuMemcpyBatchAsync call
    dma_segment_s: float = 0.5e-6  # each segment of a batch
    dma_bytes_per_s: float = 50e9
    kernel_launch_s: float = 7e-6
    kernel_bytes_per_s: float = 25e9
    device_copy_bytes_per_s: float = 400e9  # the staged kernel: device memory on both sides

    def __post_init__(self) -> None:
        for name in ("dma_bytes_per_s", "kernel_bytes_per_s", "device_copy_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimTiming.{name}={getattr(self, name)}; allowed: > 0")

    def dma_fixed_seconds(self, num_segments: int) -> float:
        """A DMA call's costs besides its bytes (which share the link with other streams' copies)."""
        return self.dma_call_s + num_segments * self.dma_segment_s

    def dma_seconds(self, num_segments: int, nbytes: int) -> float:
        return self.dma_call_s + num_segments * self.dma_segment_s + nbytes / self.dma_bytes_per_s

    def kernel_seconds(self, nbytes: int) -> float:
        return self.kernel_launch_s + nbytes / self.kernel_bytes_per_s

    def device_copy_seconds(self, nbytes: int) -> float:
        return self.kernel_launch_s + nbytes / self.device_copy_bytes_per_s

    @property
    def crossover_bytes(self) -> float:
        """Segment size below which the kernel is faster, for jobs of many segments."""
        gap = 1 / self.kernel_bytes_per_s - 1 / self.dma_bytes_per_s
        return float("inf") if gap <= 0 else self.dma_segment_s / gap
