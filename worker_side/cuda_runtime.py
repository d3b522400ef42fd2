"""`TorchCudaRuntime`: the real `CudaRuntime` (cuda_api.py), bound to the CUDA that torch already loaded.

What it binds to, and why:
- Devices, streams and events are torch's (`torch.cuda.Stream`, `torch.cuda.Event`): the engine's compute
  stream is a torch stream, and sharing torch's runtime means one context per device, never a second one.
- Host registration goes to the driver (`cuMemHostRegister`, portable and device-mapped) in the current
  device's primary context, torch's: no libcudart is loaded by file name, and unlike `cudaHostRegister` a
  failure leaves no sticky runtime error behind for torch's next kernel-launch check to report as its own.
- Copies go to the driver. `memcpy_batch` calls `cuMemcpyBatchAsync` (CUDA >= 12.8 drivers) through the raw
  function pointer that `cuGetProcAddress` (cuda-bindings) returns from the driver already in the process,
  called with ctypes over the numpy arrays' buffers: the cuda-bindings wrapper would convert every pointer
  to a Python object. Its ABI depends on the version asked for (`batch_prototype`). `memcpy` (the per-segment
  fallback) and `device_of` use the cuda-bindings Python API. Driver calls need a current context: the first
  one on a thread makes the current device's primary context (torch's) current if none is.
- The gather/scatter kernels (segment_copy.cu, next to this file) are compiled by NVRTC through cupy's
  `RawModule` on first use, once per device, and launched on torch's streams (`cupy.cuda.ExternalStream`).

Invariants: importing this module needs neither cupy nor cuda-bindings and loads no CUDA library beyond
torch; without a CUDA device `TorchCudaRuntime()` raises `BackendError`. `supports_batch` is True only when
`cuMemcpyBatchAsync` resolved, `supports_kernel` only when cupy imports and the kernels compile (a failure
is logged once per runtime). Failed calls raise `CudaError` naming the call, the sizes and CUDA's error.
NOT VERIFIED: it has not run on a GPU in this repository's CI, which has none; tests/test_cuda_kernel_source.py
only compiles segment_copy.cu and checks the parts that need no GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_side.cuda_api import CudaError, Event, Stream
from worker_side.errors import BackendError

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("segment_copy.cu")
KERNEL_NAMES = ("oc_block_copy",)
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65535  # the kernels grid-stride over the rest
_HOST_REGISTER_FLAGS = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP (the kernel reads it via UVA)
_SRC_ACCESS_ORDER_STREAM = 0x1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_CUDA_ERROR_INVALID_VALUE = 1
_CU_MEMORYTYPE_DEVICE = 2


class _MemLocation(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (cuda.h, CUDA 12.8 and 13)
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


def batch_prototype(driver_version: int) -> tuple[int, list[Any]] | None:
    """(CUDA version to ask `cuGetProcAddress` for, ctypes argtypes) of `cuMemcpyBatchAsync`, or None.

    (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] hStream): 12.8/12.9 drivers' symbol has
    `size_t *failIdx` before the stream; CUDA 13's (`cuMemcpyBatchAsync_v2` in cuda.h) has none.
    Drivers before 12.8 have no batch copy: None."""
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    head = [ptr, ptr, ptr, size, ptr, ptr, size]
    if driver_version >= 13000:
        return 13000, [*head, ptr]
    if driver_version >= 12080:
        return 12080, [*head, ptr, ptr]
    return None


def _driver_error(drv: Any, err: Any) -> str:
    code, name = drv.cuGetErrorName(drv.CUresult(int(err)))
    return name.decode() if int(code) == 0 and name else f"CUresult {int(err)}"


def _check(drv: Any, result: tuple, what: str) -> list[Any]:
    """cuda-bindings calls return (CUresult, *values): the values, or CudaError naming `what`."""
    err, *values = result
    if int(err) != 0:
        raise CudaError(f"{what} failed: {_driver_error(drv, err)}")
    return values


class TorchCudaRuntime:
    name = "torch-cuda"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise BackendError("transfer.backend cuda needs a CUDA device, but torch.cuda.is_available() is "
                               "False; allowed here: transfer.backend cpu")
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise BackendError("transfer.backend cuda needs cuda-bindings (the [cuda12] or [cuda13] extra, "
                               "matching the driver: pip install 'cuda-bindings>=12.8,<13' or 'cuda-bindings>=13,<14'); "
                               "allowed here: transfer.backend cpu") from exc
        self._drv = driver
        self._tls = threading.local()
        self._batch_fn, self._batch_has_fail_idx = self._resolve_batch()
        self.supports_batch = self._batch_fn is not None
        self._attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)  # zero hints, flags 0
        self._attr_idxs = (ctypes.c_size_t * 1)(0)

    def _resolve_batch(self) -> tuple[Any, bool]:
        drv = self._drv
        err, version = drv.cuDriverGetVersion()
        proto = batch_prototype(int(version)) if int(err) == 0 else None
        if proto is None:
            return None, False
        request, argtypes = proto
        result = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", request, 0)  # CU_GET_PROC_ADDRESS_DEFAULT
        if int(result[0]) != 0 or not result[1]:
            return None, False
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(result[1])), len(argtypes) == 9

    def _bind_context(self) -> None:
        """Once per thread: make the current device's primary context current if no context is."""
        if getattr(self._tls, "bound", False):
            return
        drv = self._drv
        (ctx,) = _check(drv, drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:
            device = torch.cuda.current_device()
            (ctx,) = _check(drv, drv.cuDevicePrimaryCtxRetain(drv.CUdevice(device)),
                            f"cuDevicePrimaryCtxRetain(device {device})")
            _check(drv, drv.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(device {device})")
        self._tls.bound = True

    # ---- devices and memory ownership ----------------------------------------------------------------
    def get_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: int) -> None:
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)

    def device_of(self, ptr: int, nbytes: int) -> int | None:
        self._bind_context()
        drv, attr = self._drv, self._drv.CUpointer_attribute
        err, mem_type = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if int(err) == _CUDA_ERROR_INVALID_VALUE:
            return None  # memory CUDA does not know: ordinary host memory
        _check(drv, (err,), f"cuPointerGetAttribute(MEMORY_TYPE, {ptr:#x})")
        if int(mem_type) != _CU_MEMORYTYPE_DEVICE:
            return None
        (ordinal,) = _check(drv, drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
                            f"cuPointerGetAttribute(DEVICE_ORDINAL, {ptr:#x})")
        return int(ordinal)

    def numa_node(self, device: int) -> int | None:
        props = torch.cuda.get_device_properties(device)
        pci = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        if None in pci:
            return None
        path = Path(f"/sys/bus/pci/devices/{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0/numa_node")
        try:
            node = int(path.read_text().strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    # ---- streams and events (current device) -----------------------------------------------------------
    def compute_stream(self) -> Stream:
        return torch.cuda.current_stream()

    def create_stream(self, low_priority: bool) -> Stream:
        priority = max(torch.cuda.Stream.priority_range()) if low_priority else 0  # larger = lower priority
        return torch.cuda.Stream(priority=priority)

    def create_event(self) -> Event:
        return torch.cuda.Event()

    def record_event(self, event: Event, stream: Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def query_event(self, event: Event) -> bool:
        return bool(event.query())

    def synchronize_event(self, event: Event) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: Stream) -> None:
        stream.synchronize()

    # ---- host memory ---------------------------------------------------------------------------------
    def host_register(self, ptr: int, nbytes: int) -> None:
        self._bind_context()
        _check(self._drv, self._drv.cuMemHostRegister(ptr, nbytes, _HOST_REGISTER_FLAGS),
               f"cuMemHostRegister({nbytes} bytes at {ptr:#x}, portable|devicemap)")

    def host_unregister(self, ptr: int) -> None:
        self._bind_context()
        _check(self._drv, self._drv.cuMemHostUnregister(ptr), f"cuMemHostUnregister({ptr:#x})")

    # ---- copies (each call below is one submission) ---------------------------------------------------
    def memcpy(self, dst: int, src: int, nbytes: int, stream: Stream, pageable: bool = False) -> None:
        self._bind_context()  # cuMemcpyAsync infers the direction (UVA) and stages pageable memory itself
        _check(self._drv, self._drv.cuMemcpyAsync(dst, src, nbytes, stream.cuda_stream),
               f"cuMemcpyAsync({nbytes} bytes, {src:#x} -> {dst:#x}, pageable={pageable})")

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: Stream) -> None:
        if self._batch_fn is None:
            raise CudaError("cuMemcpyBatchAsync: not available (driver before CUDA 12.8); check supports_batch")
        count = len(nbytes)
        if count == 0:
            return
        if stream.cuda_stream == 0:
            raise CudaError("cuMemcpyBatchAsync: the legacy default stream (0) is not allowed; use a created stream")
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, nbytes))
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
                           ctypes.addressof(self._attrs), ctypes.addressof(self._attr_idxs), 1]
        fail_idx = ctypes.c_size_t(0)
        if self._batch_has_fail_idx:
            args.append(ctypes.addressof(fail_idx))
        self._bind_context()
        err = self._batch_fn(*args, stream.cuda_stream)
        if err != 0:
            where = f", failIdx {fail_idx.value}" if self._batch_has_fail_idx else ""
            raise CudaError(f"cuMemcpyBatchAsync({count} segments, {int(sizes.sum())} bytes) failed: "
                            f"{_driver_error(self._drv, err)}{where}")

    @cached_property
    def _kernels(self) -> dict[str, Any] | None:
        try:
            import cupy

            module = cupy.RawModule(code=KERNEL_SOURCE.read_text(), backend="nvrtc")
            return {name: module.get_function(name) for name in KERNEL_NAMES}
        except Exception as exc:  # cupy missing, NVRTC missing or failing: the backend uses the copy engines
            logger.warning("segment-copy kernels unavailable (%s: %s); copies use the copy engines only",
                           type(exc).__name__, exc)
            return None

    @property
    def supports_kernel(self) -> bool:
        return self._kernels is not None

    def _launch(self, name: str, work_items: int, args: tuple, stream: Stream) -> None:
        kernels = self._kernels
        if kernels is None:
            raise CudaError(f"{name}: the segment-copy kernels are not available; check supports_kernel")
        if work_items <= 0:
            return
        import cupy

        blocks = min(work_items, MAX_BLOCKS)
        try:
            with cupy.cuda.Device(stream.device_index), \
                    cupy.cuda.ExternalStream(stream.cuda_stream, stream.device_index):
                kernels[name]((blocks,), (THREADS_PER_BLOCK,), args)
        except Exception as exc:
            raise CudaError(f"{name} launch ({work_items} copies, {blocks} blocks) failed: {exc}") from exc

    def launch_block_copy(self, planes_ptr: int, num_planes: int, ids_ptr: int, num_blocks: int,
                          stream: Stream) -> None:
        args = (np.int64(planes_ptr), np.int64(num_planes), np.int64(ids_ptr), np.int64(num_blocks))
        self._launch("oc_block_copy", num_planes * num_blocks, args, stream)
