"""Which GPU blocks to store to the CPU tier each step: the policy interface and the eager policy.

A policy sees the scheduler through a read-only `StorePolicyView` and never changes the pools itself: hooks that
want a pool changed *return* what to change, and the scheduler applies it. A hook may change only the
policy's own state and, where its docstring says so, the request's store cursor
(`RequestState.num_store_checked_blocks`). Call order, per engine step (the scheduler's):
1. lookup: `may_admit(state, cpu_hit_blocks)` -> admit now, or ask again next step (the scheduler counts the
   deferral in `state.num_deferrals`);
2. allocation: `on_allocated(state, gpu_hit_blocks)` -> CPU keys whose copies to discard;
   `on_blocks_allocated(n)` for every block the engine took from its free queue;
3. metadata: `on_scheduled(state, num_computed_tokens)` per scheduled request; then `pick_stores()` once
   (it advances the policy's step clock) -> `StorePicks`; the scheduler emits the store event and drops
   `picks.release_gpu_ids` (having first made `picks.refresh_keys`' CPU copies most recently used); then
   `on_stores_emitted(event_id, stored_gpu_ids)`;
   Before emitting the store, `lends_load_slots()`: may this step's stores be written into the slots of
   blocks this step's loads read (their CPU copies forgotten now rather than when the load completes)?
4. completions: `on_load_complete(job)` -> forget the job's CPU copies?; `stored_blocks_places(event_id)` ->
   where the stored GPU blocks go back into the free queue, then `on_store_complete(event_id)` once they
   were freed;
5. finish: `on_request_finished(state)` -> GPU blocks to hold (one reference each) until the next
   `pick_stores`, which lists them again in `release_gpu_ids`.
At any point: `on_cpu_evicted(key)` when the tiers drop `key`'s copy to make room (not a copy given up): the CPU
tier's evictions, or a write-back lower tier's that keeps them (tiers/base.py, `keeps_cpu_evictions`).

- `EagerStorePolicy` (inclusive tier): every full, hashed block whose KV this step's forward completes,
  unless it is already cached on the CPU or being stored, or dead (`StorePolicyView.is_dead`). Cost per step: O(newly completed blocks).
- `LazyStorePolicy` (lazy.py): blocks near the GPU's eviction frontier only.
Imports nothing from the scheduler (its types come from request_state and interfaces).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from offload_connector.hashing import group_suffix
from scheduler_side.groups import KVGroup
from scheduler_side.request_state import LoadJob, RequestState


class StorePolicyView(Protocol):
    """What a store policy may read of the scheduler (nothing here changes state)."""

    block_size: int
    group_id: int
    max_blocks_per_step: int | None  # the engine's allocation bound per step, if known
    num_gpu_blocks: int  # the engine's GPU pool size (the CPU tier's when the engine did not say)
    lazy_lookahead_blocks: int | None  # config override of the lazy lookahead

    def is_saved(self, key: bytes) -> bool:
        """A copy of this content is on the CPU tier or being stored there."""

    def is_dead(self, key: bytes) -> bool:
        """The admission filter refuses this content (a superseded branch, a closed session, `store: false`):
        never store it."""

    def may_have_dead(self) -> bool:
        """False while the admission filter is inactive: `is_dead` is then False for every key."""

    def saved_key_maps(self) -> tuple[Mapping[bytes, object], Mapping[bytes, object]]:
        """(cached, reserved) keys of the CPU tier, for per-block loops: `key in either` is `is_saved(key)`.
        Read only."""

    def is_store_outstanding(self, event_id: int) -> bool: ...
    def cpu_num_free_blocks(self) -> int: ...
    def gpu_num_free_blocks(self) -> int: ...
    def gpu_frontier(self, num: int, after: int | None = None) -> tuple[list[int], list[bytes | None]]:
        """Ids and keys (None: no key) of the first `num` free GPU blocks from the eviction frontier, or
        behind the free block `after`, fewer when the queue is shorter (a snapshot: valid until the pool
        changes)."""
    def gpu_is_free(self, gpu_block_id: int) -> bool:
        """The GPU block is in the engine's free queue now."""
    def gpu_cached_block(self, key: bytes) -> int | None:
        """A GPU block holding this content (free or not), None when the GPU has none."""


@dataclass(slots=True)
class StorePicks:
    """`pick_stores`' answer: GPU blocks to store (with their keys), and held blocks to let go afterwards."""

    gpu_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    release_gpu_ids: list[int] = field(default_factory=list)  # drop after the store event took its references
    # CPU copies of free GPU blocks near the eviction frontier, oldest first: made most recently used before
    # this step's stores take CPU blocks, so those stores never evict a copy the GPU is about to drop
    refresh_keys: list[bytes] = field(default_factory=list)


class StorePolicy:
    gpu_copy_worthless_after_store = False  # a stored block goes to the head of the GPU free queue

    def __init__(self, view: StorePolicyView) -> None:
        self.view = view

    def may_admit(self, state: RequestState, num_cpu_hit_blocks: int) -> bool:
        """At lookup (GPU hit known, CPU hit found): may the engine allocate now? False: retry next step.
        May change the policy's own state."""
        return True

    def on_allocated(self, state: RequestState, num_gpu_hit_blocks: int) -> list[bytes]:
        """The engine allocated the request's blocks, the first `num_gpu_hit_blocks` GPU hits. Returns CPU
        keys whose copies the scheduler should discard (free copies only)."""
        return []

    def on_blocks_allocated(self, num_blocks: int) -> None:
        """The engine took `num_blocks` blocks from its free queue this step (new blocks, loads included)."""

    def on_scheduled(self, state: RequestState, num_computed_tokens: int) -> None:
        """The request runs this step up to `num_computed_tokens`. May advance its store cursor."""

    def on_scheduled_groups(self, state: RequestState, num_computed_before: int, num_computed_tokens: int,
                            groups: Sequence[KVGroup]) -> None:
        """`on_scheduled` for a model with several KV-cache groups (`state.group_block_ids`); the request
        had `num_computed_before` tokens computed before this step. Only policies that support several
        groups implement it (the scheduler refuses the others at start-up)."""
        raise NotImplementedError(f"{type(self).__name__} supports one KV-cache group")

    def pick_stores(self) -> StorePicks:
        """This step's stores (called once per step, after every `on_scheduled`; advances the step clock)."""
        return StorePicks()

    def on_stores_emitted(self, event_id: int | None, stored_gpu_ids: list[int]) -> None:
        """The store event made of the picks (None, []: nothing could be stored)."""

    def on_load_complete(self, job: LoadJob) -> bool:
        """Every rank finished the load. True: forget its CPU copies (blocks nobody else holds)."""
        return False

    def on_cpu_evicted(self, key: bytes) -> None:
        """The tiers dropped `key`'s copy to make room for another (the CPU tier's LRU or ARC choice, or a
        write-back lower tier's eviction when that tier keeps the CPU's evictions)."""

    def on_cpu_copy_dropped(self, key: bytes, evicted: bool) -> None:
        """The CPU tier no longer has `key`'s copy: evicted to make room (whether a lower tier keeps it or
        not) or forgotten (told only while `hears_cpu_copy_drops`)."""

    def on_cpu_copies_evicted(self, keys: list[bytes]) -> None:
        """`on_cpu_copy_dropped(key, True)` for each key, in order: one allocation's evictions."""
        for key in keys:
            self.on_cpu_copy_dropped(key, True)

    @property
    def hears_cpu_copy_drops(self) -> bool:
        return False

    @property
    def hears_cpu_evictions(self) -> bool:
        """Whether `on_cpu_evicted` changes anything now (False: the scheduler may leave the CPU tier's
        evictions untold; a write-back lower tier's are told either way)."""
        return False

    def lends_load_slots(self) -> bool:
        """May this step's stores take the slots of blocks this step's loads read (nobody else holds them)?
        Their CPU copies are forgotten at once; the workers write the stores after the loads read them."""
        return False

    def stored_blocks_places(self, event_id: int) -> list[tuple[int | None, list[int]]] | None:
        """Every rank finished the store: where its GPU blocks go back into the free queue, as groups (a free
        GPU block to put them behind, first listed nearest it, or None: the head), covering every block of
        the event. None: at vLLM's place for them, or the head with `gpu_copy_worthless_after_store`."""
        return None

    def on_store_complete(self, event_id: int) -> None:
        """Every rank finished the store and its GPU blocks were freed."""

    def on_request_finished(self, state: RequestState) -> list[int]:
        """The engine is done with the request. Returns its GPU blocks to hold until the next store event."""
        return []

    @property
    def num_held_blocks(self) -> int:
        """GPU blocks held for the next store event (returned by `on_request_finished`, not yet released)."""
        return 0


class EagerStorePolicy(StorePolicy):
    def __init__(self, view: StorePolicyView) -> None:
        super().__init__(view)
        self._picks = StorePicks()
        self._picked: set[bytes] = set()
        self._suffix = group_suffix(view.group_id)
        self._cached, self._reserved = view.saved_key_maps()  # live maps, read only
        self._block_size = view.block_size

    def on_scheduled(self, state: RequestState, num_computed_tokens: int) -> None:
        """Pick the full blocks the forward completes that are not saved; advances the store cursor."""
        start = state.num_store_checked_blocks
        end = num_computed_tokens // self._block_size
        if end <= start:
            return  # the common decode step: no block completed
        hashes, gpu_block_ids, view = state.request.block_hashes, state.gpu_block_ids, self.view
        end = min(end, len(hashes), len(gpu_block_ids))  # (a block is picked once it has a hash and a GPU block)
        if end <= start:
            return
        state.num_store_checked_blocks = end
        suffix, picked, cached, reserved, picks = self._suffix, self._picked, self._cached, self._reserved, self._picks
        is_dead = view.is_dead if view.may_have_dead() else None
        keys = [h + suffix for h in hashes[start:end]]  # with_group_id, inlined
        for key, gpu_id in zip(keys, gpu_block_ids[start:end], strict=True):
            if gpu_id == 0 or key in cached or key in picked or key in reserved or (is_dead and is_dead(key)):
                continue  # the null block, or already picked, on the CPU or being stored, or refused
            picked.add(key)
            picks.gpu_ids.append(gpu_id)
            picks.keys.append(key)

    def on_scheduled_groups(self, state: RequestState, num_computed_before: int, num_computed_tokens: int,
                            groups: Sequence[KVGroup]) -> None:
        """Per group, pick the full blocks completed since the store cursor that vLLM still holds: not the
        null block, and in a sliding-window group not before the window of the tokens computed before this
        step (vLLM may have dropped and reused those; it drops only below that point); in a state group only
        the block ending where this step ended (`KVGroup.stores_block`). Admission (`is_dead`)
        judges a block's content by group 0's key. Advances the store cursor. O(groups * new blocks)."""
        start = state.num_store_checked_blocks
        bs, hashes, view = self.view.block_size, state.request.block_hashes, self.view
        end = min(num_computed_tokens // bs, len(hashes))
        if end <= start:
            return
        picked, picks, cached, reserved = self._picked, self._picks, self._cached, self._reserved
        is_dead = view.is_dead if view.may_have_dead() else None
        for group, gpu_block_ids in zip(groups, state.group_block_ids, strict=True):
            suffix = group_suffix(group.group_id)
            for i in range(max(start, group.first_needed_block(num_computed_before, bs)),
                           min(end, len(gpu_block_ids))):
                key, gpu_id = hashes[i] + suffix, gpu_block_ids[i]
                if gpu_id == 0 or key in picked or key in cached or key in reserved or (
                        group.state and not group.stores_block(i, num_computed_tokens, bs)) or (
                        is_dead and is_dead(hashes[i] + self._suffix)):
                    continue
                picked.add(key)
                picks.gpu_ids.append(gpu_id)
                picks.keys.append(key)
        state.num_store_checked_blocks = end

    def pick_stores(self) -> StorePicks:
        picks, self._picks, self._picked = self._picks, StorePicks(), set()
        return picks

    @property
    def num_picked(self) -> int:
        """Blocks picked since the last `pick_stores`."""
        return len(self._picked)
