"""The block-copy kernel's arguments, in registered host memory, and its launch (a part of the CUDA backend).

The kernel (segment_copy.cu) reads a direction's plane table (fixed at bind) and a job's block ids when it
runs, not when it is launched, so both live in one registered host buffer owned here: the two plane tables,
then one id ring (arg_ring.py) per copy stream (shared when loads and stores share a stream). `launch`
writes a job's ids into its stream's ring and launches; the entries are released by the backend once the
job's completion event fired (`release`), or given back at once when the launch raised (CUDA enqueued
nothing then). Built only where the kernel will be used; `ptr` is the registration to undo at shutdown.
"""

from __future__ import annotations

import numpy as np

from worker_side.backends.base import JobKind
from worker_side.backends.cuda.api import CudaRuntime, Stream
from worker_side.backends.cuda.arg_ring import ArgRing
from worker_side.copy_plan import CopyGeometry
from worker_side.host_memory import allocate_host_buffer


class KernelArgs:
    def __init__(self, rt: CudaRuntime, geometry: dict[JobKind, CopyGeometry], shared_stream: bool,
                 ring_entries: int) -> None:
        """Allocate and register the buffer; a CudaError from the registration propagates (nothing kept)."""
        self.rt, self.geometry = rt, geometry
        kinds: tuple[JobKind, ...] = ("load",) if shared_stream else ("load", "store")
        tables = {kind: geometry[kind].plane_table().ravel() for kind in ("load", "store")}
        num_table = sum(len(t) for t in tables.values())
        memory = allocate_host_buffer(8 * (num_table + len(kinds) * ring_entries))
        rt.host_register(memory.data_ptr(), memory.numel())
        self.ptr, self._memory = memory.data_ptr(), memory  # keeps the tables and rings alive
        words = memory.numpy().view(np.int64)
        self.plane_tables: dict[JobKind, int] = {}
        self.rings: dict[JobKind, ArgRing] = {}
        at = 0
        for kind, table in tables.items():
            words[at:at + len(table)] = table
            self.plane_tables[kind] = words[at:].ctypes.data
            at += len(table)
        for kind in kinds:
            self.rings[kind] = ArgRing(words[at:at + ring_entries])
            at += ring_entries
        if shared_stream:
            self.rings["store"] = self.rings["load"]

    def launch(self, kind: JobKind, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Stream) -> int | None:
        """One kernel launch; the ring entries it holds, or None when the ring is full. A launch that raises
        enqueued nothing: its entries are given back before the error propagates."""
        ring = self.rings[kind]
        args = ring.write(src_ids, dst_ids)
        if args is None:
            return None
        try:
            self.rt.launch_block_copy(self.plane_tables[kind], self.geometry[kind].num_planes, args[0], len(src_ids),
                                      stream)
        except BaseException:
            ring.unwrite(args[1])
            raise
        return args[1]

    def release(self, kind: JobKind, num_entries: int) -> None:
        self.rings[kind].release(num_entries)
