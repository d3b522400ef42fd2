"""Lower tiers by name: the config section name -> the `LowerTier` class that serves it (base.py).

`TIERS` has one entry per name in `offload_connector.lower_tiers.LOWER_TIERS` (a test checks it);
`make_lower_tiers` builds the ones the config turns on, nearest first. Stats exporters list every
registered tier's counters from start-up, configured or not (`TIERS`).
"""

from __future__ import annotations

from offload_connector.lower_tiers import lower_tier_sections
from scheduler_side.tiers.base import LowerTier, TierContext
from scheduler_side.tiers.disk.tier import DiskTier
from scheduler_side.tiers.remote.tier import RemoteTier

# One entry per lower tier, in `LOWER_TIERS` order (nearest first); the key is the class's `name`.
TIERS: dict[str, type[LowerTier]] = {
    "disk": DiskTier,
    "remote": RemoteTier,
}


def make_lower_tiers(config: object, context: TierContext | None) -> dict[str, LowerTier]:
    """The configured lower tiers by name, nearest first (empty without any). `context` is None when the
    adapter gave no `TierIdentity`: then a configured tier raises `ValueError` naming its section."""
    tiers: dict[str, LowerTier] = {}
    for name, section in lower_tier_sections(config):
        if context is None:
            raise ValueError(f"the {name} tier (config `{name}:`) needs the adapter to pass a tier identity; this "
                             f"adapter does not support it yet: remove the `{name}:` section")
        tiers[name] = TIERS[name].create(section, context)
    return tiers
