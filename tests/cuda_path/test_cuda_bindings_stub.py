"""`TorchCudaRuntime`'s driver calls through the real cuda-bindings into a stand-in for libcuda.so.1.

Where cuda-bindings is installed (the CUDA extras; the GPU machine's scripts/gpu_check.sh runs this) and a C
compiler is on PATH, a child process loads tests/cuda_stub/libcuda_stub.c as libcuda.so.1 and calls each
driver entry point the runtime uses. Every call must either succeed with the bindings' real tuple shapes,
or, when the stub returns an error code the bindings cannot name (723, 1000: cuda-bindings 12.9 and 13.0
raise KeyError for it, 13.5 ValueError), raise `CudaError` naming the call and the code; the batched copy's
ABI must follow the driver version. Skipped where cuda-bindings is not installed (CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("cuda") is None
                                or importlib.util.find_spec("cuda.bindings") is None,
                                reason="cuda-bindings not installed (pip install 'offload-connector[cuda13]')")

DRIVE = r"""
import ctypes, json, threading
import numpy as np
import torch
from cuda.bindings import driver as drv
import worker_side.backends.cuda.runtime as cr
from worker_side.backends.cuda.api import CudaError
from worker_side.backends.cuda.kernel import BlockCopyKernel

torch.cuda.current_device = lambda: 0  # no CUDA here: the stub is the whole driver
rt = object.__new__(cr.TorchCudaRuntime)
rt._drv, rt._tls = drv, threading.local()
rt._attrs, rt._attr_idxs = cr._MemcpyAttributes(srcAccessOrder=1), (ctypes.c_size_t * 1)(0)
rt.kernel_max_sms, rt._kernel, rt._sms, rt._retained, rt._retain_lock = 12, BlockCopyKernel(), {}, [], threading.Lock()
rt._batch_fn, rt._batch_has_fail_idx = rt._resolve_batch()

class Stream:
    cuda_stream, device_index = 0x5EED, 0

out = {"batch": rt._batch_fn is not None, "fail_idx_abi": rt._batch_has_fail_idx}
ids = np.array([1 << 40, 2 << 40], np.int64)
calls = {"device_of": lambda: rt.device_of(0x1000, 1), "num_sms": lambda: rt.num_sms(0),
         "can_use_host_pointer": lambda: rt.can_use_host_pointer(0), "host_register": lambda: rt.host_register(4096, 4096),
         "host_unregister": lambda: rt.host_unregister(4096), "memcpy": lambda: rt.memcpy(1, 2, 3, Stream()),
         "memcpy_batch": lambda: rt.memcpy_batch(ids, ids, np.array([8, 8], np.int64), Stream()), "close": rt.close}
for name, call in calls.items():
    try:
        out[name] = ["ok", call()]
    except CudaError as exc:
        out[name] = ["CudaError", str(exc)]
    except BaseException as exc:
        out[name] = ["escaped", f"{type(exc).__name__}: {exc}"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the libcuda.so.1 stand-in")
    out = tmp_path_factory.mktemp("stub")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"), str(HERE / "cuda_stub" / "libcuda_stub.c"),
                    "-ldl"], check=True, capture_output=True, timeout=120)
    return out


def drive(stub_dir: Path, code: int, version: int) -> dict:
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub_dir), "STUB_CODE": str(code), "STUB_VERSION": str(version),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", DRIVE], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("version", "fail_idx_abi"), [(12080, True), (13000, False)])
def test_real_bindings_succeed_with_their_tuple_shapes(stub_dir: Path, version: int, fail_idx_abi: bool) -> None:
    out = drive(stub_dir, 0, version)
    assert out["batch"] is True and out["fail_idx_abi"] is fail_idx_abi
    assert out["device_of"] == ["ok", 0] and out["num_sms"] == ["ok", 132]
    assert out["can_use_host_pointer"] == ["ok", True]
    for name in ("host_register", "host_unregister", "memcpy", "memcpy_batch", "close"):
        assert out[name] == ["ok", None], (name, out[name])


@pytest.mark.parametrize("code", [723, 1000])
def test_codes_the_real_bindings_cannot_name_are_cuda_errors(stub_dir: Path, code: int) -> None:
    out = drive(stub_dir, code, 12080)
    for name in ("device_of", "num_sms", "can_use_host_pointer", "host_register", "host_unregister", "memcpy",
                 "memcpy_batch"):
        kind, message = out[name]
        assert kind == "CudaError" and str(code) in message, (name, out[name])
    assert out["close"] == ["ok", None]
