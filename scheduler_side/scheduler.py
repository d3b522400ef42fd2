"""The scheduler side of the connector: decides what moves between the GPU pool and our CPU tier.

It owns the CPU `BlockPool` (prefix cache keyed by block hash + group id) and borrows the engine's GPU pool
through `GpuPool`. Per engine step, in vLLM's order (SPEC §4):
1. `get_num_new_matched_tokens` (lookups.py): CPU lookup after the GPU hit; pins the hit's CPU blocks (a
   pending hit).
2. `update_state_after_alloc`: turns the pending hit into a load job onto the new GPU blocks.
3. `build_connector_meta`: one load event for all new load jobs, one store event for the chosen stores.
4. `update_connector_output` (completions.py): each rank's report completes loads and stores (stores
   register CPU blocks); a transfer completes once every rank reported it once. Both adapters use it.
5. `request_finished`: never delays the engine's block free; our references keep in-flight blocks alive.

Reference ownership (the invariant that makes abort/preempt/finish safe at any point):
- a pending hit holds one reference on each of its CPU blocks;
- a load job holds one reference on each of its CPU blocks until its completion is reported, and on each
  of its GPU blocks too once its request finished while loading (until then the request's own reference
  keeps them: the engine frees a request's blocks only after `request_finished`);
- a store event holds one reference on each of its GPU and CPU blocks until every rank reported it.
No block with a transfer in flight is therefore ever in a free queue. Nothing here imports torch.
With `config.remote` (and the adapter's `remote_identity`), a CPU miss may make the request wait for the
remote tier, which fetches blocks into the CPU tier first (remote_tier.py; a fetch event holds its blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from offload_connector.config import OffloadConfig
from offload_connector.hashing import group_suffix
from offload_connector.metadata import TransferMetadata
from offload_connector.remote.format import RemoteIdentity
from scheduler_side.admission.filter import AdmissionFilter
from scheduler_side.admissions import Admissions
from scheduler_side.completions import Completions, ExpiredLoad, KVEvent
from scheduler_side.errors import SchedulerError
from scheduler_side.groups import KVGroup
from scheduler_side.hybrid import HybridGroups, check_groups_supported
from scheduler_side.interfaces import GpuPool, RequestLike, StepRequest
from scheduler_side.lookups import Lookups
from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.policies.store_policy import EagerStorePolicy, PolicyView, StorePolicy
from scheduler_side.policies.view import SchedulerView
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.pool.free_queue import Block
from scheduler_side.request_state import LoadJob, PendingHit, Phase, RequestState, StoreEvent
from scheduler_side.stats import SchedulerStats
from scheduler_side.tiers.remote.tier import RemoteTier, make_remote_tier

logger = logging.getLogger(__name__)


def make_store_policy(config: OffloadConfig, view: PolicyView) -> StorePolicy:
    if config.store_policy == "eager":
        return EagerStorePolicy(view)
    if config.store_policy == "lazy":
        return LazyStorePolicy(view)
    raise ValueError(f"unknown store_policy {config.store_policy!r}; allowed: eager, lazy")


@dataclass
class OffloadScheduler(Lookups, Completions, Admissions, HybridGroups):
    config: OffloadConfig
    block_size: int
    num_cpu_blocks: int
    gpu_pool: GpuPool
    world_size: int = 1
    group_id: int = 0
    max_blocks_per_step: int | None = None  # the engine's allocation bound per step (lazy lookahead)
    num_gpu_blocks: int | None = None  # the engine's GPU pool size (ARC remembers GPU + CPU reused keys)
    emit_kv_events: bool = True  # collect BlockStored/BlockRemoved for `take_events` (off: none kept)
    remote_identity: RemoteIdentity | None = None  # what the remote tier's keys name (config.remote only)
    # The model's KV-cache groups (groups.py); None: one full-attention group, `group_id`. Several groups
    # (a hybrid model) take hybrid.py's paths and need store_policy eager and no remote tier.
    groups: tuple[KVGroup, ...] | None = None
    cpu_pool: BlockPool = field(init=False)
    admission: AdmissionFilter = field(init=False)
    stats: SchedulerStats = field(init=False, default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.world_size <= 0:
            raise ValueError(f"block_size={self.block_size} and world_size={self.world_size} must be positive")
        self.groups = self.groups or (KVGroup(self.group_id),)
        self._hybrid = len(self.groups) > 1
        self._other_suffixes = tuple(group_suffix(g.group_id) for g in self.groups[1:])
        if self._hybrid:
            check_groups_supported(self.config, self.groups)
            self.group_id = self.groups[0].group_id  # admission and ARC judge content by group 0's keys
        self.cpu_pool = BlockPool(self.num_cpu_blocks, on_evict=self._on_cpu_evict,
                                  eviction=self.config.eviction,
                                  history=self.num_cpu_blocks + (self.num_gpu_blocks or self.num_cpu_blocks))
        # Remembers the keys of several times what both tiers hold: a superseded branch is recent.
        self.admission = AdmissionFilter(4 * (self.num_cpu_blocks + (self.num_gpu_blocks or self.num_cpu_blocks)),
                                         branch_filter=self.config.branch_filter)
        self._arc = self.cpu_pool.free_queue.wants_hints  # hints cost a loop per lookup; LRU needs none
        self._requests: dict[str, RequestState] = {}
        self._loads_to_send: list[RequestState] = []  # load jobs created since the last metadata
        self._store_events: dict[int, StoreEvent] = {}
        self._expired: dict[int, ExpiredLoad] = {}  # expired load events whose copy may still run
        self._next_load_event = 0
        self._next_store_event = 0
        self._kv_events: list[KVEvent] = []
        self._view = SchedulerView(self.cpu_pool, self.gpu_pool, self._store_events, self.block_size,
                                   self.group_id, self.max_blocks_per_step, self.config.lazy_lookahead_blocks,
                                   self.admission)
        self.policy: StorePolicy = make_store_policy(self.config, self._view)
        self.remote: RemoteTier | None = make_remote_tier(self.config.remote, self.remote_identity, self.cpu_pool,
                                                          self._allocate_cpu, self.world_size, self.group_id)

    # ------------------------------------------------------------------ 2. after allocation
    def update_state_after_alloc(
        self, request: RequestLike, gpu_block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Map the pending hit onto the newly allocated GPU blocks and start tracking the request.

        `gpu_block_ids` are all of the request's blocks (GPU-hit ones first), as vLLM passes them; with
        several KV-cache groups, one such list per group. Stores start after the GPU-hit and loaded blocks
        (eager stores what the forward computes). A call that does not match the pending hit raises
        `SchedulerError` and changes nothing.
        """
        group_block_ids = None
        if self._hybrid:
            group_block_ids, gpu_block_ids = gpu_block_ids, gpu_block_ids[0] if gpu_block_ids else []
        state = self._requests.get(request.request_id)
        if state is not None and state.request is not request:
            raise SchedulerError(f"update_state_after_alloc for request id {request.request_id!r} with a different "
                                 "request object than the live one; request ids must be unique")
        if state is not None and state.phase in (Phase.LOADING, Phase.FINISHED):
            raise SchedulerError(f"update_state_after_alloc for request {request.request_id} while "
                                 f"{state.phase.value}")
        hit = state.pending_hit if state is not None else None
        n = self._check_external_tokens(request, hit, gpu_block_ids, num_external_tokens)
        job = self._group_load(state, hit, group_block_ids, n) if group_block_ids is not None and n else None
        if state is None:
            state = self._requests[request.request_id] = RequestState(request)
        if group_block_ids is not None:
            self._set_group_blocks(state, group_block_ids)
        else:
            state.gpu_block_ids = list(gpu_block_ids)
        state.num_computed_tokens = 0
        if state.phase in (Phase.LOOKED_UP, Phase.PENDING_HIT):  # admitted: the GPU hit is now the request's
            state.num_store_checked_blocks = state.num_gpu_hit_blocks + n
            self.stats.num_lookup_tokens += max(0, request.num_tokens - state.num_gpu_hit_blocks * self.block_size)
            if self._arc:
                self._note_reuse(state, state.num_gpu_hit_blocks + n)
            self._admit_keys(state, extends=True, first_new=state.num_gpu_hit_blocks + n)
            cpu_pool = self.cpu_pool
            for key in self.policy.on_allocated(state, state.num_gpu_hit_blocks):
                block = cpu_pool.lookup(key)
                if block is not None:
                    cpu_pool.discard(block)  # a held copy (a load source) stays
            self.policy.on_blocks_allocated(len(state.gpu_block_ids) - state.num_gpu_hit_blocks)
        state.pending_hit = None
        if hit is not None:  # all of it when the engine took none of the hit
            self.cpu_pool.free(job[2] if job is not None else hit.cpu_blocks[n:])
        if hit is None or n == 0:
            state.move_to(Phase.RUNNING)
            return
        start = hit.num_computed_tokens // self.block_size
        # The CPU references move from the pending hit to the job. The GPU blocks stay the request's alone
        # while it lives (the engine frees them only after request_finished, which then protects them).
        state.load = (LoadJob(job[0], job[1]) if job is not None
                      else LoadJob(list(gpu_block_ids[start:start + n]), hit.cpu_blocks[:n]))
        state.move_to(Phase.LOADING)
        self.stats.num_hit_tokens += num_external_tokens
        self._loads_to_send.append(state)

    def _check_external_tokens(self, request: RequestLike, hit: PendingHit | None,
                               gpu_block_ids: Sequence[int], num_external_tokens: int) -> int:
        """Blocks the engine takes from the pending hit; raises (changing nothing) if they cannot match."""
        if num_external_tokens == 0:
            return 0
        rid = request.request_id
        if hit is None:
            raise SchedulerError(f"update_state_after_alloc: request {rid} claims {num_external_tokens} "
                                 "external tokens but has no pending CPU hit (never looked up, or dropped)")
        n = num_external_tokens // self.block_size
        if n * self.block_size != num_external_tokens or n > len(hit.cpu_blocks):
            raise SchedulerError(f"request {rid}: {num_external_tokens} external tokens do not match the "
                                 f"pending hit of {len(hit.cpu_blocks)} blocks of {self.block_size} tokens")
        start = hit.num_computed_tokens // self.block_size
        if len(gpu_block_ids) < start + n:
            raise SchedulerError(f"request {rid}: {len(gpu_block_ids)} GPU blocks cannot hold a load of {n} "
                                 f"blocks after {start} GPU-hit blocks")
        return n

    # ------------------------------------------------------------------ 3. step metadata
    def build_connector_meta(self, scheduled: Iterable[StepRequest]) -> TransferMetadata:
        """This step's transfers: all new loads as one event, the chosen stores as another."""
        meta = TransferMetadata()
        loaded: list[LoadJob] = []  # this step's load jobs: the store may take their slots
        if self._loads_to_send:
            meta.load_event = self._next_load_event
            self._next_load_event += 1
            for state in self._loads_to_send:
                job = state.load
                if job is None or job.event_id is not None:
                    raise SchedulerError(f"request {state.request_id} queued for load without a fresh job")
                job.event_id = meta.load_event
                meta.load_gpu_blocks.extend(job.gpu_block_ids)
                meta.load_cpu_blocks.extend(b.block_id for b in job.cpu_blocks)
                meta.load_event_reqs.append(state.request_id)
                meta.load_req_num_blocks.append(job.num_blocks)
                self.stats.num_loaded_blocks += job.num_blocks
                loaded.append(job)
            self._loads_to_send.clear()

        requests, on_scheduled, on_alloc = self._requests, self.policy.on_scheduled, self.policy.on_blocks_allocated
        if self._hybrid:  # new_gpu_block_ids: one list per group (hybrid.py)
            for req_id, new_gpu_block_ids, num_computed_tokens, replace_blocks in scheduled:
                state = requests.get(req_id)
                if state is not None:
                    self._schedule_groups(state, new_gpu_block_ids, num_computed_tokens, replace_blocks)
            scheduled = ()
        for req_id, new_gpu_block_ids, num_computed_tokens, replace_blocks in scheduled:
            state = requests.get(req_id)
            if state is None:
                continue  # the engine schedules requests the connector never saw (e.g. no lookup)
            if replace_blocks:
                state.gpu_block_ids = list(new_gpu_block_ids)
            else:
                state.gpu_block_ids.extend(new_gpu_block_ids)
                if new_gpu_block_ids:
                    on_alloc(len(new_gpu_block_ids))
            state.num_computed_tokens = num_computed_tokens
            on_scheduled(state, num_computed_tokens)

        picks = self.policy.pick_stores()
        if picks.refresh_keys:  # (a reserved key has no copy to move yet)
            self.cpu_pool.make_recent([b for b in map(self.cpu_pool.cached.get, picks.refresh_keys) if b is not None])
        event = self._emit_store(meta, picks.gpu_ids, picks.keys, loaded) if picks.gpu_ids else None
        if picks.release_gpu_ids:  # blocks the policy held for this event (which took its own references)
            self.gpu_pool.free(picks.release_gpu_ids)
        self.policy.on_stores_emitted(*((event.event_id, event.gpu_block_ids) if event else (None, [])))
        if self.remote is not None:
            self.remote.fill_meta(meta)  # after every allocation: the evicted blocks to write, if any
        return meta

    def _emit_store(self, meta: TransferMetadata, gpu_ids: list[int], keys: list[bytes],
                    loaded: Sequence[LoadJob] = ()) -> StoreEvent | None:
        cpu_blocks = self._reuse_load_slots(loaded, len(gpu_ids)) if loaded else []
        meta.store_after_load = bool(cpu_blocks)
        cpu_blocks += self._allocate_cpu(len(gpu_ids) - len(cpu_blocks))
        if len(cpu_blocks) < len(gpu_ids):
            self.stats.num_store_skipped_blocks += len(gpu_ids) - len(cpu_blocks)
            gpu_ids, keys = gpu_ids[:len(cpu_blocks)], keys[:len(cpu_blocks)]
        if not gpu_ids:
            return None
        self.gpu_pool.touch(gpu_ids)
        self.cpu_pool.reserve(cpu_blocks, keys)  # hit-able only once every rank has copied its shard
        event = StoreEvent(self._next_store_event, gpu_ids, cpu_blocks)
        self._next_store_event += 1
        self._store_events[event.event_id] = event
        meta.store_event = event.event_id
        meta.store_gpu_blocks = gpu_ids
        meta.store_cpu_blocks = [b.block_id for b in cpu_blocks]
        if self.remote is not None and self.remote.enabled and self.config.remote.write == "on_store":
            meta.store_keys = keys  # written to the remote tier once the store completed
        return event

    def _reuse_load_slots(self, loaded: Sequence[LoadJob], num: int) -> list[Block]:
        """Up to `num` CPU blocks that this step's loads read and nobody else holds, emptied for the store
        (held: one reference each for the store, the job keeping its own), when the policy lends them.
        The worker writes the store after the load read them (`store_after_load`). O(blocks taken)."""
        if not self.policy.lends_load_slots():
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

    def _allocate_cpu(self, num: int) -> list[Block]:
        """Up to `num` CPU blocks, evicting LRU cached ones; fewer when the pool is pinned full."""
        pool = self.cpu_pool
        before = pool.num_evictions
        blocks = pool.allocate(min(num, pool.num_free_blocks)) or []
        self.stats.num_cpu_evictions += pool.num_evictions - before
        return blocks

    # ------------------------------------------------------------------ 4. completions
    def _on_cpu_evict(self, key: bytes, evicted: bool) -> None:
        if self.emit_kv_events:
            self._kv_events.append(KVEvent("removed", key))

    # ------------------------------------------------------------------ 5. finish, preempt
    def request_finished(self, request: RequestLike) -> tuple[bool, dict | None]:
        """The engine may free the request's blocks now: in-flight transfers hold their own references.

        A request already finished while its load runs (FINISHED: a second call for it, or a new request
        under its id aborted while that load runs) changes nothing: the first call did the work, and the
        state stays until the load completes and gives its GPU and CPU references back."""
        state = self._requests.get(request.request_id)
        if state is None or state.phase is Phase.FINISHED:
            return False, None
        self._drop_pending_hit(state)
        if self.remote is not None:
            self.remote.forget(state)
        self._admit_finished(state)
        hold = self.policy.on_request_finished(state)
        if hold:  # released by the policy's next pick_stores, after the store event took its own
            self.gpu_pool.touch(hold)
        if state.phase is Phase.LOADING:  # the engine frees the request's blocks next: the copy still writes
            job = state.load  # into them, so the job takes its own references until it completes
            self.gpu_pool.touch(job.gpu_block_ids)
            job.holds_gpu = True
            state.move_to(Phase.FINISHED)  # deleted when its load completes (a queued load is still sent)
        else:
            del self._requests[request.request_id]
        return False, None

    def request_preempted(self, request_id: str) -> None:
        """The engine freed the request's GPU blocks; it will be re-admitted through a lookup."""
        state = self._requests.get(request_id)
        if state is not None and state.phase is Phase.RUNNING:
            state.move_to(Phase.NEW)
            state.gpu_block_ids = []
            state.group_block_ids = None  # resumed with every group's whole list (replace_blocks)
            state.num_store_checked_blocks = 0

    # ------------------------------------------------------------------ introspection
    def take_events(self) -> list[KVEvent]:
        events, self._kv_events = self._kv_events, []
        return events

    def is_saved(self, key: bytes) -> bool:
        """A copy of this block's content is on the CPU tier or being stored there."""
        return self._view.is_saved(key)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def close(self) -> None:
        """Stop the remote tier's lookup thread (nothing else to release)."""
        if self.remote is not None:
            self.remote.close()
