"""Host memory for the pool: an anonymous mmap, 2 MiB aligned, huge pages advised, NUMA-bound where known.

Why not `torch.empty`: its data pointer sits 64 bytes past a page, so registration ranges cut from it share
pages (CUDA pins whole pages and refuses a page registered twice) and copies straddle registrations. An
anonymous mapping is page aligned by construction and zero-filled lazily; we over-map by 2 MiB and start at
the first 2 MiB boundary so transparent huge pages can back it (`madvise(MADV_HUGEPAGE)`, advisory).

NUMA: with a node given, `mbind(MPOL_PREFERRED)` asks the kernel to place the pages on it (preferred, never
failing an allocation when that node is full). It must run before the pages are first touched; failure is
logged and ignored (a slower pool, never a broken one). Only Linux x86-64 and aarch64 know the syscall here.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import platform

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
HUGE_PAGE_BYTES = 2 << 20
_MBIND_SYSCALL = {"x86_64": 237, "aarch64": 235}
_MPOL_PREFERRED = 1
_MASK_BITS = 64  # one unsigned long: nodes 0..63


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _mbind_preferred(addr: int, nbytes: int, node: int) -> bool:
    number = _MBIND_SYSCALL.get(platform.machine())
    if number is None or node < 0 or node >= _MASK_BITS:
        return False
    libc = ctypes.CDLL(None)
    mask = ctypes.c_ulong(1 << node)
    # maxnode is the mask's bit count + 1: the kernel reads maxnode - 1 bits (with 64, node 63 was dropped and
    # the call "succeeded" as a local-allocation policy).
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_int(_MPOL_PREFERRED),
                      ctypes.byref(mask), ctypes.c_ulong(_MASK_BITS + 1), ctypes.c_uint(0))
    return rc == 0


def allocate_host_buffer(nbytes: int, numa_node: int | None = None) -> torch.Tensor:
    """`nbytes` uint8 bytes of zero-filled host memory starting on a 2 MiB boundary (page aligned always)."""
    if nbytes <= 0:
        raise ValueError(f"allocate_host_buffer({nbytes}): need a positive size (our bug)")
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps `mapped` alive as long as any view
    start = align_up(whole.data_ptr(), HUGE_PAGE_BYTES) - whole.data_ptr()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapped.madvise(mmap.MADV_HUGEPAGE, start, align_up(nbytes, HUGE_PAGE_BYTES))
        except OSError:  # THP disabled or unsupported: 4 KiB pages, same bytes
            pass
    buffer = whole[start:start + nbytes]
    if numa_node is not None and not _mbind_preferred(buffer.data_ptr(), align_up(nbytes, PAGE_BYTES), numa_node):
        logger.warning("offload host pool: could not prefer NUMA node %d for %d bytes; the kernel places it",
                       numa_node, nbytes)
    return buffer
