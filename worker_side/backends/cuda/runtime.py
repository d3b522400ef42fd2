"""`TorchCudaRuntime`: the real `CudaRuntime` (api.py), bound to the CUDA that torch already loaded.

What it binds to, and why:
- Devices, streams and events are torch's (`torch.cuda.Stream`, `torch.cuda.Event`): the engine's compute
  stream is a torch stream, and sharing torch's runtime means one context per device, never a second one.
- Host registration goes to the driver (`cuMemHostRegister`, portable and device-mapped) in the current
  device's primary context, torch's: no libcudart is loaded by file name, and unlike `cudaHostRegister` a
  failure leaves no sticky runtime error behind for torch's next kernel-launch check to report as its own.
- Copies go to the driver. `memcpy_batch` calls `cuMemcpyBatchAsync` (CUDA >= 12.8 drivers) through the raw
  function pointer that `cuGetProcAddress` (cuda-bindings) returns from the driver already in the process,
  called with ctypes over the numpy arrays' buffers: the cuda-bindings wrapper would convert every pointer
  to a Python object. Its ABI depends on the version asked for (`batch_prototype`); `failIdx` (12.x ABI)
  starts at SIZE_MAX and is reported only when the driver set it. `memcpy` (the per-segment fallback),
  `device_of` and the device attributes use the cuda-bindings Python API. Driver calls need a current
  context: the first one on a thread makes the current device's primary context (torch's) current if none
  is, retaining it; `close()` releases every context this runtime retained.
- Driver errors: an error code the installed cuda-bindings cannot name (723, 1000, ...: their calls raise
  KeyError for it in 12.9 and 13.0, ValueError in 13.5, and `CUresult(code)` raises ValueError) still
  becomes a `CudaError` naming the call and the number.
- The block-copy kernels (segment_copy.cu, loaded and launched by kernel.py) are compiled on first use of
  `supports_kernel` for the current device; `kernel_error` says why they are not available. A grid is at most
  `kernel_max_sms` thread blocks (the staged kernel: the caller's `max_blocks`), never more than the device's
  SM count.
- Device memory (`alloc_device_bytes`: the staging ring and its plane tables) comes from torch's allocator, so
  it is the engine's memory as torch accounts for it.

Invariants: importing this module needs neither cupy nor cuda-bindings and loads no CUDA library beyond
torch; without a CUDA device `TorchCudaRuntime()` raises `BackendError`. `supports_batch` is True only when
`cuMemcpyBatchAsync` resolved, `supports_kernel` only when cupy imports, matches torch's CUDA major and the
kernel compiles. Failed calls raise `CudaError` naming the call, the sizes and CUDA's error.
NOT VERIFIED: it has not run on a GPU in this repository's CI, which has none; the tests without a GPU
drive it through fake drivers and a fake cupy only (tests/cuda_path/test_cuda_runtime_fakes.py), and compile
segment_copy.cu (tests/cuda_path/test_cuda_kernel_source.py). scripts/gpu_check.sh is the prepared GPU run.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_side.backends.cuda.api import CudaError, Event, Stream
from worker_side.backends.cuda.kernel import KERNEL_NAMES, KERNEL_SOURCE, LAUNCH_ARGTYPES, BlockCopyKernel
from worker_side.backends.cuda.kernel_policy import KERNEL_MAX_SMS
from worker_side.errors import BackendError

logger = logging.getLogger(__name__)

__all__ = ["KERNEL_NAMES", "KERNEL_SOURCE", "TorchCudaRuntime", "batch_prototype"]

SIZE_MAX = (1 << 64) - 1  # failIdx before the driver writes it (cuMemcpyBatchAsync, 12.x ABI)
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
    """CUDA's name for a CUresult, or its number where the installed bindings do not know it."""
    code = int(err)
    try:
        res, name = drv.cuGetErrorName(drv.CUresult(code))
        return name.decode() if int(res) == 0 and name else f"CUresult {code}"
    except Exception:  # the bindings' CUresult enum has no member for this code (ValueError: 723, 1000, ...)
        return f"CUresult {code} (unknown to the installed cuda-bindings)"


def _check(drv: Any, result: tuple, what: str) -> list[Any]:
    """cuda-bindings calls return (CUresult, *values): the values, or CudaError naming `what`."""
    err, *values = result
    if int(err) != 0:
        raise CudaError(f"{what} failed: {_driver_error(drv, err)}")
    return values


def _call(drv: Any, what: str, fn: Any, *args: Any) -> list[Any]:
    """A cuda-bindings call checked by `_check`; the ValueError the bindings raise when the driver returns
    a code their enum does not know becomes a CudaError too."""
    try:
        result = fn(*args)
    except (KeyError, ValueError) as exc:  # KeyError: cuda-bindings 12.9 / 13.0; ValueError: 13.5
        raise CudaError(f"{what} failed: the driver returned an error the installed cuda-bindings cannot name "
                        f"({type(exc).__name__}: {exc})") from exc
    return _check(drv, result, what)


class TorchCudaRuntime:
    name = "torch-cuda"

    def __init__(self, kernel_max_sms: int = KERNEL_MAX_SMS) -> None:
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
        self.kernel_max_sms = kernel_max_sms
        self._kernel = BlockCopyKernel(self._resolve_launch())
        self._retained: list[int] = []  # devices whose primary context a thread of ours retained (one per retain)
        self._retain_lock = threading.Lock()
        self._sms: dict[int, int] = {}  # SM count per device, asked once

    def _resolve_batch(self) -> tuple[Any, bool]:
        drv = self._drv
        try:
            (version,) = _call(drv, "cuDriverGetVersion", drv.cuDriverGetVersion)
            proto = batch_prototype(int(version))
            if proto is None:
                return None, False
            request, argtypes = proto
            # (pfn,) or (pfn, symbolStatus), depending on the bindings' version
            fn = _call(drv, "cuGetProcAddress(cuMemcpyBatchAsync)", drv.cuGetProcAddress,
                       b"cuMemcpyBatchAsync", request, 0)[0]  # CU_GET_PROC_ADDRESS_DEFAULT
        except CudaError as exc:
            logger.warning("offload: no batched copies (%s); copies go one call per segment", exc)
            return None, False
        if not fn:
            return None, False
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(fn)), len(argtypes) == 9

    def _resolve_launch(self) -> Any:
        """The driver's cuLaunchKernel as a ctypes function (kernel.py launches through it), or None."""
        drv = self._drv
        try:
            fn = _call(drv, "cuGetProcAddress(cuLaunchKernel)", drv.cuGetProcAddress, b"cuLaunchKernel", 12000, 0)[0]
        except CudaError:
            return None
        return ctypes.CFUNCTYPE(ctypes.c_int, *LAUNCH_ARGTYPES)(int(fn)) if fn else None

    def _bind_context(self) -> None:
        """Once per thread: make the current device's primary context current if no context is (retaining
        it: `close()` releases it)."""
        if getattr(self._tls, "bound", False):
            return
        drv = self._drv
        (ctx,) = _call(drv, "cuCtxGetCurrent", drv.cuCtxGetCurrent)
        if int(ctx) == 0:
            device = torch.cuda.current_device()
            (ctx,) = _call(drv, f"cuDevicePrimaryCtxRetain(device {device})", drv.cuDevicePrimaryCtxRetain,
                           drv.CUdevice(device))
            with self._retain_lock:
                self._retained.append(device)
            _call(drv, f"cuCtxSetCurrent(device {device})", drv.cuCtxSetCurrent, ctx)
        self._tls.bound = True

    def close(self) -> None:
        """Release every primary context this runtime retained (once each). Idempotent."""
        with self._retain_lock:
            retained, self._retained = self._retained, []
        drv = self._drv
        for device in retained:
            try:
                _call(drv, f"cuDevicePrimaryCtxRelease(device {device})", drv.cuDevicePrimaryCtxRelease,
                      drv.CUdevice(device))
            except CudaError as exc:  # at shutdown: say so, release the others
                logger.warning("offload: %s", exc)

    # ---- devices and memory ownership ----------------------------------------------------------------
    def get_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: int) -> None:
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)

    def device_of(self, ptr: int, nbytes: int) -> int | None:
        self._bind_context()
        drv, attr = self._drv, self._drv.CUpointer_attribute
        what = f"cuPointerGetAttribute(MEMORY_TYPE, {ptr:#x})"
        try:
            err, mem_type = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        except (KeyError, ValueError) as exc:  # a code the bindings cannot name (see `_call`)
            raise CudaError(f"{what} failed: an error the installed cuda-bindings cannot name "
                            f"({type(exc).__name__}: {exc})") from exc
        if int(err) == _CUDA_ERROR_INVALID_VALUE:
            return None  # memory CUDA does not know: ordinary host memory
        _check(drv, (err,), what)
        if int(mem_type) != _CU_MEMORYTYPE_DEVICE:
            return None
        (ordinal,) = _call(drv, f"cuPointerGetAttribute(DEVICE_ORDINAL, {ptr:#x})", drv.cuPointerGetAttribute,
                           attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        return int(ordinal)

    def tensor_device(self, tensor: torch.Tensor) -> int | None:
        return tensor.device.index if tensor.device.type == "cuda" else None

    def _attribute(self, name: str, device: int) -> int:
        drv = self._drv
        (value,) = _call(drv, f"cuDeviceGetAttribute({name}, device {device})", drv.cuDeviceGetAttribute,
                         getattr(drv.CUdevice_attribute, name), drv.CUdevice(device))
        return int(value)

    def num_sms(self, device: int) -> int:
        return self._attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", device)

    def can_use_host_pointer(self, device: int) -> bool:
        return self._attribute("CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", device) == 1

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

    def create_stream(self, low_priority: bool, high_priority: bool = False) -> Stream:
        lowest, highest = max(torch.cuda.Stream.priority_range()), min(torch.cuda.Stream.priority_range())
        priority = highest if high_priority else lowest if low_priority else 0  # larger = lower priority
        return torch.cuda.Stream(priority=priority)

    def create_event(self, timing: bool = False) -> Event:
        return torch.cuda.Event(enable_timing=timing)

    def elapsed_s(self, start: Event, end: Event) -> float:
        return start.elapsed_time(end) / 1e3  # torch: milliseconds from start to end

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
        _call(self._drv, f"cuMemHostRegister({nbytes} bytes at {ptr:#x}, portable|devicemap)",
              self._drv.cuMemHostRegister, ptr, nbytes, _HOST_REGISTER_FLAGS)

    def host_unregister(self, ptr: int) -> None:
        self._bind_context()
        _call(self._drv, f"cuMemHostUnregister({ptr:#x})", self._drv.cuMemHostUnregister, ptr)

    # ---- copies (each call below is one submission) ---------------------------------------------------
    def memcpy(self, dst: int, src: int, nbytes: int, stream: Stream, pageable: bool = False) -> None:
        self._bind_context()  # cuMemcpyAsync infers the direction (UVA) and stages pageable memory itself
        _call(self._drv, f"cuMemcpyAsync({nbytes} bytes, {src:#x} -> {dst:#x}, pageable={pageable})",
              self._drv.cuMemcpyAsync, dst, src, nbytes, stream.cuda_stream)

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
        fail_idx = ctypes.c_size_t(SIZE_MAX)  # the driver writes it only for a failure it can pin on a copy
        if self._batch_has_fail_idx:
            args.append(ctypes.addressof(fail_idx))
        self._bind_context()
        err = self._batch_fn(*args, stream.cuda_stream)
        if err != 0:
            where = f", failIdx {fail_idx.value}" if fail_idx.value != SIZE_MAX else ""
            raise CudaError(f"cuMemcpyBatchAsync({count} segments, {int(sizes.sum())} bytes) failed: "
                            f"{_driver_error(self._drv, err)}{where}")

    @property
    def supports_kernel(self) -> bool:
        """Loads (compiles) the kernel for the current device on first use."""
        return self._kernel.load(torch.cuda.current_device())

    @property
    def kernel_error(self) -> str | None:
        return None if self.supports_kernel else self._kernel.error

    def launch_block_copy(self, planes_ptr: int, num_planes: int, ids_ptr: int, num_blocks: int,
                          stream: Stream) -> None:
        sms = self._sms_of(stream.device_index)
        self._kernel.launch_block_copy(planes_ptr, num_planes, ids_ptr, num_blocks, stream,
                                       max(1, min(self.kernel_max_sms, sms)))

    def launch_staged_copy(self, planes_ptr: int, num_planes: int, src_ids_ptr: int, dst_ids_ptr: int,
                           num_blocks: int, stream: Stream, max_blocks: int) -> None:
        sms = self._sms_of(stream.device_index)
        self._kernel.launch_staged_copy(planes_ptr, num_planes, src_ids_ptr, dst_ids_ptr, num_blocks, stream,
                                        max(1, min(max_blocks, sms)))

    # ---- device memory -----------------------------------------------------------------------------------
    def alloc_device_bytes(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the current device's memory (torch's caching allocator: the engine's own pool, counted
        in `torch.cuda.memory_allocated`); CudaError when the device has no room."""
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{torch.cuda.current_device()}")
        except torch.cuda.OutOfMemoryError as exc:
            raise CudaError(f"allocating {nbytes} bytes of device memory failed: {exc}".splitlines()[0]) from exc

    def _sms_of(self, device: int) -> int:
        if device not in self._sms:
            self._sms[device] = self.num_sms(device)
        return self._sms[device]
