"""How many CPU blocks a configuration buys. Shared by both sides so they agree on the pool size.

The CPU tier is sized per worker rank: `cpu_bytes` is for the whole engine and is divided evenly across
the `world_size` tensor-parallel ranks; each rank's pool holds the same number of blocks (block 0 is the
reserved null block and holds no data). `num_cpu_blocks`, when set, overrides `cpu_bytes`.
"""

from __future__ import annotations

from offload_connector.config import ConfigError, OffloadConfig


def num_cpu_blocks(config: OffloadConfig, bytes_per_block: int, world_size: int = 1) -> int:
    """Number of CPU blocks (including the null block 0) per rank. Raises ConfigError if fewer than 2."""
    if config.num_cpu_blocks is not None:
        return config.num_cpu_blocks
    if bytes_per_block <= 0 or world_size <= 0:
        raise ValueError(f"bytes_per_block={bytes_per_block} and world_size={world_size} must be positive")
    per_rank = int(config.cpu_bytes) // world_size
    n = per_rank // bytes_per_block
    if n < 2:
        raise ConfigError(
            "cpu_bytes", config.cpu_bytes,
            f">= {2 * bytes_per_block * world_size} bytes (2 blocks of {bytes_per_block} bytes per rank "
            f"x {world_size} ranks)", "the CPU pool would hold fewer than 2 blocks",
        )
    return n
