"""`TorchCudaRuntime` and its kernel loader driven through a fake driver and a fake cupy (no GPU needed).

The fakes behave as the real libraries were read and run to behave (cuda-bindings 12.9, 13.0 and 13.5, cupy 13
and 14.2; test_cuda_bindings_stub.py drives the real bindings where they are installed): a bindings call whose
driver returns a code the `CUresult` enum lacks raises KeyError (12.9, 13.0) or ValueError (13.5); cupy's kernel call
reads `stream.ptr`; cupy 14's `ExternalStream` warns on every construction. What they cannot show is a GPU's
own behaviour: that is scripts/gpu_check.sh's part.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types

import numpy as np
import pytest
import torch

import worker_side.backends.cuda.kernel as cuda_kernel
import worker_side.backends.cuda.runtime as cuda_runtime
from worker_side.backends.cuda.api import CudaError
from worker_side.backends.cuda.kernel import BlockCopyKernel, cuda_major_mismatch, describe_load_failure


class FakeCUresult(int):
    """Like the bindings' CUresult IntEnum: a code it has no member for raises ValueError."""

    NAMES = {0: b"CUDA_SUCCESS", 1: b"CUDA_ERROR_INVALID_VALUE", 2: b"CUDA_ERROR_OUT_OF_MEMORY",
             700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}

    def __new__(cls, code: int) -> FakeCUresult:
        if int(code) not in cls.NAMES:
            raise ValueError(f"{int(code)} is not a valid CUresult")
        return super().__new__(cls, code)


class FakeDriver:
    CUresult = FakeCUresult
    CUdevice = int

    class CUdevice_attribute:  # noqa: N801 (the bindings' name)
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
        CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

    def __init__(self, memcpy_code: int = 0, attributes: dict[int, int] | None = None,
                 unknown: type[Exception] = ValueError) -> None:
        self.memcpy_code, self.unknown = memcpy_code, unknown
        self.attributes = attributes or {16: 132, 91: 1}
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def cuGetErrorName(self, res: FakeCUresult) -> tuple[FakeCUresult, bytes]:  # noqa: N802
        return FakeCUresult(0), FakeCUresult.NAMES[int(res)]

    def cuMemcpyAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[FakeCUresult]:  # noqa: N802
        # the bindings map the code to their enum: KeyError for 723, 1000 in 12.9 / 13.0, ValueError in 13.5
        if self.memcpy_code not in FakeCUresult.NAMES:
            raise self.unknown(self.memcpy_code if self.unknown is KeyError else
                               f"{self.memcpy_code} is not a valid CUresult")
        return (FakeCUresult(self.memcpy_code),)

    def cuCtxGetCurrent(self) -> tuple[FakeCUresult, int]:  # noqa: N802
        return FakeCUresult(0), 0  # a new thread: no context

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[FakeCUresult, int]:  # noqa: N802
        with self._lock:
            self.calls.append(("retain", dev))
        return FakeCUresult(0), 0xC0 + dev

    def cuCtxSetCurrent(self, ctx: int) -> tuple[FakeCUresult]:  # noqa: N802
        return (FakeCUresult(0),)

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[FakeCUresult]:  # noqa: N802
        self.calls.append(("release", dev))
        return (FakeCUresult(0),)

    def cuDeviceGetAttribute(self, attribute: int, dev: int) -> tuple[FakeCUresult, int]:  # noqa: N802
        return FakeCUresult(0), self.attributes[attribute]


class FakeStream:
    def __init__(self, ptr: int = 0x5EED, device: int = 0) -> None:
        self.cuda_stream, self.device_index = ptr, device


def bare_runtime(drv: FakeDriver, kernel_max_sms: int = 12) -> cuda_runtime.TorchCudaRuntime:
    """A TorchCudaRuntime over `drv`, skipping the device check (nothing here touches CUDA)."""
    rt = object.__new__(cuda_runtime.TorchCudaRuntime)
    rt._drv, rt._tls = drv, threading.local()
    rt._batch_fn, rt._batch_has_fail_idx = None, False
    rt.supports_batch = False
    rt._attrs = cuda_runtime._MemcpyAttributes(srcAccessOrder=1)
    rt._attr_idxs = (ctypes.c_size_t * 1)(0)
    rt.kernel_max_sms, rt._kernel, rt._sms = kernel_max_sms, BlockCopyKernel(), {}
    rt._retained, rt._retain_lock = [], threading.Lock()
    return rt


# ---- 2. error codes the bindings do not know -------------------------------------------------------------
@pytest.mark.parametrize("code", [723, 1000])
def test_unknown_codes_are_named_by_number(code: int) -> None:
    drv = FakeDriver()
    assert cuda_runtime._driver_error(drv, code) == f"CUresult {code} (unknown to the installed cuda-bindings)"
    with pytest.raises(CudaError, match=f"cuFoo failed: CUresult {code}"):
        cuda_runtime._check(drv, (code,), "cuFoo")
    assert cuda_runtime._driver_error(drv, 700) == "CUDA_ERROR_ILLEGAL_ADDRESS"


@pytest.mark.parametrize("unknown", [KeyError, ValueError])
@pytest.mark.parametrize("code", [723, 1000])
def test_a_bindings_call_that_cannot_name_its_result_raises_cuda_error(code: int, unknown: type) -> None:
    rt = bare_runtime(FakeDriver(memcpy_code=code, unknown=unknown))
    rt._tls.bound = True
    with pytest.raises(CudaError, match=f"cuMemcpyAsync.*cannot name.*{unknown.__name__}.*{code}"):
        rt.memcpy(1 << 40, 4096, 512, FakeStream())


def batch_runtime(result: int, write_fail_idx: int | None, seen: dict) -> cuda_runtime.TorchCudaRuntime:
    """A runtime whose cuMemcpyBatchAsync (12.8 ABI, with failIdx) returns `result`."""
    _, argtypes = cuda_runtime.batch_prototype(12080)

    def fake_batch(*args: int) -> int:
        fail_idx = ctypes.c_size_t.from_address(args[7])
        seen["fail_idx_before"] = fail_idx.value
        if write_fail_idx is not None:
            fail_idx.value = write_fail_idx
        return result

    rt = bare_runtime(FakeDriver())
    rt._tls.bound = True
    rt._batch_fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(fake_batch)
    rt._batch_has_fail_idx = rt.supports_batch = True
    return rt


def batch(rt: cuda_runtime.TorchCudaRuntime) -> None:
    dst, src, nbytes = (np.array(v, dtype=np.int64) for v in ([1 << 40, 2 << 40], [4096, 8192], [512, 64]))
    rt.memcpy_batch(dst, src, nbytes, FakeStream())


@pytest.mark.parametrize("status", [(), (0,)])  # bindings returning (err, pfn) or (err, pfn, symbolStatus)
@pytest.mark.parametrize(("driver", "has_fail_idx"), [(12080, True), (13000, False)])
def test_batch_copy_resolves_through_either_tuple_shape(status: tuple, driver: int, has_fail_idx: bool) -> None:
    keep = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)  # any function address will do: it is never called here
    drv = FakeDriver()
    drv.cuDriverGetVersion = lambda: (FakeCUresult(0), driver)
    asked: list = []

    def get_proc_address(symbol: bytes, version: int, flags: int) -> tuple:
        asked.append((symbol, version, flags))
        return (FakeCUresult(0), ctypes.cast(keep, ctypes.c_void_p).value, *status)

    drv.cuGetProcAddress = get_proc_address
    rt = bare_runtime(drv)
    fn, fail_idx = rt._resolve_batch()
    assert fn is not None and fail_idx is has_fail_idx
    assert asked == [(b"cuMemcpyBatchAsync", 12080 if has_fail_idx else 13000, 0)]


def test_no_batch_copy_when_the_lookup_fails_with_an_unknown_code() -> None:
    drv = FakeDriver()
    drv.cuDriverGetVersion = lambda: (FakeCUresult(0), 12090)

    def get_proc_address(symbol: bytes, version: int, flags: int) -> tuple:
        return (FakeCUresult(1000), 0, 0)  # the bindings cannot name 1000: ValueError

    drv.cuGetProcAddress = get_proc_address
    assert bare_runtime(drv)._resolve_batch() == (None, False)


def test_batch_error_code_unknown_to_the_bindings() -> None:
    rt = batch_runtime(723, None, {})
    with pytest.raises(CudaError, match="CUresult 723") as err:
        batch(rt)
    assert "failIdx" not in str(err.value)  # the driver did not set it


# ---- 8. failIdx ---------------------------------------------------------------------------------------
def test_fail_idx_starts_at_size_max_and_is_reported_only_when_set() -> None:
    seen: dict = {}
    with pytest.raises(CudaError, match=r"CUDA_ERROR_INVALID_VALUE, failIdx 1$"):
        batch(batch_runtime(1, 1, seen))
    assert seen["fail_idx_before"] == cuda_runtime.SIZE_MAX == 2**64 - 1
    with pytest.raises(CudaError, match=r"CUDA_ERROR_OUT_OF_MEMORY$"):
        batch(batch_runtime(2, None, seen))


# ---- 8. retained primary contexts are released --------------------------------------------------------
def test_retained_primary_contexts_are_released_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver()
    rt = bare_runtime(drv)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    threads = [threading.Thread(target=rt._bind_context) for _ in range(2)]  # two threads with no context
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rt._bind_context()
    assert sorted(drv.calls) == [("retain", 1)] * 3
    rt.close()
    rt.close()
    assert [c for c in drv.calls if c[0] == "release"] == [("release", 1)] * 3


# ---- 6. / 3. device attributes through the seam ---------------------------------------------------------
def test_device_attributes() -> None:
    rt = bare_runtime(FakeDriver(attributes={16: 132, 91: 0}))
    assert rt.num_sms(0) == 132 and rt.can_use_host_pointer(0) is False
    assert bare_runtime(FakeDriver(attributes={16: 78, 91: 1})).can_use_host_pointer(0) is True


def test_tensor_device_reads_metadata_only() -> None:
    rt = bare_runtime(FakeDriver())
    assert rt.tensor_device(torch.zeros(4)) is None


# ---- 3. and 5. the kernel: grid cap, raw stream, start-up reasons ----------------------------------------
def fake_cupy(runtime_version: int = 13000, compile_error: BaseException | None = None) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    launches: list[dict] = []
    devices: list[int] = []

    class Device:
        def __init__(self, device: int) -> None:
            self.device = device

        def __enter__(self) -> Device:
            devices.append(self.device)
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def external_stream(*args: object, **kwargs: object) -> None:
        raise AssertionError("cupy.cuda.ExternalStream is deprecated in cupy 14 (a warning per construction)")

    class RawModule:
        def __init__(self, code: str, backend: str) -> None:
            assert backend == "nvrtc" and "oc_block_copy" in code

        def get_function(self, name: str):
            if compile_error is not None:
                raise compile_error

            def kernel(grid: tuple, block: tuple, args: tuple, stream: object = None, shared_mem: int = 0) -> None:
                launches.append({"name": name, "grid": grid, "block": block, "args": args, "stream": stream,
                                 "shared_mem": shared_mem})
            kernel.ptr = 0xF00 + len(name)  # cupy's Function handle (CUfunction)
            return kernel

    cupy.cuda = types.SimpleNamespace(Device=Device, ExternalStream=external_stream,
                                      runtime=types.SimpleNamespace(runtimeGetVersion=lambda: runtime_version,
                                                                    deviceSynchronize=lambda: None))
    cupy.RawModule = RawModule
    cupy.launches, cupy.devices = launches, devices
    return cupy


@pytest.mark.parametrize(("kernel_max_sms", "sms", "grid"), [(12, 132, 12), (200, 132, 132), (12, 8, 8)])
def test_kernel_grid_is_capped_and_launched_on_the_raw_stream(monkeypatch: pytest.MonkeyPatch, kernel_max_sms: int,
                                                              sms: int, grid: int) -> None:
    cupy = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    rt = bare_runtime(FakeDriver(attributes={16: sms, 91: 1}), kernel_max_sms=kernel_max_sms)
    assert rt._kernel.load(0) and rt._kernel.error is None
    stream = FakeStream(ptr=0xABC, device=0)
    rt.launch_block_copy(0x1000, 64, 0x2000, 4096, stream)  # 262,144 chunks
    rt.launch_block_copy(0x1000, 2, 0x2000, 3, stream)  # 6 chunks: 6 blocks
    (big, small) = cupy.launches
    assert big["grid"] == (grid,) and big["block"] == (cuda_kernel.THREADS_PER_BLOCK,)
    assert small["grid"] == (min(6, grid),)
    assert big["stream"].ptr == 0xABC and [int(a) for a in big["args"]] == [0x1000, 64, 0x2000, 4096]


def test_kernel_loads_for_the_device_it_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    kernel = BlockCopyKernel()
    assert kernel.load(3) and cupy.devices == [3]
    assert kernel.load(3) and cupy.devices == [3]  # once


def test_kernel_off_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    kernel = BlockCopyKernel()
    assert not kernel.load(0) and kernel.error.startswith("cupy does not import (ModuleNotFoundError")
    assert "offload-connector[cuda13]" in kernel.error
    with pytest.raises(CudaError, match="not available"):
        kernel.launch_block_copy(1, 1, 1, 1, FakeStream(), 12)

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(runtime_version=12080))
    kernel = BlockCopyKernel()
    assert not kernel.load(0)
    assert kernel.error.startswith("cupy is built for CUDA 12 but torch uses CUDA 13; install cupy-cuda13x")

    class DynamicLibNotFoundError(RuntimeError):
        pass

    for exc, expected in [
        (DynamicLibNotFoundError("Failure finding \"libnvrtc.so\": not found"), "NVRTC is missing"),
        (RuntimeError("Failed to find CUDA headers. Please install CUDA toolkit headers (e.g., pip install "
                      "cupy-cuda12x[ctk]) or specify CUDA_PATH environment variable."),
         "the CUDA runtime headers are missing"),
        (RuntimeError("nvrtc: error: invalid value for --gpu-architecture"), "the kernel did not compile"),
    ]:
        monkeypatch.setitem(sys.modules, "cupy", fake_cupy(compile_error=exc))
        kernel = BlockCopyKernel()
        assert not kernel.load(0) and kernel.error.startswith(expected), kernel.error
        assert "\n" not in kernel.error


def test_cuda_major_mismatch() -> None:
    assert cuda_major_mismatch(13000, 13) is None and cuda_major_mismatch(12090, None) is None
    assert cuda_major_mismatch(13000, 12).startswith("cupy is built for CUDA 13 but torch uses CUDA 12")
    assert describe_load_failure(OSError("libnvrtc.so.13: cannot open shared object file")).startswith("NVRTC")


class FakeLaunch:
    """The driver's cuLaunchKernel as kernel.py calls it: records each launch with its argument values."""

    def __init__(self, result: int = 0) -> None:
        self.result, self.calls = result, []

    def __call__(self, handle, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra) -> int:
        values = [ctypes.c_int64.from_address(params[i]).value for i in range(5)]
        self.calls.append({"handle": handle, "grid": gx, "block": bx, "shared_mem": shared_mem, "stream": stream,
                           "args": values})
        return self.result


def test_kernels_launch_straight_through_the_driver_when_a_test_launch_worked(monkeypatch: pytest.MonkeyPatch) -> None:
    """cupy's kernel call costs ~22 us of host time per launch (measured on an H200 host), the staged path
    launches once per chunk: with the driver's cuLaunchKernel, one ctypes call with prebuilt arguments."""
    cupy = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    launch = FakeLaunch()
    kernel = BlockCopyKernel(launch)
    assert kernel.load(0) and kernel.direct_launch
    assert launch.calls[0]["args"] == [0, 0, 0, 0, 0]  # the zero-work test launch of oc_staged_copy
    kernel.launch_staged_copy(0x1000, 3, 0x2000, 0x3000, 40, FakeStream(ptr=0xABC), 16)
    call = launch.calls[-1]
    assert call["args"] == [0x1000, 3, 0x2000, 0x3000, 40] and call["stream"] == 0xABC
    assert call["grid"] == 15 and call["block"] == cuda_kernel.THREADS_PER_BLOCK  # 120 chunks / 8 warps
    assert call["shared_mem"] == 16 * 40 and call["handle"] == 0xF00 + len("oc_staged_copy")
    assert cupy.launches == []  # nothing went through cupy
    launch.result = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: the launch raises, naming the code
    with pytest.raises(CudaError, match="CUresult 700"):
        kernel.launch_staged_copy(0x1000, 3, 0x2000, 0x3000, 40, FakeStream(ptr=0xABC), 16)


def test_a_driver_refusing_the_test_launch_leaves_cupy_launching(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    kernel = BlockCopyKernel(FakeLaunch(result=1))
    assert kernel.load(0) and not kernel.direct_launch
    kernel.launch_staged_copy(0x1000, 3, 0x2000, 0x3000, 40, FakeStream(ptr=0xABC), 16)
    assert [x["name"] for x in cupy.launches] == ["oc_staged_copy"] and cupy.launches[0]["shared_mem"] == 640
