"""The simulated CUDA device's memory: which bytes are device memory, which host ranges are registered.

Part of the simulated CUDA device (cuda_sim.py), for tests and benchmarks only. Device memory is what
`alloc` returned, owned by one device; host registrations (pinned ranges, `cudaHostRegister`) are tracked
by page, each made on one device, and two registrations never share a page. `copy_fault` judges a copy's
segments by CUDA's rules: each is device memory of the stream's device <-> host memory registered there
(or, for `pageable`, any host memory), inside one allocation or registration; anything else is a fault,
which the runtime records and raises. Keeps no lock: the runtime calls it under its own.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from worker_side.copy_plan import Segments

PAGE = 4096


class SimMemory:
    def __init__(self) -> None:
        self.device_memory: list[tuple[int, int, int, torch.Tensor]] = []  # (start, end, device, tensor)
        self.registrations: dict[int, tuple[int, int, int]] = {}  # ptr -> (end, device, first page)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> torch.Tensor:
        """Zeroed "device memory" of `device` (host memory the simulator treats as the GPU's)."""
        t = torch.zeros(shape, dtype=dtype)
        self.device_memory.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), device, t))
        return t

    def owner(self, ptr: int, nbytes: int) -> int | None:
        """The device whose memory holds [ptr, ptr + nbytes), None for host memory."""
        for start, end, device, _ in self.device_memory:
            if start <= ptr and ptr + nbytes <= end:
                return device
        return None

    def overlapping(self, ptr: int, nbytes: int) -> int | None:
        """The registration sharing a page with [ptr, ptr + nbytes), None when there is none."""
        first, last = ptr // PAGE, (ptr + nbytes - 1) // PAGE
        for p, (end, _, p_first) in self.registrations.items():
            if first <= (end - 1) // PAGE and p_first <= last:
                return p
        return None

    def register(self, ptr: int, nbytes: int, device: int) -> None:
        self.registrations[ptr] = (ptr + nbytes, device, ptr // PAGE)

    def unregister(self, ptr: int) -> bool:
        """Undo the registration at `ptr`; False when there is none."""
        return self.registrations.pop(ptr, None) is not None

    def host_ok(self, ptr: np.ndarray, nbytes: np.ndarray, device: int) -> np.ndarray:
        """Per segment: does [ptr, ptr + nbytes) lie inside one registration made on `device`?"""
        ok = np.zeros(len(ptr), bool)
        for start, (end, dev, _) in self.registrations.items():
            if dev == device:
                ok |= (ptr >= start) & (ptr + nbytes <= end)
        return ok

    def device_ok(self, ptr: np.ndarray, nbytes: np.ndarray, device: int) -> np.ndarray:
        """Per segment: does [ptr, ptr + nbytes) lie inside one allocation of `device`?"""
        ok = np.zeros(len(ptr), bool)
        for start, end, dev, _ in self.device_memory:
            if dev == device:
                ok |= (ptr >= start) & (ptr + nbytes <= end)
        return ok

    def table_registered(self, ptr: int, nbytes: int, device: int) -> bool:
        """Whether a kernel's argument table at [ptr, ptr + nbytes) lies in host memory registered on `device`."""
        return bool(self.host_ok(np.array([ptr], np.int64), np.array([nbytes], np.int64), device)[0])

    def device_copy_fault(self, op: str, device: int, segs: Segments) -> str | None:
        """The fault message if any segment is not device memory <-> device memory of `device`, else None."""
        ok = self.device_ok(segs.dst, segs.nbytes, device) & self.device_ok(segs.src, segs.nbytes, device)
        bad = np.flatnonzero(~ok)
        if not len(bad):
            return None
        i = int(bad[0])
        return (f"{op} on device {device}: {len(bad)} of {len(segs)} segments are not within device memory of "
                f"device {device} on both sides (first: dst {int(segs.dst[i]):#x}, src {int(segs.src[i]):#x}, "
                f"{int(segs.nbytes[i])} bytes)")

    def copy_fault(self, op: str, device: int, segs: Segments, pageable: bool = False) -> str | None:
        """The fault message if any segment is not device <-> registered host memory of `device`, else None."""
        d_dev, s_dev = self.device_ok(segs.dst, segs.nbytes, device), self.device_ok(segs.src, segs.nbytes, device)
        if pageable:
            d_host, s_host = ~d_dev, ~s_dev
        else:
            d_host, s_host = self.host_ok(segs.dst, segs.nbytes, device), self.host_ok(segs.src, segs.nbytes, device)
        bad = np.flatnonzero(~((d_dev & s_host) | (s_dev & d_host)))
        if not len(bad):
            return None
        i = int(bad[0])
        return (f"{op} on device {device}: {len(bad)} of {len(segs)} segments are not device memory of "
                f"device {device} <-> host memory registered there (first: dst {int(segs.dst[i]):#x}, "
                f"src {int(segs.src[i]):#x}, {int(segs.nbytes[i])} bytes; unregistered, straddling "
                "two registrations, or another device's)")


def read_int64(ptr: int, count: int) -> np.ndarray:
    """A copy of `count` int64 words of host memory at `ptr` (what a kernel reads from its argument tables)."""
    return np.frombuffer((ctypes.c_int64 * count).from_address(ptr), np.int64).copy()
