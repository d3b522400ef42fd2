"""The host pool: one page-aligned uint8 buffer holding `num_cpu_blocks` blocks of every registered tensor.

Each registered tensor's blocks are `num_chunks` byte chunks (1 for block-first tensors, 2 for K/V-first,
one per head for head-major views; see block_layout). Row = CPU block id (row 0 is the reserved null block,
allocated but never copied). Two physical layouts, chosen by the transfer backend (`HOST_LAYOUTS`):
- `planes` (chunk-major; the CPU backend): one *plane* per (tensor, chunk), `num_cpu_blocks` rows of
  `chunk_bytes`, each starting on a page. A run of consecutive CPU blocks is one contiguous byte range per
  plane; whenever the engine's tensor also keeps that chunk of consecutive blocks adjacent (all of vLLM's
  layouts do), a run of blocks is one copy per plane, whatever the block count.
- `blocks` (block-major; the CUDA backend): CPU block b is the one contiguous range
  `[b * bytes_per_block, (b + 1) * bytes_per_block)`, its chunks placed in the order of their addresses in
  the engine's block 0 (`chunk_order`), so chunks adjacent in the engine's block are adjacent here too and a
  copy merges them (copy_plan). A block moves as one range: one DMA segment from a staging buffer, or from an
  engine whose blocks are contiguous across layers (vLLM's block-outermost layouts).

Registration ranges (`registration_ranges`) are whole planes (for `blocks`: the one plane of whole blocks)
merged up to `MAX_REGISTRATION_BYTES` (64 GiB: one `cudaHostRegister` over hundreds of GiB fails, vLLM
#51080), and a plane larger than that is cut every `rows_per_registration` rows, a page-aligned row
boundary. No page belongs to two ranges and, with runs cut at those rows (`copy_plan`), no copy straddles two.

Invariants: the buffer is never resized; sizes are checked (>= 2 blocks, fits in MemAvailable) before
anything is allocated. Only the backend's copies write it. `pool[cpu_block_id]` returns a block's bytes in
tensor order, each tensor's chunks in order, whatever the physical layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from offload_connector.sizing import MEMINFO, format_bytes, mem_available_bytes  # noqa: F401 - re-exported
from worker_side.block_layout import TensorBlockView
from worker_side.errors import HostPoolError
from worker_side.host_memory import PAGE_BYTES, align_up, allocate_host_buffer

MAX_REGISTRATION_BYTES = 64 << 30
PLANES, BLOCKS = "planes", "blocks"
HOST_LAYOUTS = (PLANES, BLOCKS)


def check_pool_size(num_cpu_blocks: int, bytes_per_block: int, available: int | None,
                    buffer_bytes: int | None = None) -> int:
    """Validate a pool size before allocating; return the bytes to allocate or raise HostPoolError."""
    if num_cpu_blocks < 2:
        raise HostPoolError(f"host pool of num_cpu_blocks={num_cpu_blocks} is too small; allowed: >= 2 "
                            "(block 0 is the reserved null block); raise cpu_bytes or num_cpu_blocks")
    if bytes_per_block <= 0:
        raise HostPoolError(f"bytes_per_block={bytes_per_block}; register non-empty KV caches first")
    nbytes = num_cpu_blocks * bytes_per_block if buffer_bytes is None else buffer_bytes
    if available is not None and nbytes > available:
        raise HostPoolError(
            f"host pool of {num_cpu_blocks:,} blocks x {format_bytes(bytes_per_block)} = {format_bytes(nbytes)} "
            f"does not fit in available memory ({format_bytes(available)}, MemAvailable); allowed: cpu_bytes / "
            f"num_cpu_blocks giving <= {available // bytes_per_block:,} blocks")
    return nbytes


@dataclass(frozen=True, slots=True)
class _Plane:
    offset: int  # bytes from the buffer start, a multiple of the page size
    chunk_bytes: int

    def padded_bytes(self, num_rows: int) -> int:
        return align_up(num_rows * self.chunk_bytes, PAGE_BYTES)


def rows_per_registration(chunk_sizes: Sequence[int], num_rows: int,
                          max_bytes: int = MAX_REGISTRATION_BYTES) -> int | None:
    """Rows after which every plane is cut into separate registrations, or None when no plane needs it.

    A multiple of the rows that make a page for every plane's chunk size (so cuts fall on page
    boundaries), with at most `max_bytes` per cut piece of the largest plane."""
    largest = max(chunk_sizes)
    if num_rows * largest <= max_bytes:
        return None
    step = max(PAGE_BYTES // int(np.gcd(PAGE_BYTES, c)) for c in chunk_sizes)
    rows = (max_bytes // largest) // step * step
    if rows < step:
        raise HostPoolError(f"a KV chunk of {largest} bytes cannot fit a page-aligned registration of "
                            f"{max_bytes} bytes (our limit); allowed: chunks below {max_bytes // step} bytes")
    return rows


def merges_across_tensors(views: Sequence[TensorBlockView]) -> bool:
    """Whether a chunk of one tensor's block ends where another tensor's chunk of the same block begins, with
    the same block stride: per-layer views of one allocation whose blocks are contiguous across layers
    (vLLM's block-outermost layouts), which a `blocks` pool copies as one range per block."""
    ends = {}
    for v in views:
        for o in v.chunk_offsets:
            ends[(v.base_ptr + int(o) + v.chunk_bytes, v.block_stride)] = v.name
    return any(ends.get((v.base_ptr + int(o), v.block_stride), v.name) != v.name
               for v in views for o in v.chunk_offsets)


def chunk_order(views: Sequence[TensorBlockView]) -> list[tuple[int, int]]:
    """(view index, chunk index) of every chunk, in the order of its address in the engine's block 0 (ties:
    registration order): the order of a `blocks` pool's chunks inside each block."""
    keys = [(v.base_ptr + int(o), i, k) for i, v in enumerate(views) for k, o in enumerate(v.chunk_offsets)]
    return [(i, k) for _, i, k in sorted(keys)]


class HostPool:
    """Host memory for `num_cpu_blocks` blocks in one page-aligned buffer; index it with a CPU block id."""

    def __init__(self, views: Sequence[TensorBlockView], num_cpu_blocks: int,
                 allocate: Callable[[int], torch.Tensor] = allocate_host_buffer, available: int | None = None,
                 max_registration_bytes: int | None = None, layout: str = PLANES) -> None:
        if layout not in HOST_LAYOUTS:
            raise HostPoolError(f"host pool layout {layout!r}; allowed: {', '.join(HOST_LAYOUTS)} (our bug)")
        if max_registration_bytes is None:
            max_registration_bytes = MAX_REGISTRATION_BYTES  # read at call time (tests lower it)
        self.layout = layout
        self.bytes_per_block = sum(v.block_bytes for v in views)
        self.num_blocks = num_cpu_blocks
        if layout == BLOCKS:
            self._planes = [_Plane(0, self.bytes_per_block)] if self.bytes_per_block else []
            offset = self._planes[0].padded_bytes(num_cpu_blocks) if self._planes else 0
        else:
            planes: list[list[_Plane]] = []
            offset = 0
            for v in views:
                planes.append([])
                for _ in range(v.num_chunks):
                    plane = _Plane(offset, v.chunk_bytes)
                    planes[-1].append(plane)
                    offset += plane.padded_bytes(num_cpu_blocks)
            self._planes = [p for per_view in planes for p in per_view]
        nbytes = check_pool_size(num_cpu_blocks, self.bytes_per_block,
                                 mem_available_bytes() if available is None else available, buffer_bytes=offset)
        self.rows_per_registration = rows_per_registration([p.chunk_bytes for p in self._planes], num_cpu_blocks,
                                                           max_registration_bytes)
        self._max_registration_bytes = max_registration_bytes
        buffer = allocate(nbytes)
        if buffer.dtype != torch.uint8 or buffer.numel() != nbytes or buffer.device.type != "cpu":
            raise HostPoolError(f"allocated {buffer.numel()} {buffer.dtype} on {buffer.device}; "
                                f"expected exactly {nbytes} uint8 bytes on cpu (our bug)")
        self.buffer = buffer
        self.views: list[TensorBlockView] = (self._block_views(views) if layout == BLOCKS
                                             else self._plane_views(views, planes))

    def _plane_views(self, views: Sequence[TensorBlockView], planes: list[list[_Plane]]) -> list[TensorBlockView]:
        out = []
        for v, per_view in zip(views, planes, strict=True):
            first, last = per_view[0], per_view[-1]
            region = self.buffer[first.offset:last.offset + self.num_blocks * last.chunk_bytes]
            out.append(TensorBlockView(
                name=v.name, tensor=region, num_blocks=self.num_blocks, base_ptr=region.data_ptr(),
                block_stride=v.chunk_bytes,
                chunk_offsets=np.array([p.offset - first.offset for p in per_view], np.int64),
                chunk_bytes=v.chunk_bytes, num_heads=v.num_heads, head_bytes=v.head_bytes))
        return out

    def _block_views(self, views: Sequence[TensorBlockView]) -> list[TensorBlockView]:
        return block_major_views(views, self.buffer, self.num_blocks)

    def views_at(self, buffer: torch.Tensor, num_blocks: int) -> list[TensorBlockView]:
        """This pool's block geometry placed over `buffer` (`num_blocks` rows): a staging buffer whose block
        j holds a CPU block's bytes exactly as the pool does. `blocks` layout only."""
        if self.layout != BLOCKS:
            raise HostPoolError(f"views_at needs a {BLOCKS!r} pool, this one is {self.layout!r} (our bug)")
        return block_major_views(self.views, buffer, num_blocks, keep_offsets=True)

    @property
    def nbytes(self) -> int:
        """Bytes of block data (`num_blocks * bytes_per_block`); the buffer adds page padding per plane."""
        return self.num_blocks * self.bytes_per_block

    @property
    def buffer_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_blocks, self.bytes_per_block)

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, cpu_block_id: int) -> torch.Tensor:
        """A copy of CPU block `cpu_block_id`'s bytes across all tensors (uint8, bytes_per_block long)."""
        if not 0 <= cpu_block_id < self.num_blocks:
            raise IndexError(f"cpu_block_id {cpu_block_id} out of range [0, {self.num_blocks})")
        return torch.cat([v.block_tensor(cpu_block_id) for v in self.views])

    def registration_ranges(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) ranges to pin: page-aligned, disjoint pages, each <= the registration limit."""
        base, rows, limit = self.buffer.data_ptr(), self.rows_per_registration, self._max_registration_bytes
        pieces: list[tuple[int, int]] = []  # (offset, padded bytes) in address order
        for p in self._planes:
            if rows is None:
                pieces.append((p.offset, p.padded_bytes(self.num_blocks)))
                continue
            for first_row in range(0, self.num_blocks, rows):
                n = min(rows, self.num_blocks - first_row)
                pieces.append((p.offset + first_row * p.chunk_bytes, align_up(n * p.chunk_bytes, PAGE_BYTES)))
        ranges: list[tuple[int, int]] = []
        for offset, size in pieces:
            if ranges and ranges[-1][0] + ranges[-1][1] == offset and ranges[-1][1] + size <= limit:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + size)
            else:
                ranges.append((offset, size))
        return [(base + off, size) for off, size in ranges]


def block_major_views(views: Sequence[TensorBlockView], buffer: torch.Tensor, num_blocks: int,
                      keep_offsets: bool = False) -> list[TensorBlockView]:
    """Views of `buffer` as `num_blocks` contiguous blocks holding the chunks of `views`: each chunk at its
    place in `chunk_order` (or, with `keep_offsets`, at the offsets `views` already have: the views of a
    `blocks` pool placed over another buffer)."""
    bytes_per_block = sum(v.block_bytes for v in views)
    if keep_offsets:
        offsets = [[int(o) for o in v.chunk_offsets] for v in views]
    else:
        offsets = [[0] * v.num_chunks for v in views]
        at = 0
        for i, k in chunk_order(views):
            offsets[i][k] = at
            at += views[i].chunk_bytes
    if buffer.numel() < num_blocks * bytes_per_block:
        raise HostPoolError(f"a buffer of {buffer.numel()} bytes cannot hold {num_blocks} blocks of "
                            f"{bytes_per_block} bytes (our bug)")
    return [TensorBlockView(name=v.name, tensor=buffer, num_blocks=num_blocks, base_ptr=buffer.data_ptr(),
                            block_stride=bytes_per_block, chunk_offsets=np.array(offs, np.int64),
                            chunk_bytes=v.chunk_bytes, num_heads=v.num_heads, head_bytes=v.head_bytes)
            for v, offs in zip(views, offsets, strict=True)]

