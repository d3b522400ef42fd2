"""The CPU tier's eviction policies by name: what the config's `eviction` key chooses.

`eviction_policy(name)` is the policy class, or a `ValueError` naming the key, the value and the names
allowed. A new policy: one module beside this one (a subclass of `EvictionPolicy`, base.py) and one entry
in `EVICTION_POLICIES`; the config's `eviction` choices list the same names (a test keeps them in step).
"""

from __future__ import annotations

from scheduler_side.pool.eviction.arc import ArcEviction
from scheduler_side.pool.eviction.base import EvictionPolicy
from scheduler_side.pool.eviction.lru import LruEviction

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LruEviction,
    "arc": ArcEviction,
}


def eviction_policy(name: str) -> type[EvictionPolicy]:
    """The policy class registered as `name`; raises `ValueError` for an unknown name."""
    policy = EVICTION_POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown eviction {name!r}; allowed: {', '.join(EVICTION_POLICIES)}")
    return policy
