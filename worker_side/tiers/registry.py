"""Tier I/O by name: the config section name -> the `TierIO` class that moves its bytes on a rank (base.py).

`TIER_IOS` has one entry per name in `offload_connector.lower_tiers.LOWER_TIERS` (a test checks it).
"""

from __future__ import annotations

from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.tier_identity import TierIdentity
from worker_side.host_pool import HostPool
from worker_side.tiers.base import TierIO
from worker_side.tiers.disk.tier_io import DiskTierIO
from worker_side.tiers.remote_io import RemoteWorkerIO

# One entry per lower tier, in `LOWER_TIERS` order (nearest first); the key is the class's `name`.
TIER_IOS: dict[str, type[TierIO]] = {
    "disk": DiskTierIO,
    "remote": RemoteWorkerIO,
}


def check_tier_identity(config: object, identity: TierIdentity | None) -> None:
    """A configured lower tier needs the adapter's `TierIdentity`: `ValueError` naming the section if absent."""
    for name, _ in lower_tier_sections(config):
        if identity is None:
            raise ValueError(f"the {name} tier (config `{name}:`) needs the adapter to pass a tier identity; this "
                             f"adapter does not support it yet: remove the `{name}:` section")


def make_tier_ios(config: object, identity: TierIdentity | None, rank: int, world_size: int,
                  pool: HostPool) -> dict[str, TierIO]:
    """This rank's I/O of each configured lower tier by name, nearest first (empty without any)."""
    check_tier_identity(config, identity)
    return {name: TIER_IOS[name].create(section, identity, rank, world_size, pool)
            for name, section in lower_tier_sections(config) if identity is not None}
