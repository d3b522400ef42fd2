"""What the simulated device's table-driven kernels copy (cuda_sim.py): both the block-copy kernel and the
staged gather/scatter read a plane table (`[src_base, dst_base, src_stride, dst_stride, bytes]` int64 per
plane) and block id lists from memory, and copy plane p of every block pair; and what each launch needs
of memory (a launch breaking it is a fault)."""

from __future__ import annotations

import numpy as np

from worker_side.copy_plan import Segments
from worker_side.testing.sim_memory import SimMemory, read_int64


def table_bytes(planes_ptr: int, num_planes: int) -> int:
    """Bytes one block pair moves: the sum of the table's plane sizes (read now)."""
    return int(read_int64(planes_ptr, num_planes * 5).reshape(num_planes, 5)[:, 4].sum())


def table_segments(planes_ptr: int, num_planes: int, src_ids_ptr: int, dst_ids_ptr: int,
                   num_blocks: int) -> Segments:
    """The segments the kernel copies, from the table and ids as they are in memory now (when it runs)."""
    planes = read_int64(planes_ptr, num_planes * 5).reshape(num_planes, 5)[:, :, None]
    src_ids, dst_ids = read_int64(src_ids_ptr, num_blocks), read_int64(dst_ids_ptr, num_blocks)
    return Segments((planes[:, 1] + dst_ids * planes[:, 3]).ravel(),
                    (planes[:, 0] + src_ids * planes[:, 2]).ravel(),
                    np.broadcast_to(planes[:, 4], (num_planes, num_blocks)).ravel().copy())


def block_copy_fault(memory: SimMemory, device: int, planes_ptr: int, num_planes: int, ids_ptr: int,
                     num_blocks: int, host_pointer_ok: bool) -> str | None:
    """Why CUDA would refuse (or fault on) a block-copy launch with these tables, or None. Its tables are
    registered host memory the kernel reads at their host address (`host_pointer_ok`: the device can)."""
    if not host_pointer_ok:
        return (f"launch_block_copy on device {device}: CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0, so the "
                "kernel cannot read registered host memory at its host address (CUDA_ERROR_ILLEGAL_ADDRESS, sticky)")
    return (_unregistered("launch_block_copy", memory, device, planes_ptr, num_planes * 40)
            or _unregistered("launch_block_copy", memory, device, ids_ptr, num_blocks * 16))


def staged_copy_fault(memory: SimMemory, device: int, planes_ptr: int, num_planes: int, src_ids_ptr: int,
                      dst_ids_ptr: int, num_blocks: int) -> str | None:
    """Why CUDA would refuse a staged gather/scatter launch, or None: 1..1024 blocks, its plane table in the
    device's memory, its id lists in host memory registered on it."""
    if not 0 < num_blocks <= 1024:
        return f"launch_staged_copy: {num_blocks} blocks; the kernel takes 1..1024"
    if not memory.device_ok(np.array([planes_ptr], np.int64), np.array([num_planes * 40], np.int64), device)[0]:
        return f"launch_staged_copy: plane table at {planes_ptr:#x} is not device memory of device {device}"
    return (_unregistered("launch_staged_copy", memory, device, src_ids_ptr, num_blocks * 8)
            or _unregistered("launch_staged_copy", memory, device, dst_ids_ptr, num_blocks * 8))


def _unregistered(op: str, memory: SimMemory, device: int, ptr: int, nbytes: int) -> str | None:
    if memory.table_registered(ptr, nbytes, device):
        return None
    return f"{op}: argument table at {ptr:#x} ({nbytes} bytes) is not in host memory registered on device {device}"
