"""The block-copy kernel on a real GPU: compiled by NVRTC through cupy, launched on torch's streams.

Part of `TorchCudaRuntime` (cuda_runtime.py); tests reach it without a GPU through fakes only.
- Loading (`BlockCopyKernel.load`, once, for the current device): cupy must import, be built for the
  CUDA major torch uses, and compile segment_copy.cu with NVRTC, which cupy 14 does only with the CUDA
  runtime headers found (`cuda.pathfinder`). Whatever fails becomes one line, `error`, which the backend
  logs at start-up (`kernel off on device N: ...`): cupy missing, cupy's CUDA major differs from torch's,
  NVRTC missing, headers missing, or the compiler's own message. The `[cuda12]` / `[cuda13]` extras
  install NVRTC and the runtime headers (nvidia-cuda-nvrtc*, nvidia-cuda-runtime* wheels).
- Launching: where the runtime hands over the driver's `cuLaunchKernel` (`launch_fn`, a ctypes function:
  TorchCudaRuntime resolves it with cuGetProcAddress) and a zero-work launch through it succeeded at load,
  each launch is one ctypes call with the kernel's CUfunction (cupy's handle) and a prebuilt argument array:
  about 3 us of host time against cupy's ~22 us (measured on an H200 host), which the staged path pays per
  chunk. Otherwise cupy's kernel call, which takes any object with a `ptr` as its stream (`Function.__call__`,
  cupy 13 and 14), so the launch names torch's raw `cudaStream_t` directly: no `cupy.cuda.ExternalStream`
  (deprecated in cupy 14, a warning per construction) and no change of cupy's current stream. The grid is
  capped at `max_blocks` thread blocks (the kernel grid-strides over the rest): a few SMs' worth, so a copy
  that overlaps the forward leaves it the other SMs.
Invariants: nothing here runs at import; `launch` raises `CudaError` when not loaded or when cupy raises.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_side.backends.cuda.api import CudaError

KERNEL_SOURCE = Path(__file__).with_name("segment_copy.cu")
KERNEL_NAMES = ("oc_block_copy", "oc_staged_copy")
# cuLaunchKernel(f, gridX, gridY, gridZ, blockX, blockY, blockZ, sharedMemBytes, hStream, kernelParams, extra)
LAUNCH_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
THREADS_PER_BLOCK = 256
WARPS_PER_BLOCK = THREADS_PER_BLOCK // 32
MAX_BLOCKS = 65535  # CUDA's grid limit for the y/z dims; a safe bound for x too
EXTRA = "pip install 'offload-connector[cuda13]' (or [cuda12], matching torch's CUDA)"


class _RawStream:
    """What cupy's kernel call reads from its `stream` argument: the raw stream handle, as `ptr`."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def torch_cuda_major() -> int | None:
    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


def cuda_major_mismatch(cupy_runtime_version: int, torch_major: int | None) -> str | None:
    """A reason when cupy's CUDA runtime (e.g. 12080) is of another major than torch's, else None."""
    cupy_major = cupy_runtime_version // 1000
    if torch_major is None or cupy_major == torch_major:
        return None
    return (f"cupy is built for CUDA {cupy_major} but torch uses CUDA {torch_major}; install "
            f"cupy-cuda{torch_major}x, e.g. pip install 'offload-connector[cuda{torch_major}]'")


def describe_load_failure(exc: BaseException) -> str:
    """One line naming what is missing, from what cupy raised while compiling."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    lowered = text.lower()
    if "nvrtc" in lowered and any(w in lowered for w in ("not found", "notfound", "load", "cannot open", "no such")):
        return f"NVRTC is missing ({text}); {EXTRA}"
    if "header" in lowered or "cuda_runtime.h" in lowered or "cuda_path" in lowered:
        return f"the CUDA runtime headers are missing ({text}); {EXTRA}"
    return f"the kernel did not compile ({text})"


class BlockCopyKernel:
    def __init__(self, launch_fn: Any = None) -> None:
        """`launch_fn`: the driver's cuLaunchKernel as a ctypes function (`LAUNCH_ARGTYPES`), or None."""
        self._kernels: dict[str, Any] | None = None
        self.error: str | None = None
        self._loaded = False
        self._launch_fn = launch_fn
        self._handles: dict[str, int] = {}  # kernel name -> CUfunction, where the direct launch works
        self._values = (ctypes.c_int64 * 8)()  # the argument values of one direct launch
        self._params = (ctypes.c_void_p * 8)(*[ctypes.addressof(self._values) + 8 * i for i in range(8)])
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._kernels is not None

    def load(self, device: int) -> bool:
        """Compile for `device` (once); False with `error` set when the kernel cannot be used."""
        if self._loaded:
            return self._kernels is not None
        self._loaded = True
        try:
            import cupy
        except Exception as exc:  # ImportError, or a broken install raising anything else
            self.error = f"cupy does not import ({type(exc).__name__}: {exc}); {EXTRA}"
            return False
        try:
            mismatch = cuda_major_mismatch(int(cupy.cuda.runtime.runtimeGetVersion()), torch_cuda_major())
        except Exception as exc:
            mismatch = f"cupy's CUDA runtime does not load ({type(exc).__name__}: {exc}); {EXTRA}"
        if mismatch is not None:
            self.error = mismatch
            return False
        try:
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=KERNEL_SOURCE.read_text(), backend="nvrtc")
                self._kernels = {name: module.get_function(name) for name in KERNEL_NAMES}
        except Exception as exc:
            self.error = describe_load_failure(exc)
            return False
        if self._launch_fn is not None:
            self._handles = self._direct_handles(cupy, device)
        return True

    def _direct_handles(self, cupy: Any, device: int) -> dict[str, int]:
        """The kernels' CUfunction handles where a zero-work launch through the driver works, else {}."""
        try:
            with cupy.cuda.Device(device):
                handles = {}
                for name, fn in self._kernels.items():
                    handle = int(getattr(getattr(fn, "kernel", fn), "ptr", 0) or 0)
                    if not handle:
                        return {}
                    handles[name] = handle
                # oc_staged_copy over no blocks and no planes: launches, reads nothing, writes nothing
                if self._direct(handles["oc_staged_copy"], 1, 0, 0, (0, 0, 0, 0, 0)) != 0:
                    return {}
                cupy.cuda.runtime.deviceSynchronize()
                return handles
        except Exception:  # cupy without handles, a driver refusing the call: cupy launches instead
            return {}

    def _direct(self, handle: int, blocks: int, shared_mem: int, stream: int, args: tuple[int, ...]) -> int:
        with self._lock:
            for i, a in enumerate(args):
                self._values[i] = a
            return int(self._launch_fn(handle, blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, shared_mem, stream,
                                       self._params, None))

    @property
    def direct_launch(self) -> bool:
        """Whether launches go straight to the driver (else through cupy)."""
        return bool(self._handles)

    def launch(self, name: str, work_items: int, args: tuple, stream: Any, max_blocks: int,
               shared_mem: int = 0) -> None:
        """Launch `name` over `work_items` thread-block work items on torch stream `stream`."""
        if self._kernels is None:
            raise CudaError(f"{name}: the block-copy kernel is not available ({self.error}); check supports_kernel")
        if work_items <= 0:
            return
        import cupy

        blocks = max(1, min(work_items, max_blocks, MAX_BLOCKS))
        handle = self._handles.get(name)
        if handle is not None:
            code = self._direct(handle, blocks, shared_mem, stream.cuda_stream, tuple(int(a) for a in args))
            if code != 0:
                raise CudaError(f"{name} launch ({work_items} copies, {blocks} blocks) failed: cuLaunchKernel "
                                f"returned CUresult {code}")
            return
        try:
            with cupy.cuda.Device(stream.device_index):
                self._kernels[name]((blocks,), (THREADS_PER_BLOCK,), args, stream=_RawStream(stream.cuda_stream),
                                    shared_mem=shared_mem)
        except Exception as exc:
            raise CudaError(f"{name} launch ({work_items} copies, {blocks} blocks) failed: {exc}") from exc

    def launch_block_copy(self, planes_ptr: int, num_planes: int, ids_ptr: int, num_blocks: int, stream: Any,
                          max_blocks: int) -> None:
        args = (np.int64(planes_ptr), np.int64(num_planes), np.int64(ids_ptr), np.int64(num_blocks))
        self.launch("oc_block_copy", num_planes * num_blocks, args, stream, max_blocks)

    def launch_staged_copy(self, planes_ptr: int, num_planes: int, src_ids_ptr: int, dst_ids_ptr: int,
                           num_blocks: int, stream: Any, max_blocks: int) -> None:
        """oc_staged_copy: one warp per (block, plane) chunk, so a thread block takes WARPS_PER_BLOCK of them."""
        args = (np.int64(planes_ptr), np.int64(num_planes), np.int64(src_ids_ptr), np.int64(dst_ids_ptr),
                np.int64(num_blocks))
        work = -(-num_planes * num_blocks // WARPS_PER_BLOCK)
        self.launch("oc_staged_copy", work, args, stream, max_blocks, shared_mem=16 * num_blocks)
