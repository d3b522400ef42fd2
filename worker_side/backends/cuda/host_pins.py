"""The host memory a CUDA backend registered (pinned): the pool's ranges and the kernels' arguments.

A part of the CUDA backend (backend.py). `pin(ranges)` registers every range or none: on a failure it
unregisters what it registered and re-raises. `keep(ptr)` records a registration made elsewhere (the kernels'
argument buffer, kernel_args.py). `release()` unregisters everything, once; the backend calls it at shutdown,
after every copy that could touch the memory has finished.
"""

from __future__ import annotations

from worker_side.backends.cuda.api import CudaRuntime


class HostPins:
    def __init__(self, rt: CudaRuntime) -> None:
        self.rt = rt
        self._ptrs: list[int] = []

    def pin(self, ranges: list[tuple[int, int]]) -> None:
        """Register each (ptr, nbytes) range; a CudaError leaves none of them registered."""
        done: list[int] = []
        try:
            for ptr, nbytes in ranges:
                self.rt.host_register(ptr, nbytes)
                done.append(ptr)
        except BaseException:
            for ptr in done:
                self.rt.host_unregister(ptr)
            raise
        self._ptrs += done

    def keep(self, ptr: int) -> None:
        self._ptrs.append(ptr)

    def release(self) -> None:
        ptrs, self._ptrs = self._ptrs, []
        for ptr in ptrs:
            self.rt.host_unregister(ptr)
