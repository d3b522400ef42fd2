"""One host pool mapped by several ranks' processes: for KV that is byte-identical on those ranks.

With MLA (DeepSeek-style attention) every tensor-parallel rank keeps the same latent: a pool per rank would
hold the same bytes `num_ranks` times. Instead the ranks of one engine on one host map one file of the
shared-memory file system (`SharedPoolSpec.path`, under /dev/shm): rank 0 alone stores into it, and every
rank loads from it. `cpu_bytes` then buys as many blocks at TP n as at TP 1 (sizing.py, `shared_by`).

Why not a slice per rank gathered at load: measured, a collective on the load path costs ~40x a copy from
a shared mapping on CPUs (benchmarks/bench_replicated_kv.py; docs/vllm.md has the figures).

Invariants:
- `allocate` is called by every rank at once (vLLM registers KV caches on every rank together): rank 0
  creates the file (`O_EXCL`: never another engine's) and sizes it, every rank maps it after the first
  barrier, and rank 0 unlinks it after the second, so the kernel frees it with the last mapping; a crash
  leaves nothing behind after that point (`unlink` at shutdown covers the start-up window).
- only rank 0 writes (`stores`): the other ranks report their share of a store done at once, and the
  scheduler counts a store complete only when every rank reported it, so a block is a hit only after rank 0
  copied it; a load's CPU blocks stay held until every rank reported its load done, so no store overwrites
  a slot another rank still reads. The scheduler never lends a slot loaded in the same step to a store
  (`lend_load_slots=False`): ranks do not order their copies against one another.
Imports nothing from the scheduler side; the adapter supplies the path, the rank and the barrier.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker_side.errors import HostPoolError


@dataclass(frozen=True, slots=True)
class SharedPoolSpec:
    """Where and with whom the pool is shared; `barrier()` returns once every one of `num_ranks` called it."""

    path: str
    rank: int  # in [0, num_ranks): rank 0 creates the file and is the only rank that stores
    num_ranks: int
    barrier: Callable[[], None]

    def __post_init__(self) -> None:
        if self.num_ranks < 2 or not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"shared pool of {self.num_ranks} ranks, rank {self.rank}: need 2+ ranks and a "
                             "rank among them (our bug)")

    @property
    def stores(self) -> bool:
        """Whether this rank copies stores into the pool (rank 0 only)."""
        return self.rank == 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """`nbytes` zero-filled bytes mapped by every rank (call on every rank together)."""
        if self.rank == 0:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except OSError as exc:
                raise HostPoolError(f"could not create the shared host pool {self.path}: {exc.strerror}") from None
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        self.barrier()
        try:
            buffer = _map(self.path, nbytes)
        finally:
            self.barrier()  # every rank mapped it (or failed): the name can go
            if self.rank == 0:
                self.unlink()
        return buffer

    def unlink(self) -> None:
        """Remove the file's name (rank 0; idempotent). Mappings stay valid."""
        if self.rank == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _map(path: str, nbytes: int) -> torch.Tensor:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise HostPoolError(f"could not open the shared host pool {path}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:  # rank 0 sized it before the barrier
            raise HostPoolError(f"the shared host pool {path} has {size} bytes; expected {nbytes} (another "
                                "engine's file, or ranks that disagree on the pool's size)")
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # keeps `mapped` alive as long as any view
