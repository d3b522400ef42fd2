"""Thin ctypes bindings to the CUDA runtime: host-memory registration and async memcpy.

Imported lazily by `cuda_backend`; importing this module never loads CUDA. `load_cudart()` finds the
runtime torch ships with (nvidia-cuda-runtime wheels) or the system one, and raises `BackendError` naming
what it tried. Every call checks its return code and raises with the CUDA error name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from functools import lru_cache

from worker_side.errors import BackendError

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addressing
REGISTER_CHUNK_BYTES = 1 << 30  # cudaHostRegister granularity: 1 GiB per call


@lru_cache(maxsize=1)
def load_cudart() -> ctypes.CDLL:
    candidates: list[str] = []
    try:
        import nvidia.cuda_runtime  # type: ignore[import-not-found]

        for root in nvidia.cuda_runtime.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libcudart.so*")))
    except ImportError:
        pass
    found = ctypes.util.find_library("cudart")
    candidates += [found] if found else []
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetErrorName.argtypes = [ctypes.c_int]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        return lib
    raise BackendError(f"cannot load the CUDA runtime (tried {candidates}); the cuda backend needs libcudart")


def _check(code: int, what: str) -> None:
    if code != 0:
        name = load_cudart().cudaGetErrorName(code)
        raise RuntimeError(f"{what} failed: {name.decode() if name else code}")


def host_register_chunks(ptr: int, nbytes: int, chunk: int = REGISTER_CHUNK_BYTES) -> list[tuple[int, int]]:
    """Pin [ptr, ptr + nbytes) with cudaHostRegister in chunks; return the registered (ptr, size) pairs."""
    lib, done = load_cudart(), []
    try:
        for off in range(0, nbytes, chunk):
            size = min(chunk, nbytes - off)
            _check(lib.cudaHostRegister(ptr + off, size, 0), f"cudaHostRegister({size} bytes)")
            done.append((ptr + off, size))
    except Exception:
        host_unregister(done)
        raise
    return done


def host_unregister(chunks: list[tuple[int, int]]) -> None:
    lib = load_cudart()
    for ptr, _ in chunks:
        lib.cudaHostUnregister(ptr)


def memcpy_async_many(dst: list[int], src: list[int], nbytes: list[int], stream_handle: int) -> None:
    """Enqueue one cudaMemcpyAsync per segment on `stream_handle` (raises on the first error)."""
    fn = load_cudart().cudaMemcpyAsync
    for d, s, n in zip(dst, src, nbytes, strict=True):
        code = fn(d, s, n, CUDA_MEMCPY_DEFAULT, stream_handle)
        if code:
            _check(code, f"cudaMemcpyAsync({n} bytes)")
