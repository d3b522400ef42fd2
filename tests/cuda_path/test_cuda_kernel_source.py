"""The CUDA pieces that can be checked without a GPU: the kernel source compiles, the runtime module imports
and refuses to run without a device, and the `cuMemcpyBatchAsync` ABI is picked from the driver version.

Nothing here runs CUDA code. nvcc (and NVRTC, where its library is installed) only compile; the tests skip
where the compiler is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import worker_side.backends.cuda.runtime as cuda_runtime
from worker_side.errors import BackendError

KERNEL = Path(cuda_runtime.__file__).with_name("segment_copy.cu")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles_with_nvcc(arch: str, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    out = tmp_path / f"segment_copy_{arch}.cubin"
    proc = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-o", str(out), str(KERNEL)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    for name in cuda_runtime.KERNEL_NAMES:  # extern "C": unmangled symbols, as cupy looks them up
        assert name.encode() in out.read_bytes()


def _find_nvrtc() -> str | None:
    candidates: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    return next((c for c in candidates if "builtins" not in c), found)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles_with_nvrtc(arch: str) -> None:
    path = _find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not installed (nvidia-cuda-nvrtc wheel or system CUDA)")
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), KERNEL.read_bytes(), b"segment_copy.cu", 0, None, None) == 0
    try:
        rc = lib.nvrtcCompileProgram(prog, 1, (ctypes.c_char_p * 1)(f"-arch={arch}".encode()))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA device")
def test_runtime_refuses_without_a_device() -> None:
    with pytest.raises(BackendError, match="allowed here: transfer.backend cpu"):
        cuda_runtime.TorchCudaRuntime()


@pytest.mark.parametrize(("driver", "request_version", "num_args"), [
    (12080, 12080, 9),  # CUDA 12.8: (..., numAttrs, size_t *failIdx, hStream)
    (12090, 12080, 9),
    (13000, 13000, 8),  # CUDA 13: cuMemcpyBatchAsync_v2, no failIdx
    (13020, 13000, 8),
])
def test_batch_prototype_follows_driver_version(driver: int, request_version: int, num_args: int) -> None:
    proto = cuda_runtime.batch_prototype(driver)
    assert proto is not None
    assert proto[0] == request_version
    assert len(proto[1]) == num_args
    assert proto[1][-1] is ctypes.c_void_p  # the stream is always last


@pytest.mark.parametrize("driver", [11080, 12040, 12060])
def test_no_batch_copy_before_cuda_12_8(driver: int) -> None:
    assert cuda_runtime.batch_prototype(driver) is None


def test_memcpy_attributes_match_cuda_h_layout() -> None:
    # CUmemcpyAttributes: srcAccessOrder (enum), srcLocHint and dstLocHint (CUmemLocation: enum + int), flags
    attrs = cuda_runtime._MemcpyAttributes
    assert ctypes.sizeof(attrs) == 24
    assert [getattr(attrs, f).offset for f in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")] == \
        [0, 4, 12, 20]


def _runtime_with_batch(driver: int, seen: dict) -> cuda_runtime.TorchCudaRuntime:
    """A runtime whose cuMemcpyBatchAsync is a ctypes callback of the prototype picked for `driver`."""
    _, argtypes = cuda_runtime.batch_prototype(driver)

    def fake_batch(*args: int) -> int:
        count = args[3]
        seen["arrays"] = [list((ctypes.c_uint64 * count).from_address(a)) for a in args[:3]]
        attrs = cuda_runtime._MemcpyAttributes.from_address(args[4])
        seen["attrs"] = (attrs.srcAccessOrder, attrs.srcLocHint.type, attrs.dstLocHint.type, attrs.flags)
        seen["idxs_and_num"] = (ctypes.c_size_t.from_address(args[5]).value, args[6])
        seen["num_args"], seen["stream"] = len(args), args[-1]
        return 0

    rt = object.__new__(cuda_runtime.TorchCudaRuntime)  # skips the device check: nothing here touches CUDA
    rt._tls = type("Tls", (), {"bound": True})()
    rt._batch_fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(fake_batch)
    rt._batch_has_fail_idx = len(argtypes) == 9
    rt._attrs = cuda_runtime._MemcpyAttributes(srcAccessOrder=1)
    rt._attr_idxs = (ctypes.c_size_t * 1)(0)
    return rt


@pytest.mark.parametrize(("driver", "num_args"), [(12080, 9), (13000, 8)])
def test_memcpy_batch_passes_the_arrays_in_one_call(driver: int, num_args: int) -> None:
    seen: dict = {}
    rt = _runtime_with_batch(driver, seen)
    stream = type("FakeStream", (), {"cuda_stream": 0x1234})()
    dst, src, nbytes = (np.array(v, dtype=np.int64) for v in ([1 << 40, 2 << 40], [4096, 8192], [512, 64]))
    rt.memcpy_batch(dst, src, nbytes, stream)
    assert seen["arrays"] == [[1 << 40, 2 << 40], [4096, 8192], [512, 64]]
    assert seen["attrs"] == (1, 0, 0, 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no hints, no flags
    assert seen["idxs_and_num"] == (0, 1)
    assert (seen["num_args"], seen["stream"]) == (num_args, 0x1234)
