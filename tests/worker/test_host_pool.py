"""The host pool and its memory (worker_side/host_pool.py, host_memory.py): the pool's size (from
`num_cpu_blocks` or `cpu_bytes` and the world size, checked against available memory before anything is
allocated), the block rows it serves, the page-aligned ranges it registers, and the buffer it allocates
(zeroed, private, advised for huge pages, preferring a NUMA node)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform

import pytest
import torch
from worker_helpers import cpu_worker, random_bytes

from offload_connector import ConfigError, load_config
from worker_side import HostPoolError, OffloadWorker, host_memory
from worker_side.block_layout import tensor_block_view
from worker_side.host_memory import PAGE_BYTES, _mbind_preferred, allocate_host_buffer
from worker_side.host_pool import HostPool, check_pool_size, mem_available_bytes, rows_per_registration

NUM_GPU_BLOCKS = 16


# ---- the pool's size --------------------------------------------------------------------------------------
def test_pool_sized_from_cpu_bytes_and_world_size():
    w = OffloadWorker(load_config({"cpu_bytes": "1MiB", "transfer": {"backend": "cpu"}}), world_size=2)
    w.register_kv_caches({"l": torch.zeros(NUM_GPU_BLOCKS, 1024, dtype=torch.float16)})  # 2 KiB blocks
    assert w.num_cpu_blocks == (1 << 20) // 2 // 2048 and w.host_pool.nbytes == (1 << 19)
    w.shutdown()



def test_a_worker_alone_gets_the_whole_cpu_budget():
    """world_size defaults to 1: the pool holds cpu_bytes // bytes_per_block blocks.

    Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = OffloadWorker(load_config({"cpu_bytes": 64 * 10, "transfer": {"backend": "cpu"}}))
    w.register_kv_caches({"l": torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8)})
    assert w.num_cpu_blocks == 10
    w.shutdown()



def test_pool_errors_before_allocating():
    with pytest.raises(ConfigError, match="fewer than 2 blocks"):
        OffloadWorker(load_config({"cpu_bytes": 4096, "transfer": {"backend": "cpu"}})).register_kv_caches(
            {"l": torch.zeros(4, 1024, dtype=torch.float32)})
    with pytest.raises(HostPoolError, match="available memory"):
        check_pool_size(1000, 1 << 20, available=1 << 20)
    with pytest.raises(HostPoolError, match=">= 2"):
        check_pool_size(1, 1024, available=None)

    def never(nbytes: int) -> torch.Tensor:
        raise AssertionError("allocated despite a failed size check")

    from worker_side.block_layout import tensor_block_view
    with pytest.raises(HostPoolError):
        HostPool([tensor_block_view("l", torch.zeros(4, 1024))], 1 << 30, never, available=1 << 30)


def test_a_pool_too_big_for_the_machine_is_explained_in_gib():
    """Issue 12 item 7: the message quoted raw byte counts; issue 30: and a 32 KiB block as "0.03 MiB"."""
    with pytest.raises(HostPoolError, match=r"1,048,576 blocks x 1 MiB = 1 TiB does not fit in available memory \(1 GiB"):
        check_pool_size(1 << 20, 1 << 20, available=1 << 30)
    with pytest.raises(HostPoolError, match=r"x 32 KiB = 10 TiB does not fit"):
        check_pool_size(10 * 2**40 // 2**15, 2**15, available=1 << 30)



def test_pool_size_limits_are_inclusive():
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    assert check_pool_size(2, 1024, available=None) == 2048  # the smallest pool: null block + one
    assert check_pool_size(2, 1, available=None) == 2
    assert check_pool_size(4, 1024, available=4096) == 4096  # exactly what is available
    with pytest.raises(HostPoolError, match="register non-empty KV caches"):
        check_pool_size(4, 0, available=None)


def never_allocate(nbytes: int) -> torch.Tensor:
    raise AssertionError("allocated despite a failed size check")


def test_the_pool_size_is_checked_against_the_given_or_else_the_machines_available_memory():
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    views = [tensor_block_view("l", torch.zeros(4, PAGE_BYTES, dtype=torch.uint8))]
    with pytest.raises(HostPoolError, match="does not fit in available memory"):
        HostPool(views, 4, never_allocate, available=PAGE_BYTES)  # a tiny limit given: it is the one used
    machine = mem_available_bytes()
    if machine is not None:  # nothing given: the machine's MemAvailable
        with pytest.raises(HostPoolError, match="does not fit in available memory"):
            HostPool(views, machine // PAGE_BYTES + 2, never_allocate)


@pytest.mark.parametrize("wrong", [
    lambda n: torch.zeros(n - 1, dtype=torch.uint8),  # one byte short
    lambda n: torch.zeros(n, dtype=torch.float32),  # right count, wrong type
    lambda n: torch.zeros(n, dtype=torch.uint8, device="meta"),  # not host memory
])
def test_the_pool_refuses_a_buffer_that_is_not_what_it_asked_for(wrong):
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    views = [tensor_block_view("l", torch.zeros(4, 64, dtype=torch.uint8))]
    with pytest.raises(HostPoolError, match="our bug"):
        HostPool(views, 4, wrong, available=None)


def test_available_memory_is_read_from_meminfo(tmp_path):
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000 kB\nMemFree:         2000 kB\nMemAvailable:    5000 kB\n")
    assert mem_available_bytes(str(meminfo)) == 5000 * 1024
    meminfo.write_text("MemTotal:       16000 kB\n")
    assert mem_available_bytes(str(meminfo)) is None
    assert mem_available_bytes(str(tmp_path / "missing")) is None


# ---- the rows it serves ----------------------------------------------------------------------------------
def test_block_reads_accept_every_row_and_refuse_the_one_past_the_end():
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    w = cpu_worker(num_cpu_blocks=4)
    kv = {"l": random_bytes((NUM_GPU_BLOCKS, 64), 0)}
    w.register_kv_caches(kv)
    assert w.host_pool[0].numel() == 64  # the null block's row exists (never copied)
    assert w.host_pool[3].numel() == 64
    with pytest.raises(IndexError):
        w.host_pool[4]
    with pytest.raises(IndexError):
        w.host_pool[-1]
    view = tensor_block_view("l", kv["l"])
    assert torch.equal(view.block_tensor(0), kv["l"][0])
    assert torch.equal(view.block_tensor(NUM_GPU_BLOCKS - 1), kv["l"][-1])
    with pytest.raises(IndexError):
        view.block_tensor(NUM_GPU_BLOCKS)
    w.shutdown()



def test_the_pool_views_keep_the_layer_names():
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    w = cpu_worker()
    w.register_kv_caches({"k.0": torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8),
                          "k.1": torch.zeros(NUM_GPU_BLOCKS, 32, dtype=torch.uint8)})
    assert [v.name for v in w.host_pool.views] == ["k.0", "k.1"]
    w.shutdown()


# ---- registration ranges ----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_sizes, num_blocks, limit", [
    ([PAGE_BYTES // 2] * 3, 1, 2 * PAGE_BYTES),  # one-page planes: two merge up to the limit exactly
    ([PAGE_BYTES // 2, PAGE_BYTES], 16, 4 * PAGE_BYTES),  # planes cut every few rows
    ([96, 200], 300, 16 * PAGE_BYTES),
    ([PAGE_BYTES], 8, 1 << 30),  # one range for everything
])
def test_registration_ranges_cover_each_plane_once_within_the_limit(chunk_sizes, num_blocks, limit):
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    views = [tensor_block_view(f"l{i}", torch.zeros(4, c, dtype=torch.uint8)) for i, c in enumerate(chunk_sizes)]
    pool = HostPool(views, num_blocks + 1, available=None, max_registration_bytes=limit)
    ranges = pool.registration_ranges()
    base, end = pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.buffer_bytes
    for ptr, size in ranges:
        assert ptr % PAGE_BYTES == 0 and size % PAGE_BYTES == 0 and 0 < size <= limit
    for (p1, s1), (p2, s2) in zip(ranges, ranges[1:], strict=False):
        assert p1 + s1 <= p2  # ascending and disjoint
        assert not (p1 + s1 == p2 and s1 + s2 <= limit)  # merged whenever the limit allowed it
    # every byte of every block of every plane lies in exactly one range, and no range leaves the buffer
    assert ranges[0][0] >= base and ranges[-1][0] + ranges[-1][1] <= end + PAGE_BYTES
    for view in pool.views:
        for offset in view.chunk_offsets.tolist():
            for row in range(pool.num_blocks):
                first = view.base_ptr + offset + row * view.chunk_bytes
                last = first + view.chunk_bytes - 1
                holders = [(p, s) for p, s in ranges if p <= first < p + s]
                assert len(holders) == 1 and last < holders[0][0] + holders[0][1]


def test_rows_per_registration_only_when_a_plane_exceeds_the_limit():
    """Found by mutation testing of worker_side/host_pool.py (docs/mutation.md)."""
    assert rows_per_registration([PAGE_BYTES], 4, max_bytes=4 * PAGE_BYTES) is None
    assert rows_per_registration([PAGE_BYTES], 5, max_bytes=4 * PAGE_BYTES) == 4
    assert rows_per_registration([PAGE_BYTES // 4, PAGE_BYTES], 9, max_bytes=4 * PAGE_BYTES) == 4
    # 96-byte rows make a page every 128 rows: the cut is the largest multiple of 128 within the limit
    assert rows_per_registration([96], 300, max_bytes=96 * 255) == 128
    assert rows_per_registration([96], 300, max_bytes=96 * 128) == 128
    with pytest.raises(HostPoolError, match="cannot fit a page-aligned registration"):
        rows_per_registration([96], 300, max_bytes=96 * 127)


# ---- the buffer -------------------------------------------------------------------------------------------
def test_host_buffers_are_page_aligned_zeroed_and_never_empty():
    """Found by mutation testing of worker_side/host_memory.py (docs/mutation.md)."""
    for nbytes in (1, PAGE_BYTES + 1):
        buffer = allocate_host_buffer(nbytes)
        assert buffer.numel() == nbytes and buffer.dtype == torch.uint8 and not buffer.any()
        assert buffer.data_ptr() % PAGE_BYTES == 0
    with pytest.raises(ValueError, match="positive size"):
        allocate_host_buffer(0)



def vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= addr < hi
            elif line.startswith("VmFlags:") and mapping:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="needs Linux with transparent huge pages")
def test_the_pool_buffer_is_private_and_advised_for_huge_pages():
    """Private (a forked process never shares the pool's writes) and MADV_HUGEPAGE ('hg') from its first byte.

    Found by mutation testing of worker_side/host_memory.py (docs/mutation.md)."""
    buffer = allocate_host_buffer(3 << 20)
    flags = vm_flags(buffer.data_ptr())
    assert "hg" in flags and "sh" not in flags, flags


# ---- the NUMA hint: mbind(2) --------------------------------------------------------------------------------
def mbind_permitted() -> bool:
    """Whether this kernel and sandbox let a process set a memory policy at all (probed directly)."""
    number = {"x86_64": 237, "aarch64": 235}.get(platform.machine())
    if number is None or not os.path.exists("/sys/devices/system/node/node0"):
        return False
    region = mmap.mmap(-1, PAGE_BYTES)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(addr), ctypes.c_ulong(PAGE_BYTES), ctypes.c_int(0),
                      None, ctypes.c_ulong(0), ctypes.c_uint(0))  # MPOL_DEFAULT: changes nothing
    return rc == 0


def absent_node() -> int | None:
    for node in range(1, 63):
        if not os.path.exists(f"/sys/devices/system/node/node{node}"):
            return node
    return None


@pytest.mark.skipif(not mbind_permitted(), reason="no NUMA memory policy here (platform, kernel or sandbox)")
def test_the_pool_prefers_an_existing_numa_node_and_reports_any_other(caplog):
    """Found by mutation testing of worker_side/host_memory.py (docs/mutation.md)."""
    nbytes = 4 * PAGE_BYTES
    buffer = allocate_host_buffer(nbytes)
    assert _mbind_preferred(buffer.data_ptr(), nbytes, 0)
    for node in (-1, 64, absent_node()):
        if node is not None:
            assert not _mbind_preferred(buffer.data_ptr(), nbytes, node), node
    with caplog.at_level(logging.WARNING, logger="worker_side.host_memory"):
        assert allocate_host_buffer(nbytes, numa_node=0).numel() == nbytes
        assert not caplog.records
        assert allocate_host_buffer(nbytes, numa_node=64).numel() == nbytes
        assert [r.levelno for r in caplog.records] == [logging.WARNING] and "NUMA node 64" in caplog.text



class RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def syscall(self, *args):
        self.calls.append(args)
        return 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="mbind is wired for x86-64 and aarch64")
@pytest.mark.parametrize("node", [0, 5, 63])
def test_mbind_gets_a_preferred_policy_a_mask_it_reads_exactly_and_no_flags(monkeypatch, node):
    """mbind(addr, len, MPOL_PREFERRED, nodemask, maxnode, flags): the kernel reads maxnode - 1 bits of the
    mask, so maxnode is its size in bits + 1 (fewer drops the top node; more reads past the mask); no
    MPOL_MF_* flag (a preference must never fail because pages sit elsewhere).

    Found by mutation testing of worker_side/host_memory.py (docs/mutation.md)."""
    libc = RecordingLibc()
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *a, **k: libc)
    assert _mbind_preferred(4096, 8192, node)
    [args] = libc.calls
    assert len(args) == 7
    number, addr, nbytes, mode, mask_ref, maxnode, flags = args
    assert (number.value, addr.value, nbytes.value, mode.value) == ({"x86_64": 237, "aarch64": 235}[platform.machine()],
                                                                     4096, 8192, 1)
    mask = mask_ref._obj
    assert mask.value == 1 << node
    assert maxnode.value - 1 == 8 * ctypes.sizeof(mask)
    assert (flags.value if flags is not None else 0) == 0  # None is passed as 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64") or not os.path.exists("/sys/devices/system/node/node0")
                    or os.path.exists("/sys/devices/system/node/node63"), reason="needs Linux NUMA info without node 63")
def test_an_absent_top_node_is_reported_not_silently_dropped():
    """With maxnode 64 the kernel never saw bit 63: the call succeeded as 'allocate locally'.

    Found by mutation testing of worker_side/host_memory.py (docs/mutation.md)."""
    buffer = allocate_host_buffer(4 * PAGE_BYTES)
    assert not _mbind_preferred(buffer.data_ptr(), 4 * PAGE_BYTES, 63)
