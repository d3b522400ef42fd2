"""The tiers below the CPU tier, as the configuration names them (shared by both sides).

Each lower tier is one optional section of `OffloadConfig` (config.py; None: that tier is off) and one
entry under the same name in each side's registry: scheduler_side/tiers/registry.py (what the scheduler
decides) and worker_side/tiers/registry.py (what each rank moves). `LOWER_TIERS` orders them nearest
(fastest) first: on a CPU miss the scheduler asks them in this order, and a step's `TierOps` follow it.
Imports nothing from the project, no torch.
"""

from __future__ import annotations

from typing import Any

LOWER_TIERS: tuple[str, ...] = ("disk", "remote")


def lower_tier_sections(config: Any) -> list[tuple[str, Any]]:
    """(name, section) of each lower tier `config` (an `OffloadConfig`) turns on, nearest first."""
    return [(name, section) for name in LOWER_TIERS if (section := getattr(config, name)) is not None]
