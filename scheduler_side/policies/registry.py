"""The store policies by name: what the config's `store_policy` key chooses.

`make_store_policy(name, view)` builds the policy over the scheduler's `StorePolicyView`, or raises a
`ValueError` naming the key, the value and the names allowed. A new policy: a `StorePolicy` subclass in a
module beside this one, one entry in `STORE_POLICIES`, and its name in the config's `store_policy` choices.
"""

from __future__ import annotations

from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.policies.store_policy import EagerStorePolicy, StorePolicy, StorePolicyView

STORE_POLICIES: dict[str, type[StorePolicy]] = {
    "eager": EagerStorePolicy,
    "lazy": LazyStorePolicy,
}


def make_store_policy(name: str, view: StorePolicyView) -> StorePolicy:
    policy = STORE_POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown store_policy {name!r}; allowed: {', '.join(STORE_POLICIES)}")
    return policy(view)
