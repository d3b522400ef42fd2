"""How many CPU blocks a configuration buys, and whether the host can hold them. Shared by every face
(the vLLM adapter's early check and its roles, the worker, `offload-connector check`) so they agree.

The CPU tier is sized per worker rank: `cpu_bytes` is for the whole engine and is divided evenly across
the `world_size` tensor-parallel ranks; each rank's pool holds the same number of blocks (block 0 is the
reserved null block and holds no data, so a pool of n blocks caches n - 1). `num_cpu_blocks`, when set,
overrides `cpu_bytes`. Ranks whose KV is byte-identical (MLA's latent, replicated on every TP rank) map
one pool between them (`shared_by` ranks per pool): `cpu_bytes` is then divided among the pools, not the
ranks, so a pool shared by every rank holds as many blocks at TP 2 as at TP 1.

Every refusal is a `ConfigError` naming `cpu_bytes` (or `num_cpu_blocks`), the value as the user wrote it
and what is allowed, with sizes in human units (`format_bytes`). This module imports nothing but the config types.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offload_connector.config import ConfigError, OffloadConfig
from offload_connector.sizes import written

MEMINFO = "/proc/meminfo"
SHM_DIR = "/dev/shm"  # where a pool shared by several ranks' processes lives (worker_side/shared_pool.py)
_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
# A bare number this small is no byte count for a CPU tier: it reads as a GiB count ("did you mean 8GiB?").
GIB_TYPO_BELOW = 1024


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1, e.g. "32 KiB", "7.99 GiB", "10 TiB"."""
    for size, unit in _UNITS:
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{int(n)} B"


def mem_available_bytes(path: str = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where the kernel does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def num_pools(world_size: int, shared_by: int) -> int:
    """Host pools of an engine of `world_size` ranks, `shared_by` ranks mapping each pool."""
    if world_size <= 0 or shared_by <= 0 or world_size % shared_by:
        raise ValueError(f"world_size={world_size} must be a positive multiple of shared_by={shared_by} (our bug)")
    return world_size // shared_by


def num_cpu_blocks(config: OffloadConfig, bytes_per_block: int, world_size: int = 1, shared_by: int = 1) -> int:
    """Number of CPU blocks (including the null block 0) per pool, i.e. per rank: each rank sees its pool.
    Raises ConfigError if fewer than 2."""
    if config.num_cpu_blocks is not None:
        return config.num_cpu_blocks
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block={bytes_per_block} must be positive")
    pools = num_pools(world_size, shared_by)
    cpu_bytes = int(config.cpu_bytes)
    n = cpu_bytes // pools // bytes_per_block
    if n < 2:
        ranks = f" per rank x {world_size} ranks" if pools > 1 else ""
        as_written = written(config.cpu_bytes)
        bare = isinstance(as_written, int) or str(as_written).strip().isdigit()  # no unit: a GiB count, likely
        raise ConfigError(
            "cpu_bytes", as_written,
            f">= {format_bytes(2 * bytes_per_block * pools)} ({2 * bytes_per_block * pools} bytes: "
            f"2 blocks of {format_bytes(bytes_per_block)}{ranks})",
            "the CPU pool would hold fewer than 2 blocks per rank; block 0 is reserved",
            guess=f"{cpu_bytes}GiB" if bare and cpu_bytes < GIB_TYPO_BELOW else "",
        )
    return n


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one rank's CPU tier holds: `num_cpu_blocks` includes the null block, `usable_blocks` not."""

    num_cpu_blocks: int
    bytes_per_block: int
    block_size: int  # tokens per block
    world_size: int
    shared_by: int = 1  # ranks mapping one pool (their KV byte-identical: MLA's latent); 1: a pool per rank

    @property
    def usable_blocks(self) -> int:
        return self.num_cpu_blocks - 1

    @property
    def tokens(self) -> int:
        return self.usable_blocks * self.block_size

    @property
    def bytes_per_rank(self) -> int:
        """Host memory of one rank's pool (the null block included: it is allocated too)."""
        return self.num_cpu_blocks * self.bytes_per_block

    @property
    def pools(self) -> int:
        return num_pools(self.world_size, self.shared_by)

    def describe(self) -> str:
        """E.g. "8.00 GiB per rank x 2 ranks = 262,143 blocks of 32 KiB = 4,194,288 tokens per rank", or
        with one pool for every rank "8.00 GiB shared by 2 ranks (replicated KV stored once) = ..."."""
        if self.shared_by > 1:
            pools = f" x {self.pools} pools" if self.pools > 1 else ""
            return (f"{format_bytes(self.bytes_per_rank)} shared by {self.shared_by} ranks (replicated KV stored "
                    f"once){pools} = {self.usable_blocks:,} blocks of {format_bytes(self.bytes_per_block)} = "
                    f"{self.tokens:,} tokens")
        ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
        return (f"{format_bytes(self.bytes_per_rank)} per rank{ranks} = {self.usable_blocks:,} blocks of "
                f"{format_bytes(self.bytes_per_block)} = {self.tokens:,} tokens")


def capacity(config: OffloadConfig, bytes_per_block: int, block_size: int, world_size: int = 1,
             shared_by: int = 1) -> Capacity:
    return Capacity(num_cpu_blocks(config, bytes_per_block, world_size, shared_by), bytes_per_block, block_size,
                    world_size, shared_by)


def check_host_memory(config: OffloadConfig, cap: Capacity, ranks_on_host: int, available: int | None) -> None:
    """Refuse a tier the host cannot hold: the pools of the `ranks_on_host` ranks this host runs (ranks
    sharing a pool count once) must fit in `available` bytes (MemAvailable; None: the kernel does not say,
    nothing is checked)."""
    if available is None:
        return
    pools_on_host = max(1, ranks_on_host // cap.shared_by)
    needed = cap.bytes_per_rank * pools_on_host
    if needed <= available:
        return
    ranks = f"{pools_on_host} ranks' pools" if pools_on_host > 1 else "the pool"
    per_rank = f" ({format_bytes(available // pools_on_host)} per rank)" if pools_on_host > 1 else ""
    if config.num_cpu_blocks is not None:
        raise ConfigError(
            "num_cpu_blocks", config.num_cpu_blocks,
            f"<= {available // pools_on_host // cap.bytes_per_block:,} blocks of {format_bytes(cap.bytes_per_block)} "
            f"here: this host's MemAvailable is {format_bytes(available)}{per_rank}",
            f"{ranks} would take {format_bytes(needed)}")
    raise ConfigError(
        "cpu_bytes", written(config.cpu_bytes),
        f"<= {format_bytes(available * cap.pools // pools_on_host)} here: this host's MemAvailable is "
        f"{format_bytes(available)}{per_rank}",
        f"{ranks} would take {format_bytes(needed)}; cpu_bytes is for the whole engine")


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes free in the shared-memory file system at `path`, or None where it does not exist."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_shared_memory(config: OffloadConfig, cap: Capacity, free: int | None) -> None:
    """A pool shared by several ranks lives in a file of the shared-memory file system (SHM_DIR): refuse one
    larger than its `free` bytes (a container's default /dev/shm is 64 MiB) before anything is allocated."""
    if cap.shared_by == 1 or free is None or cap.bytes_per_rank <= free:
        return
    key, value = ("num_cpu_blocks", config.num_cpu_blocks) if config.num_cpu_blocks is not None else \
        ("cpu_bytes", written(config.cpu_bytes))
    raise ConfigError(
        key, value,
        f"a pool <= {format_bytes(free)} here ({free // cap.bytes_per_block:,} blocks of "
        f"{format_bytes(cap.bytes_per_block)}), or more room in {SHM_DIR} (docker run --shm-size or --ipc=host)",
        f"the {cap.shared_by} ranks holding replicated KV (MLA's latent) share one pool of "
        f"{format_bytes(cap.bytes_per_rank)} in {SHM_DIR}, which has {format_bytes(free)} free")
