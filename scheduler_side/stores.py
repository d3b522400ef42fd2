"""`Stores`: step 3's stores (SPEC §4): the scheduled requests go to the store policy, whose picks become
this step's store event.

`schedule` updates each scheduled request's GPU blocks and computed tokens and tells the policy
(`on_blocks_allocated`, `on_scheduled`; several KV-cache groups: hybrid.py). `emit` asks the policy for its
picks once, makes the CPU copies it names most recently used, takes CPU blocks for the stores (first the
slots this step's loads read, when the policy lends them, then free ones through the scheduler's
`allocate_cpu`, evicting), reserves their keys, issues the store event (a block the policy held passes the
hold's reference to the event), lets go of the other held blocks, and tells the policy what was stored. A
store the CPU tier has no room for is skipped (`num_store_skipped_blocks`). O(scheduled requests + blocks
picked) per step.

Mutates: scheduled requests' `RequestState` (blocks, computed tokens; the policy its store cursor),
`Transfers.store_events` (a new event holds one reference on each of its GPU and CPU blocks), CPU blocks
(taken, reserved, slots lent by loads: `LoadJob.lent`), GPU references (the event's; the policy's holds
released), the store counters of `SchedulerStats`, and the metadata's store fields (`store_keys` when a
lower tier writes stored blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from offload_connector.metadata import TransferMetadata
from scheduler_side.hybrid import HybridGroups
from scheduler_side.interfaces import GpuPool, StepRequest
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.pool.block import Block
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import LoadJob, StoreEvent
from scheduler_side.stats import SchedulerStats
from scheduler_side.tiers.base import LowerTier
from scheduler_side.transfers import Transfers


class Stores:
    def __init__(self, transfers: Transfers, cpu_pool: BlockPool, gpu_pool: GpuPool, policy: StorePolicy,
                 stats: SchedulerStats, hybrid: HybridGroups | None, allocate_cpu: Callable[[int], list[Block]],
                 tiers: tuple[LowerTier, ...], lend_load_slots: bool = True) -> None:
        """`lend_load_slots` False: never write a store into a slot this step's load reads, whatever the
        policy says (a host pool shared by ranks whose copies are not ordered against one another's)."""
        self.transfers, self.cpu_pool, self.gpu_pool, self.policy = transfers, cpu_pool, gpu_pool, policy
        self.lend_load_slots = lend_load_slots
        self.stats, self.hybrid, self.allocate_cpu = stats, hybrid, allocate_cpu
        self.tiers = tiers  # the lower tiers: one that writes stored blocks gets their keys

    def schedule(self, scheduled: Iterable[StepRequest]) -> None:
        """This step's scheduled requests: their new blocks and computed tokens, told to the policy."""
        requests, on_scheduled, on_alloc = self.transfers.requests, self.policy.on_scheduled, self.policy.on_blocks_allocated
        if self.hybrid is not None:  # new_gpu_block_ids: one list per group
            for req_id, new_gpu_block_ids, num_computed_tokens, replace_blocks in scheduled:
                state = requests.get(req_id)
                if state is not None:
                    self.hybrid.schedule(state, new_gpu_block_ids, num_computed_tokens, replace_blocks)
            return
        num_allocated = 0  # told once for the step (the policy reads it only at `pick_stores`)
        for req_id, new_gpu_block_ids, num_computed_tokens, replace_blocks in scheduled:
            state = requests.get(req_id)
            if state is None:
                continue  # the engine schedules requests the connector never saw (e.g. no lookup)
            if replace_blocks:
                state.gpu_block_ids = list(new_gpu_block_ids)
            else:
                state.gpu_block_ids.extend(new_gpu_block_ids)
                num_allocated += len(new_gpu_block_ids)
            state.num_computed_tokens = num_computed_tokens
            on_scheduled(state, num_computed_tokens)
        if num_allocated:
            on_alloc(num_allocated)

    def emit(self, meta: TransferMetadata, loaded: Sequence[LoadJob]) -> None:
        """The policy's picks as this step's store event in `meta` (`loaded`: this step's load jobs)."""
        picks = self.policy.pick_stores()
        if picks.refresh_keys:  # (a reserved key has no copy to move yet)
            self.cpu_pool.make_recent([b for b in map(self.cpu_pool.cached.get, picks.refresh_keys) if b is not None])
        held = picks.release_gpu_ids  # blocks the policy held for this event: their holds end now
        event = self._emit_store(meta, picks.gpu_ids, picks.keys, loaded, held) if picks.gpu_ids else None
        if held:  # a held block the event stores keeps the hold's reference as the event's (no touch, no free)
            if event is not None:
                stored = set(event.gpu_block_ids)
                held = [gpu_id for gpu_id in held if gpu_id not in stored]
            if held:
                self.gpu_pool.free(held)
        self.policy.on_stores_emitted(*((event.event_id, event.gpu_block_ids) if event else (None, [])))

    def _emit_store(self, meta: TransferMetadata, gpu_ids: list[int], keys: list[bytes],
                    loaded: Sequence[LoadJob] = (), held: Sequence[int] = ()) -> StoreEvent | None:
        """`held`: GPU blocks the policy holds a reference on (distinct); the event takes over that reference
        of each it stores instead of its own (the caller releases the rest)."""
        cpu_blocks = self._reuse_load_slots(loaded, len(gpu_ids)) if loaded else []
        meta.store_after_load = bool(cpu_blocks)
        cpu_blocks += self.allocate_cpu(len(gpu_ids) - len(cpu_blocks))
        if len(cpu_blocks) < len(gpu_ids):
            self.stats.num_store_skipped_blocks += len(gpu_ids) - len(cpu_blocks)
            gpu_ids, keys = gpu_ids[:len(cpu_blocks)], keys[:len(cpu_blocks)]
        if not gpu_ids:
            return None
        if held:
            holds = set(held)
            self.gpu_pool.touch([gpu_id for gpu_id in gpu_ids if gpu_id not in holds])
        else:
            self.gpu_pool.touch(gpu_ids)
        self.cpu_pool.reserve(cpu_blocks, keys)  # hit-able only once every rank has copied its shard
        event = self.transfers.issue_store_event(gpu_ids, cpu_blocks)
        meta.store_event = event.event_id
        meta.store_gpu_blocks = gpu_ids
        meta.store_cpu_blocks = [b.block_id for b in cpu_blocks]
        if self.tiers and any(tier.writes_stored() for tier in self.tiers):
            meta.store_keys = keys  # written to those tiers once the store completed
        return event

    def _reuse_load_slots(self, loaded: Sequence[LoadJob], num: int) -> list[Block]:
        """Up to `num` CPU blocks that this step's loads read and nobody else holds, emptied for the store
        (held: one reference each for the store, the job keeping its own), when the policy lends them.
        The worker writes the store after the load read them (`store_after_load`). O(blocks taken)."""
        if not (self.lend_load_slots and self.policy.lends_load_slots()):
            return []
        pool, out = self.cpu_pool, []
        alone = ((job, block) for job in loaded for block in job.cpu_blocks if block.ref_cnt == 1)  # the job's ref
        for job, block in islice(alone, num):
            pool.uncache(block)
            job.lent.add(block.block_id)
            out.append(block)
        pool.touch(out)
        self.stats.num_reused_load_slots += len(out)
        return out
