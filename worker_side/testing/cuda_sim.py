"""A simulated CUDA device: the `CudaRuntime` seam with host memory standing in for device memory.

For tests and benchmarks only (`pytest -m cudasim`, `bench_datapath.py --backend cuda-sim`); production
never constructs it. It follows the runtime seam's semantics (worker_side/backends/cuda/api.py) and turns what a real GPU would do silently wrong
into something a test sees:
- Streams are FIFO queues whose work runs only when the simulator decides (sim_streams.py): at each API
  call up to `burst` items run in the order `schedule` prefers ("copy_first" exposes a missing fence
  before a store or a load; "compute_first"; "random"; "copy_lag" queues many jobs at once, so anything
  released before its job ran gets reused), seeded. Waits and events behave as CUDA's (a wait captures
  the event's latest record at call time); `synchronize_*` runs work until the event or stream is done.
  The fake engine's forward runs as work on a compute stream (`launch_host_work`, sim_compute.py's `SimCompute`), so a copy
  that races the forward corrupts KV and the fake model's check fails.
- The calling thread's current device is tracked (a new thread starts on device 0); every call that
  touches a stream, event or memory checks it matches, and `devices_touched[thread id]` records every
  device a thread used (a context created on the wrong GPU shows up there).
- Memory (`memory`, sim_memory.py): a copy or kernel that breaks CUDA's rules on device memory and host
  registrations is a *fault*: recorded in `faults` (tests assert it stays empty) and raised as `CudaError`
  where CUDA would refuse the call.
- `device_of` is a driver call (it needs a context, so it counts as touching the current device);
  `tensor_device` is framework metadata (torch's `tensor.device`) and touches nothing.
- A device-to-host `memcpy(pageable=True)` blocks the calling thread until the copy ran (CUDA's rule for
  pageable destinations), so it waits for everything queued before it on its stream; `host_blocked` lists
  (thread id, call) for every call that made a thread wait that way.
- `fail_register` / `max_register_bytes` make `host_register` fail (pinning fallback, chunking);
  `supports_batch` / `supports_kernel` switch the batched copy and the kernel off (fallback paths);
  `host_pointer_for_registered_mem=False` is a device whose kernels cannot read registered host memory
  through its host address (a kernel launched there anyway is a fault); `fail_kernel_launches` makes the
  next N launches fail as a driver would (nothing enqueued). `num_sms` and `kernel_max_sms` give the grid
  cap; `kernel_grids` lists the grid of every launch.
- Time is simulated (`timing`, sim_timing.SimTiming): each copy or kernel advances its stream's clock, and
  timing events (`create_event(timing=True)`, `elapsed_s`) read it, deterministically.
`calls` counts API calls by name; `self_time` is the time spent inside this simulator's calls, so a
benchmark can subtract it and keep only the backend's own host time.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from worker_side.backends.cpu import run_segments
from worker_side.backends.cuda.api import CudaError
from worker_side.copy_plan import Segments
from worker_side.testing.sim_kernels import block_copy_fault, staged_copy_fault, table_bytes, table_segments
from worker_side.testing.sim_memory import SimMemory
from worker_side.testing.sim_streams import SCHEDULES, SimEvent, SimStream, SimWork, StreamScheduler
from worker_side.testing.sim_timing import SimTiming

__all__ = ["SCHEDULES", "SimCudaRuntime", "SimTiming"]


class SimCudaRuntime:
    name = "cuda-sim"

    def __init__(self, num_devices: int = 1, schedule: str = "random", seed: int = 0, burst: int = 3,
                 supports_batch: bool = True, supports_kernel: bool = True, fail_register: bool = False,
                 max_register_bytes: int | None = None, numa_nodes: dict[int, int] | None = None,
                 copy_bytes: bool = True, num_sms: int = 132, kernel_max_sms: int = 12,
                 host_pointer_for_registered_mem: bool = True, fail_kernel_launches: int = 0,
                 timing: SimTiming | None = None, device_memory_limit: int | None = None) -> None:
        self._queues = StreamScheduler(schedule, seed, burst)
        self.num_devices, self.schedule = num_devices, schedule
        self.supports_batch, self.supports_kernel = supports_batch, supports_kernel
        self.fail_register, self.max_register_bytes = fail_register, max_register_bytes
        self.numa_nodes = dict(numa_nodes or {})
        self.sms, self.kernel_max_sms = num_sms, kernel_max_sms
        self.host_pointer_for_registered_mem = host_pointer_for_registered_mem
        self.fail_kernel_launches = fail_kernel_launches  # the next N launches fail, enqueuing nothing
        self.timing = timing if timing is not None else SimTiming()
        self.device_memory_limit = device_memory_limit  # bytes per device; None: unlimited
        self.kernel_grids: list[int] = []  # thread blocks of each launch
        self.host_blocked: list[tuple[int, str]] = []  # (thread id, call) of calls that waited for the device
        # False (submission benchmarks): calls are still checked, but queued work moves no bytes and the kernel
        # does not expand its block ids (that would evict the caches the next timed submission runs on)
        self.copy_bytes = copy_bytes
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._compute = [SimStream(d, f"compute{d}", True) for d in range(num_devices)]
        self._queues.streams.extend(self._compute)
        self.memory = SimMemory()
        self.faults: list[str] = []
        self.calls: Counter[str] = Counter()
        self.devices_touched: dict[int, set[int]] = {}
        self.self_time = 0.0

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _enter(self, op: str) -> int:
        """Count the call, note the device it touches, let queued work advance; returns the current device."""
        device = self.get_device()
        self.calls[op] += 1
        self.devices_touched.setdefault(threading.get_ident(), set()).add(device)
        self._queues.tick()
        return device

    def _fault(self, message: str) -> str:
        self.faults.append(message)
        return message

    def _same_device(self, op: str, device: int, *objs: SimStream | SimEvent) -> None:
        for obj in objs:
            if obj.device != device:
                raise CudaError(self._fault(f"{op}: {type(obj).__name__} of device {obj.device} used while "
                                            f"device {device} is current (cudaErrorInvalidResourceHandle)"))

    # ---- devices and memory ----------------------------------------------------------------------------
    def get_device(self) -> int:
        return getattr(self._tls, "device", 0)

    def set_device(self, device: int) -> None:
        if not 0 <= device < self.num_devices:
            raise CudaError(f"cudaSetDevice({device}): cudaErrorInvalidDevice ({self.num_devices} devices)")
        if device != self.get_device():
            self._tls.device = device
            self._enter("set_device")

    def alloc_device(self, shape: tuple[int, ...], dtype: torch.dtype, device: int = 0) -> torch.Tensor:
        """Zeroed "device memory" of `device` (host memory the simulator treats as the GPU's)."""
        with self._lock:
            return self.memory.alloc(shape, dtype, device)

    @property
    def registrations(self) -> dict[int, tuple[int, int, int]]:
        """Host registrations: ptr -> (end, device, first page)."""
        return self.memory.registrations

    def device_of(self, ptr: int, nbytes: int) -> int | None:
        with self._lock:
            self._enter("device_of")  # a driver call: it runs in (and may create) the current device's context
            return self.memory.owner(ptr, nbytes)

    def tensor_device(self, tensor: torch.Tensor) -> int | None:
        return self.memory.owner(tensor.data_ptr(), 1)  # framework metadata: no driver call

    def numa_node(self, device: int) -> int | None:
        return self.numa_nodes.get(device)

    def num_sms(self, device: int) -> int:
        return self.sms

    def can_use_host_pointer(self, device: int) -> bool:
        return self.host_pointer_for_registered_mem

    @property
    def kernel_error(self) -> str | None:
        return None if self.supports_kernel else "switched off on the simulated device (supports_kernel=False)"

    def close(self) -> None:
        self.calls["close"] += 1

    # ---- streams and events --------------------------------------------------------------------------
    def compute_stream(self) -> SimStream:
        with self._lock:
            return self._compute[self._enter("compute_stream")]

    def create_stream(self, low_priority: bool, high_priority: bool = False) -> SimStream:
        with self._lock:
            device = self._enter("create_stream")
            s = SimStream(device, f"copy{device}.{len(self.streams)}{'-low' if low_priority else ''}", False)
            self._queues.streams.append(s)
            return s

    def create_event(self, timing: bool = False) -> SimEvent:
        with self._lock:
            return SimEvent(self._enter("create_event"), timing)

    def record_event(self, event: SimEvent, stream: SimStream) -> None:
        with self._lock:
            self._same_device("record_event", self._enter("record_event"), event, stream)
            event.record(stream)

    def elapsed_s(self, start: SimEvent, end: SimEvent) -> float:
        with self._lock:
            self._enter("elapsed_s")
            return start.elapsed_s(end)

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        with self._lock:
            self._same_device("wait_event", self._enter("wait_event"), stream)
            if event.target is not None:
                self._queues.push(stream, SimWork("wait", wait=event.target))

    def query_event(self, event: SimEvent) -> bool:
        with self._lock:
            self._same_device("query_event", self._enter("query_event"), event)
            return event.done()

    def synchronize_event(self, event: SimEvent) -> None:
        with self._lock:
            self._enter("synchronize_event")
            self._queues.run_until(event.done, "synchronize_event")

    def synchronize_stream(self, stream: SimStream) -> None:
        with self._lock:
            self._same_device("synchronize_stream", self._enter("synchronize_stream"), stream)
            self._queues.run_until(lambda: stream.completed == stream.enqueued, "synchronize_stream")

    # ---- host memory -----------------------------------------------------------------------------------
    def host_register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            device = self._enter("host_register")
            if self.fail_register:
                raise CudaError(f"cudaHostRegister({nbytes} bytes): cudaErrorMemoryAllocation (simulated)")
            if self.max_register_bytes is not None and nbytes > self.max_register_bytes:
                raise CudaError(f"cudaHostRegister({nbytes} bytes): cudaErrorInvalidValue (over the simulated "
                                f"limit of {self.max_register_bytes} bytes)")
            p = self.memory.overlapping(ptr, nbytes)
            if p is not None:
                raise CudaError(self._fault(f"cudaHostRegister({ptr:#x}, {nbytes}): shares a page with the "
                                            f"registration at {p:#x} (cudaErrorHostMemoryAlreadyRegistered)"))
            self.memory.register(ptr, nbytes, device)

    def host_unregister(self, ptr: int) -> None:
        with self._lock:
            self._enter("host_unregister")
            if not self.memory.unregister(ptr):
                raise CudaError(f"cudaHostUnregister({ptr:#x}): cudaErrorHostMemoryNotRegistered")

    # ---- copies ------------------------------------------------------------------------------------------
    def memcpy(self, dst: int, src: int, nbytes: int, stream: SimStream, pageable: bool = False) -> None:
        self._copy("memcpy", Segments(*(np.array([x], np.int64) for x in (dst, src, nbytes))), stream, pageable)

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: SimStream) -> None:
        if not self.supports_batch:
            raise CudaError("cuMemcpyBatchAsync: CUDA_ERROR_NOT_SUPPORTED (simulated driver < 12.8)")
        self._copy("memcpy_batch", Segments(dst.copy(), src.copy(), nbytes.copy()), stream, False)

    def _copy(self, op: str, segs: Segments, stream: SimStream, pageable: bool) -> None:
        t0 = time.perf_counter()
        with self._lock:
            device = self._enter(op)
            self._same_device(op, device, stream)
            fault = self.memory.copy_fault(op, device, segs, pageable)
            if fault is not None:
                raise CudaError(self._fault(fault))
            to_host = bool(self.memory.device_ok(segs.src[:1], segs.nbytes[:1], device).any())
            self._queues.push(stream, SimWork("copy", run=lambda: self._move(segs),
                                              seconds=self.timing.dma_fixed_seconds(len(segs)),
                                              link=(device, "d2h" if to_host else "h2d"),
                                              link_seconds=segs.total_bytes / self.timing.dma_bytes_per_s))
            if pageable and not self.memory.device_ok(segs.dst, segs.nbytes, device).any():
                # device -> pageable host: the call returns only once the copy ran, after all before it
                position = stream.enqueued
                self.host_blocked.append((threading.get_ident(), f"{op} device->pageable host"))
                self._queues.run_until(lambda: stream.completed >= position, f"{op} (pageable destination)")
        self.self_time += time.perf_counter() - t0

    def _move(self, segs: Segments) -> None:
        if self.copy_bytes:
            run_segments(segs)

    def _check_launch(self, what: str) -> None:
        """A kernel launch the device refuses: no kernel here, or a simulated launch failure (nothing queued)."""
        if not self.supports_kernel:
            raise CudaError(f"{what}: not available (simulated)")
        if self.fail_kernel_launches > 0:
            self.fail_kernel_launches -= 1
            raise CudaError("cuLaunchKernel: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (simulated failure)")

    def launch_block_copy(self, planes_ptr: int, num_planes: int, ids_ptr: int, num_blocks: int,
                          stream: SimStream) -> None:
        t0 = time.perf_counter()
        with self._lock:
            device = self._enter("launch_block_copy")
            self._same_device("launch_block_copy", device, stream)
            self._check_launch("block-copy kernel")
            fault = block_copy_fault(self.memory, device, planes_ptr, num_planes, ids_ptr, num_blocks,
                                     self.host_pointer_for_registered_mem)
            if fault is not None:
                raise CudaError(self._fault(fault))
            self.kernel_grids.append(min(num_planes * num_blocks, max(1, min(self.kernel_max_sms, self.sms))))
            seconds = self.timing.kernel_seconds(table_bytes(planes_ptr, num_planes) * num_blocks)
            self._push_table_kernel(stream, device, "block-copy kernel", planes_ptr, num_planes, ids_ptr,
                                    ids_ptr + 8 * num_blocks, num_blocks, self.memory.copy_fault, seconds)
        self.self_time += time.perf_counter() - t0

    def _push_table_kernel(self, stream: SimStream, device: int, what: str, planes_ptr: int, num_planes: int,
                           src_ids_ptr: int, dst_ids_ptr: int, num_blocks: int,
                           fault_of: Callable[[str, int, Segments], str | None], seconds: float) -> None:
        """Queue a kernel that reads its plane table and block ids when it runs (not at launch) and copies
        chunk p of every block pair, unless `fault_of` finds a segment CUDA would fault on."""
        def run() -> None:
            if not self.copy_bytes:
                return
            segs = table_segments(planes_ptr, num_planes, src_ids_ptr, dst_ids_ptr, num_blocks)
            fault = fault_of(what, device, segs)
            if fault is None:
                run_segments(segs)
            else:
                self._fault(fault)

        self._queues.push(stream, SimWork("kernel", run=run, seconds=seconds))

    def launch_staged_copy(self, planes_ptr: int, num_planes: int, src_ids_ptr: int, dst_ids_ptr: int,
                           num_blocks: int, stream: SimStream, max_blocks: int) -> None:
        t0 = time.perf_counter()
        with self._lock:
            device = self._enter("launch_staged_copy")
            self._same_device("launch_staged_copy", device, stream)
            self._check_launch("staged-copy kernel")
            fault = staged_copy_fault(self.memory, device, planes_ptr, num_planes, src_ids_ptr, dst_ids_ptr,
                                      num_blocks)
            if fault is not None:
                raise CudaError(self._fault(fault))
            self.kernel_grids.append(min(-(-num_planes * num_blocks // 8), max(1, min(max_blocks, self.sms))))
            seconds = self.timing.device_copy_seconds(table_bytes(planes_ptr, num_planes) * num_blocks)
            self._push_table_kernel(stream, device, "staged-copy kernel", planes_ptr, num_planes, src_ids_ptr,
                                    dst_ids_ptr, num_blocks, self.memory.device_copy_fault, seconds)
        self.self_time += time.perf_counter() - t0

    def alloc_device_bytes(self, nbytes: int) -> torch.Tensor:
        """The seam's `alloc_device_bytes`: `nbytes` of the current device's memory (`device_memory_limit` caps the
        total, as a full GPU would)."""
        with self._lock:
            device = self._enter("alloc_device")
            used = sum(end - start for start, end, dev, _ in self.memory.device_memory if dev == device)
            if self.device_memory_limit is not None and used + nbytes > self.device_memory_limit:
                raise CudaError(f"cudaMalloc({nbytes}): cudaErrorMemoryAllocation (simulated: {used} of "
                                f"{self.device_memory_limit} bytes in use)")
            return self.memory.alloc((nbytes,), torch.uint8, device)

    def launch_host_work(self, stream: SimStream, fn: Callable[[], None]) -> None:
        """Enqueue `fn` as a kernel on `stream` (the fake model's forward: reads and writes of KV blocks)."""
        with self._lock:
            self._same_device("launch_host_work", self._enter("launch_host_work"), stream)
            self._queues.push(stream, SimWork("compute", run=fn))

    def drain(self) -> None:
        """Run every queued item (tests, end of a run)."""
        with self._lock:
            self._queues.drain()

    @property
    def streams(self) -> list[SimStream]:
        return self._queues.streams

    @property
    def errors(self) -> list[BaseException]:
        return self._queues.errors

    @property
    def num_queued(self) -> int:
        return self._queues.num_queued

