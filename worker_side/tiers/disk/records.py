"""Record files moved straight between the host pool and disk with positional vector I/O.

`PoolSegments` names a block's bytes in the host pool as a list of writable memoryviews (one per plane:
tensor x chunk, in `HostPool[cpu_block_id]` order), so `os.preadv` / `os.pwritev` (which release the GIL)
move a record without an intermediate copy. `write_record` writes header + segments + padding under a
temporary name, optionally fsyncs, then renames it into place: a record is visible complete or not at all,
and a failure leaves no file behind. `read_record` reads one back; it checks ownership and size, the caller
checks the header and the checksum (`format.Verifier`). Neither keeps a file descriptor open on return.

O_DIRECT (`direct=True`) needs every buffer address and length on `ALIGN`: `PoolSegments.direct_ok` says
whether the pool's rows are; header and padding come from page-aligned per-thread buffers.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from offload_connector.disk.format import ALIGN, HEADER_BYTES, align_up
from worker_side.backends.cpu import run_segments
from worker_side.copy_plan import Segments

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
O_DIRECT = getattr(os, "O_DIRECT", 0)


class PoolSegments:
    """A block's bytes as memoryviews over host-pool planes. `planes`: (uint8 region, row stride, chunk
    offsets, chunk bytes) per tensor, as in `HostPool.views`."""

    def __init__(self, planes: Sequence[tuple[np.ndarray, int, Sequence[int], int]]) -> None:
        self._planes = [(region, int(stride), [int(o) for o in offsets], int(size))
                        for region, stride, offsets, size in planes]
        self.bytes_per_block = sum(len(offsets) * size for _, _, offsets, size in self._planes)
        self.direct_ok = all(region.ctypes.data % ALIGN == 0 and stride % ALIGN == 0 and size % ALIGN == 0
                             and all(o % ALIGN == 0 for o in offsets) for region, stride, offsets, size in self._planes)
        # per segment of a block, in order: its address in block 0's row, the row stride, its size
        self._seg_base = np.array([region.ctypes.data + o for region, _, offsets, _ in self._planes for o in offsets],
                                  np.int64)
        self._seg_stride = np.array([stride for _, stride, offsets, _ in self._planes for _ in offsets], np.int64)
        self._seg_bytes = np.array([size for _, _, offsets, size in self._planes for _ in offsets], np.int64)
        self._seg_at = np.concatenate([[0], np.cumsum(self._seg_bytes)[:-1]]).astype(np.int64)

    def gather(self, cpu_block_ids: Sequence[int], dst_addresses: Sequence[int]) -> None:
        """Copy each block's bytes (host-pool order) to `dst_addresses[i]` (`bytes_per_block` each), in one
        batched copy with the GIL released (the CPU backend's `run_segments`)."""
        ids = np.asarray(cpu_block_ids, np.int64)[:, None]
        src = (self._seg_base[None, :] + ids * self._seg_stride[None, :]).ravel()
        dst = (np.asarray(dst_addresses, np.int64)[:, None] + self._seg_at[None, :]).ravel()
        run_segments(Segments(dst, src, np.tile(self._seg_bytes, len(cpu_block_ids))))

    @classmethod
    def from_pool(cls, pool) -> PoolSegments:  # noqa: ANN001 - a worker_side.host_pool.HostPool
        return cls([(v.tensor.numpy(), v.block_stride, list(v.chunk_offsets), v.chunk_bytes) for v in pool.views])

    def segments(self, cpu_block_id: int) -> list[memoryview]:
        out = []
        for region, stride, offsets, size in self._planes:
            base = cpu_block_id * stride
            out.extend(memoryview(region[base + o:base + o + size]) for o in offsets)
        return out



class _Scratch(threading.local):
    """Per-thread page-aligned header and padding buffers (O_DIRECT needs aligned memory)."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.pad = mmap.mmap(-1, ALIGN)


_scratch = _Scratch()


def _all(op, fd: int, buffers: list, total: int) -> int:  # noqa: ANN001 - os.preadv or os.pwritev
    """Run a positional vector op over `buffers` from offset 0 until done, IOV_MAX buffers at a time;
    returns the bytes moved (short only at end of file)."""
    done, i = 0, 0
    views = [memoryview(b).cast("B") for b in buffers]
    while i < len(views):
        batch = views[i:i + IOV_MAX]
        want = sum(len(v) for v in batch)
        n = op(fd, batch, done)
        done += n
        if n == want:
            i += len(batch)
            continue
        if n == 0:
            return done
        # a short transfer: skip the buffers it completed, trim the one it split
        for j, v in enumerate(batch):
            if n < len(v):
                views = views[:i + j] + [v[n:]] + views[i + j + 1:]
                i += j
                break
            n -= len(v)
    return done


def write_record(dir_fd: int, name: str, tmp_name: str, header: bytes, segments: list, payload_bytes: int,
                 direct: bool, fsync: bool) -> None:
    """Write a record under `tmp_name`, then rename it to `name` (both in `dir_fd`). Raises OSError (no
    file left behind) when any step fails; a short write is ENOSPC."""
    pad = align_up(payload_bytes) - payload_bytes
    buffers: list = [header]
    if direct:
        hdr = _scratch.header
        hdr[:] = header
        buffers = [hdr]
    buffers += segments
    if pad and sum(len(s) for s in segments) == payload_bytes:  # a snapshot arrives padded already
        buffers.append(memoryview(_scratch.pad)[:pad])
    total = sum(len(b) for b in buffers)
    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
                 | (O_DIRECT if direct else 0), 0o600, dir_fd=dir_fd)
    try:
        try:
            if _all(os.pwritev, fd, buffers, total) != total:
                raise OSError(28, "short write (no space left on device)")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp_name, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def read_record(dir_fd: int, name: str, segments: list, payload_bytes: int, direct: bool) -> tuple[memoryview | None, str]:
    """Read the record `name` into `segments` (the block's host-pool rows). Returns (header, "") when
    the file was read whole, else (None, why): "missing" (no such file), "foreign: ..." (not ours), or a
    corruption. The caller verifies the header and checksum. Raises OSError on I/O errors."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | (O_DIRECT if direct else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        return None, "missing"
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return None, f"foreign: owned by uid {st.st_uid}"
        want = HEADER_BYTES + align_up(payload_bytes)
        if st.st_size != want:
            return None, f"file of {st.st_size} bytes instead of {want} (truncated or not ours)"
        pad = want - HEADER_BYTES - payload_bytes
        header = _scratch.header
        buffers = [header, *segments] + ([memoryview(_scratch.pad)[:pad]] if pad else [])
        if _all(os.preadv, fd, buffers, want) != want:
            return None, "truncated while read"
        if pad and _scratch.pad[:pad] != bytes(pad):
            return None, "padding after the payload is not zero"
        return memoryview(header), ""
    finally:
        os.close(fd)
