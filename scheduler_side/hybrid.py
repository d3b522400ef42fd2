"""`HybridGroups`: lookups, loads and block lists when the model has several KV-cache groups (groups.py: full
attention, sliding window, Mamba/SSM state in vLLM's align mode).

A part of the scheduler that exists only when `len(groups) > 1`, so the single-group hot path never pays
for it: lookups.py, allocations.py and stores.py hand it their request past their common checks. Per
group: its own keys (block hash + its group id),
its own block list in the request's state (`RequestState.group_block_ids`, vLLM's per-group lists, the
null block 0 where vLLM dropped a block outside a window). What is shared: one CPU pool (one CPU block
holds one GPU block's pages, whatever its group), one load job per request across all groups, and every
completion, failure and tensor-parallel count (completions.py sees only pairs of GPU and CPU blocks).

- Lookup: the hit is `groups.hybrid_hit_end` (the longest prefix every group can serve). Pinned: every
  block a group needs for that prefix (a sliding-window group only those inside its window, a state group
  only the state block ending at the hit, so the hit ends where the attention KV and every group's state
  are all on the CPU tier).
- Allocation: vLLM passes each group's blocks; the load job pairs every block vLLM allocated in the loaded
  range (not the null block) with its CPU copy. Pinned blocks the job does not use are released.
- Stores (`EagerStorePolicy.on_scheduled_groups`): per group, every completed block vLLM still holds (a
  state group: the block ending where the step ended, `KVGroup.stores_block`).
With `eviction: arc`, ARC hears of reuse by group 0's keys (as the admission filter judges content) and
of no misses from these lookups.

Mutates: the request's `RequestState` (phase, pending hit with its slots, per-group block lists, wait
counters), one CPU reference per pinned block and per cached block a load takes outside the pin, the
lookup counters of `SchedulerStats`; tells the store policy of allocations and scheduled requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_connector.config import OffloadConfig
from offload_connector.hashing import group_suffix
from offload_connector.lower_tiers import lower_tier_sections
from scheduler_side.errors import SchedulerError
from scheduler_side.groups import NULL_GPU_BLOCK, KVGroup, hybrid_hit_end
from scheduler_side.interfaces import RequestLike
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.pool.block import Block
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import PendingHit, Phase, RequestState
from scheduler_side.stats import SchedulerStats
from scheduler_side.waits import asks_again_for_load, asks_again_for_store


def check_groups_supported(config: OffloadConfig, groups: tuple[KVGroup, ...]) -> None:
    """Several KV-cache groups need `store_policy: eager` and no lower tier; raises `ValueError` naming
    the key and what is allowed (before anything is allocated)."""
    if config.store_policy != "eager":
        raise ValueError(f"store_policy={config.store_policy!r} supports one KV-cache group; this model has "
                         f"{len(groups)} (a hybrid model); allowed with several groups: eager (or turn vLLM's "
                         "hybrid KV cache manager off: disable_hybrid_kv_cache_manager=True)")
    for name, _ in lower_tier_sections(config):
        raise ValueError(f"{name}: the {name} tier supports one KV-cache group; this model has {len(groups)} "
                         f"(a hybrid model); allowed with several groups: no {name} section (or turn vLLM's "
                         "hybrid KV cache manager off: disable_hybrid_kv_cache_manager=True)")


class HybridGroups:
    def __init__(self, groups: tuple[KVGroup, ...], block_size: int, cpu_pool: BlockPool, policy: StorePolicy,
                 stats: SchedulerStats, max_store_wait_steps: int) -> None:
        self.groups, self.block_size, self.cpu_pool, self.policy = groups, block_size, cpu_pool, policy
        self.stats, self.max_store_wait_steps = stats, max_store_wait_steps

    def lookup(self, state: RequestState, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        """`get_num_new_matched_tokens` past its common checks, for several groups (the GPU hit ends on a
        block boundary). A full-attention group's run stops at its first miss; a block of that run being
        stored makes the request ask again (None), as with one group. O(groups * blocks walked)."""
        bs, hashes = self.block_size, request.block_hashes
        first = num_computed_tokens // bs
        end = min(len(hashes), (request.num_tokens - 1) // bs)  # keep >= 1 token to compute
        cached, reserved = self.cpu_pool.cached, self.cpu_pool.reserved
        for group in self.groups:  # full attention first: its run bounds every group's
            if not group.needs_every_block:
                continue
            suffix = group_suffix(group.group_id)
            for i in range(first, end):
                key = hashes[i] + suffix
                if key not in cached:
                    if key in reserved and asks_again_for_store(state, self.max_store_wait_steps, self.stats):
                        return None, False
                    end = i
                    break
        found = [[hashes[i] + group_suffix(g.group_id) in cached for i in range(first, end)] for g in self.groups]
        hit_end = hybrid_hit_end(self.groups, found, first, end, bs)
        if hit_end > first and self._first_block_loading(hashes[first]) and asks_again_for_load(
                state, self.max_store_wait_steps, self.stats):
            return None, False  # another request is loading the hit's first block (lookups.py)
        if not self.policy.may_admit(state, hit_end - first):
            state.num_deferrals += 1
            state.move_to(Phase.NEW)
            self.stats.num_deferred_lookups += 1
            return None, False
        if hit_end == first:
            state.move_to(Phase.LOOKED_UP)
            return 0, False
        blocks: list[Block] = []
        slots: list[tuple[int, int]] = []
        for g, group in enumerate(self.groups):
            suffix = group_suffix(group.group_id)
            for i in range(max(first, group.first_needed_block(hit_end * bs, bs)), hit_end):
                blocks.append(cached[hashes[i] + suffix])
                slots.append((g, i))
        self.cpu_pool.touch(blocks)
        state.pending_hit = PendingHit(blocks, num_computed_tokens, slots)
        state.move_to(Phase.PENDING_HIT)
        return (hit_end - first) * bs, True

    def _first_block_loading(self, block_hash: bytes) -> bool:
        """Some group's CPU copy of the hit's first block is held: another request's load reads it."""
        cached = self.cpu_pool.cached
        return any((block := cached.get(block_hash + group_suffix(g.group_id))) is not None and block.ref_cnt > 0
                   for g in self.groups)

    def load(self, state: RequestState, hit: PendingHit, group_block_ids: Sequence[Sequence[int]],
                    n: int) -> tuple[list[int], list[Block], list[Block]]:
        """(GPU ids, CPU blocks) to load for the engine's `n` external blocks, and the pinned CPU blocks the
        load does not use. Every block vLLM allocated in the loaded range (not the null block) must have
        a CPU copy: a pinned one, else a cached one (then referenced here); none raises `SchedulerError`
        before any reference moves."""
        bs, hashes = self.block_size, state.request.block_hashes
        start = hit.num_computed_tokens // bs
        hit_end = max(i for _, i in hit.slots) + 1
        if start + n > hit_end or any(len(ids) < start + n for ids in group_block_ids):
            raise SchedulerError(f"request {state.request_id}: a load of {n} blocks after {start} GPU-hit blocks "
                                 f"does not fit the pending hit (up to block {hit_end}) or the block lists "
                                 f"({[len(ids) for ids in group_block_ids]} blocks)")
        pinned = dict(zip(hit.slots, hit.cpu_blocks, strict=True))
        gpu_ids: list[int] = []
        cpu_blocks: list[Block] = []
        extra: list[Block] = []  # cached copies outside the pin (the engine took a shorter prefix)
        for g, group in enumerate(self.groups):
            ids, suffix = group_block_ids[g], group_suffix(group.group_id)
            for i in range(start, start + n):
                if ids[i] == NULL_GPU_BLOCK:
                    continue  # outside this group's window: vLLM needs nothing there
                block = pinned.pop((g, i), None)
                if block is None:
                    block = self.cpu_pool.cached.get(hashes[i] + suffix)
                    if block is None:
                        raise SchedulerError(f"request {state.request_id}: group {group.group_id} block {i} "
                                             "must be loaded but is not on the CPU tier (hit rule broken)")
                    extra.append(block)
                gpu_ids.append(ids[i])
                cpu_blocks.append(block)
        self.cpu_pool.touch(extra)
        return gpu_ids, cpu_blocks, list(pinned.values())

    def set_blocks(self, state: RequestState, group_block_ids: Sequence[Sequence[int]]) -> None:
        """The request's block lists, one per group; `gpu_block_ids` is group 0's (the same list)."""
        if len(group_block_ids) != len(self.groups):
            raise SchedulerError(f"request {state.request_id}: {len(group_block_ids)} block lists for "
                                 f"{len(self.groups)} KV-cache groups")
        state.group_block_ids = [list(ids) for ids in group_block_ids]
        state.gpu_block_ids = state.group_block_ids[0]

    def schedule(self, state: RequestState, new_gpu_block_ids: Sequence[Sequence[int]],
                         num_computed_tokens: int, replace_blocks: bool) -> None:
        """One scheduled request of `build_connector_meta` (stores.py), several groups: per-group block lists, then
        the store policy's picks (blocks vLLM still holds, judged from the tokens computed before)."""
        before = state.num_computed_tokens
        if replace_blocks or state.group_block_ids is None:
            self.set_blocks(state, new_gpu_block_ids)
        else:
            if len(new_gpu_block_ids) != len(self.groups):
                raise SchedulerError(f"request {state.request_id}: {len(new_gpu_block_ids)} new block lists "
                                     f"for {len(self.groups)} KV-cache groups")
            for ids, new in zip(state.group_block_ids, new_gpu_block_ids, strict=True):
                ids.extend(new)
            self.policy.on_blocks_allocated(sum(map(len, new_gpu_block_ids)))
        state.num_computed_tokens = num_computed_tokens
        self.policy.on_scheduled_groups(state, before, num_computed_tokens, self.groups)
