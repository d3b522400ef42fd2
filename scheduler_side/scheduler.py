"""`OffloadScheduler`: the scheduler side, which decides what moves between the GPU pool and our CPU tier.

It owns the CPU `BlockPool` (prefix cache keyed by block hash + group id) and borrows the engine's GPU pool
through `GpuPool`. It is a coordinator: the work is done by parts that each own their state and are handed
what they read, and the hooks below call them in vLLM's order (SPEC §4), per engine step:
1. `get_num_new_matched_tokens` -> `Lookups` (lookups.py): CPU lookup after the GPU hit; pins the hit's
   CPU blocks (a pending hit).
2. `update_state_after_alloc` -> `Allocations` (allocations.py): turns the pending hit into a load job onto
   the new GPU blocks.
3. `build_connector_meta`: `Allocations.send_loads` (one load event for all new load jobs), then
   `Stores.schedule` and `Stores.emit` (stores.py: one store event for the store policy's picks), then
   each lower tier's fetches and writes (`LowerTier.emit`).
4. `update_connector_output` -> `Completions` (completions.py): each rank's report completes loads and
   stores (stores register CPU blocks); a transfer completes once every rank reported it once.
5. `request_finished`: never delays the engine's block free; our references keep in-flight blocks alive.
Shared between the parts: `Transfers` (transfers.py: requests, queued loads, store events, expired loads),
the CPU pool, the store policy (policies/, over its `StorePolicyView`), `SchedulerStats`, the KV event log
(kv_events.py). `Admissions` (admissions.py) feeds the admission filter; `HybridGroups` (hybrid.py) exists
only for a model with several KV-cache groups.

Reference ownership (the invariant that makes abort/preempt/finish safe at any point):
- a pending hit holds one reference on each of its CPU blocks;
- a load job holds one reference on each of its CPU blocks until its completion is reported, and on each
  of its GPU blocks too once its request finished while loading (until then the request's own reference
  keeps them: the engine frees a request's blocks only after `request_finished`);
- a store event holds one reference on each of its GPU and CPU blocks until every rank reported it.
No block with a transfer in flight is therefore ever in a free queue. Nothing here imports torch.

Stores and reads (the invariant that keeps a load from reading bytes a store writes): a CPU block that a
store in flight writes is neither read by a load in flight nor held by a pending hit, and a block a load in
flight reads or a pending hit holds is never given to a store; the one exception is a slot lent by the
only load reading it to its own step's store (`LoadJob.lent`, stores.py), which the workers run after that
load (`store_after_load`). `check_integrity` checks it (`Transfers.store_read_overlaps`); the worker, which
knows the copies in flight, orders and counts any store that breaks it (worker.py).
With lower tiers configured (`self.tiers`, nearest first, built by name by tiers/registry.py with the
adapter's `tier_identity`), a CPU miss may make the request wait for one, which fetches blocks into the
CPU tier first (tiers/base.py: a fetch event holds its blocks); the scheduler talks to them only through
`LowerTier`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from offload_connector.config import OffloadConfig
from offload_connector.hashing import group_suffix
from offload_connector.metadata import TransferMetadata, WorkerReport
from offload_connector.tier_identity import TierIdentity
from scheduler_side.admission.filter import AdmissionFilter
from scheduler_side.admissions import Admissions
from scheduler_side.allocations import Allocations
from scheduler_side.completions import Completions
from scheduler_side.errors import SchedulerError
from scheduler_side.groups import KVGroup
from scheduler_side.hybrid import HybridGroups, check_groups_supported
from scheduler_side.interfaces import GpuPool, RequestLike, StepRequest
from scheduler_side.kv_events import KVEvent, KVEventLog
from scheduler_side.lookups import Lookups
from scheduler_side.policies.registry import make_store_policy
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.policies.view import SchedulerStorePolicyView
from scheduler_side.pool.block import Block
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import Phase
from scheduler_side.stats import SchedulerStats
from scheduler_side.stores import Stores
from scheduler_side.tiers.base import LowerTier, TierContext
from scheduler_side.tiers.registry import make_lower_tiers
from scheduler_side.transfers import Transfers


class OffloadScheduler:
    def __init__(self, config: OffloadConfig, block_size: int, num_cpu_blocks: int, gpu_pool: GpuPool,
                 world_size: int = 1, group_id: int = 0, max_blocks_per_step: int | None = None,
                 num_gpu_blocks: int | None = None, emit_kv_events: bool = True,
                 tier_identity: TierIdentity | None = None, groups: tuple[KVGroup, ...] | None = None,
                 lend_load_slots: bool = True) -> None:
        """`num_cpu_blocks`: the CPU tier per rank, the null block included (sizing.py computes it once for
        every face). `max_blocks_per_step`: the engine's allocation bound per step (lazy lookahead).
        `num_gpu_blocks`: the engine's GPU pool size (ARC and the admission filter remember GPU + CPU
        keys). `emit_kv_events`: keep BlockStored/BlockRemoved for `take_events` (off: none kept).
        `tier_identity`: what the lower tiers' keys name (needed with any lower tier). `groups`: the model's
        KV-cache groups (groups.py); None: one full-attention group, `group_id`. Several groups (a hybrid
        model) need store_policy eager and no lower tier. `lend_load_slots` False: no store goes into a
        slot a load of the same step reads (ranks sharing one host pool do not order their copies)."""
        if block_size <= 0 or world_size <= 0:
            raise ValueError(f"block_size={block_size} and world_size={world_size} must be positive")
        self.config, self.block_size, self.num_cpu_blocks, self.gpu_pool = config, block_size, num_cpu_blocks, gpu_pool
        self.world_size, self.max_blocks_per_step, self.num_gpu_blocks = world_size, max_blocks_per_step, num_gpu_blocks
        self.tier_identity = tier_identity
        self.groups: tuple[KVGroup, ...] = groups or (KVGroup(group_id),)
        several_groups = len(self.groups) > 1
        if several_groups:
            check_groups_supported(config, self.groups)
            group_id = self.groups[0].group_id  # admission and ARC judge content by group 0's keys
        self.group_id = group_id
        both_tiers = num_cpu_blocks + (num_gpu_blocks or num_cpu_blocks)

        # What the parts share: the ledger, the CPU pool, the counters, the KV event log, the store policy.
        self.transfers = Transfers()
        self.stats = SchedulerStats()
        self.kv_events = KVEventLog(emit_kv_events)
        self.cpu_pool = BlockPool(num_cpu_blocks, on_evict=self._on_cpu_evict, eviction=config.eviction,
                                  history=both_tiers)
        # Remembers the keys of several times what both tiers hold: a superseded branch is recent.
        self.admissions = Admissions(4 * both_tiers, config.branch_filter, self.cpu_pool, self.stats, group_id,
                                     tuple(group_suffix(g.group_id) for g in self.groups[1:]))
        self.admission: AdmissionFilter = self.admissions.filter
        self.policy_view = SchedulerStorePolicyView(
            self.cpu_pool, gpu_pool, self.transfers.store_events, block_size, group_id, max_blocks_per_step,
            config.lazy_lookahead_blocks, self.admission, num_gpu_blocks)
        self.policy: StorePolicy = make_store_policy(config.store_policy, self.policy_view)
        context = None if tier_identity is None else TierContext(tier_identity, self.cpu_pool, self.allocate_cpu,
                                                                 world_size, group_id, self.policy.on_cpu_evicted)
        self.tiers: dict[str, LowerTier] = make_lower_tiers(config, context)  # by name, nearest first
        self._tiers = tuple(self.tiers.values())
        self._keeping = tuple(tier for tier in self._tiers if tier.wants_cpu_evictions)
        evicting = [tier.on_cpu_evict for tier in self._keeping]
        if evicting:  # write-back tiers copy out each block the CPU pool evicts
            self.cpu_pool.on_evict_block = evicting[0] if len(evicting) == 1 else _fan_out(evicting)

        # The parts, in the order a step calls them.
        self.hybrid = (HybridGroups(self.groups, block_size, self.cpu_pool, self.policy, self.stats,
                                    config.max_store_wait_steps) if several_groups else None)
        self.lookups = Lookups(self.transfers, self.cpu_pool, self.policy, self.stats, self._tiers, self.hybrid,
                               block_size, group_id, config.max_store_wait_steps)
        self.allocations = Allocations(self.transfers, self.cpu_pool, self.policy, self.stats, self.admissions,
                                       self.hybrid, block_size, group_id)
        self.stores = Stores(self.transfers, self.cpu_pool, gpu_pool, self.policy, self.stats, self.hybrid,
                             self.allocate_cpu, self._tiers, lend_load_slots)
        self.completions = Completions(self.transfers, self.cpu_pool, gpu_pool, self.policy, self.stats,
                                       self.kv_events, self.tiers, world_size)
        self._wiring: tuple[bool, bool, bool] | None = None  # what `_listen_to_cpu_evictions` last wired for
        self._listen_to_cpu_evictions()

    def _listen_to_cpu_evictions(self) -> None:
        """The CPU pool calls `_on_cpu_evict` only while someone hears of it: the KV event log, or a store
        policy that still counts evictions (`StorePolicy.hears_cpu_evictions`) or follows its copies
        (`hears_cpu_copy_drops`; alone, it is called directly). Per evicted block that is a chain of calls;
        most steps of a full tier evict. Re-checked once a step and when events turn on."""
        policy = self.policy
        wiring = (policy.hears_cpu_copy_drops, policy.hears_cpu_evictions, self.kv_events.enabled)
        if wiring == self._wiring:
            return  # (as wired at the last check)
        self._wiring = wiring
        drops, evictions, events = wiring
        self._copy_drops_heard = drops
        if drops and not (events or evictions or self._keeping):
            self.cpu_pool.on_evict = policy.on_cpu_copy_dropped
            self.cpu_pool.on_evict_keys = policy.on_cpu_copies_evicted  # (an allocation's evictions at once)
            return
        wanted = events or evictions or drops
        self.cpu_pool.on_evict = self._on_cpu_evict if wanted else None
        self.cpu_pool.on_evict_keys = None

    def _on_cpu_evict(self, key: bytes, evicted: bool) -> None:
        """The CPU pool dropped `key`: evicted by allocation (`evicted`; the store policy hears of it unless a
        lower tier keeps it: then of that tier's drops) or forgotten. The KV event log records either."""
        if self._copy_drops_heard:
            self.policy.on_cpu_copy_dropped(key, evicted)
        if evicted and not (self._keeping and any(tier.keeps_cpu_evictions() for tier in self._keeping)):
            self.policy.on_cpu_evicted(key)
        self.kv_events.on_cpu_evict(key, evicted)

    @property
    def emit_kv_events(self) -> bool:
        """Keep BlockStored/BlockRemoved events for `take_events` (off: none kept)."""
        return self.kv_events.enabled

    @emit_kv_events.setter
    def emit_kv_events(self, enabled: bool) -> None:
        self.kv_events.enabled = enabled
        self._listen_to_cpu_evictions()

    # ------------------------------------------------------------------ 1.-4. the step, in vLLM's order
    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        """CPU hit after the engine's GPU hit (`Lookups.get_num_new_matched_tokens`)."""
        return self.lookups.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: RequestLike, gpu_block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """The pending hit onto the allocated GPU blocks (`Allocations.update_state_after_alloc`)."""
        self.allocations.update_state_after_alloc(request, gpu_block_ids, num_external_tokens)

    def build_connector_meta(self, scheduled: Iterable[StepRequest]) -> TransferMetadata:
        """This step's transfers: all new loads as one event, the chosen stores as another."""
        self._listen_to_cpu_evictions()  # (the policy may have stopped counting at a lookup)
        meta = TransferMetadata()
        loaded = self.allocations.send_loads(meta)  # this step's load jobs: the store may take their slots
        self.stores.schedule(scheduled)
        self.stores.emit(meta, loaded)
        for tier in self._tiers:
            tier.emit(meta)  # after every allocation: the evicted blocks to write, if any
        return meta

    def update_connector_output(self, reports: WorkerReport | Iterable[WorkerReport]) -> None:
        """Apply worker reports (`Completions.update_connector_output`)."""
        self.completions.update_connector_output(reports)

    def allocate_cpu(self, num: int) -> list[Block]:
        """Up to `num` CPU blocks, evicting cached ones as the eviction policy orders; fewer when the pool is
        pinned full. Every CPU allocation goes through here (stores, the lower tiers' fetches)."""
        pool = self.cpu_pool
        before = pool.num_evictions
        blocks = pool.allocate(min(num, pool.num_free_blocks)) or []
        self.stats.num_cpu_evictions += pool.num_evictions - before
        return blocks

    # ------------------------------------------------------------------ 5. finish, preempt, reset
    def request_finished(self, request: RequestLike) -> tuple[bool, dict | None]:
        """The engine may free the request's blocks now: in-flight transfers hold their own references.

        A request already finished while its load runs (FINISHED: a second call for it, or a new request
        under its id aborted while that load runs) changes nothing: the first call did the work, and the
        state stays until the load completes and gives its GPU and CPU references back."""
        requests = self.transfers.requests
        state = requests.get(request.request_id)
        if state is None or state.phase is Phase.FINISHED:
            return False, None
        self.lookups.drop_pending_hit(state)
        for tier in self._tiers:
            tier.forget(state)
        self.admissions.admit_finished(state)
        hold = self.policy.on_request_finished(state)
        if hold:  # released by the policy's next pick_stores, after the store event took its own
            self.gpu_pool.touch(hold)
        if state.phase is Phase.LOADING:  # the engine frees the request's blocks next: the copy still writes
            job = state.load  # into them, so the job takes its own references until it completes
            self.gpu_pool.touch(job.gpu_block_ids)
            job.holds_gpu = True
            state.move_to(Phase.FINISHED)  # deleted when its load completes (a queued load is still sent)
        else:
            del requests[request.request_id]
        return False, None

    def request_preempted(self, request_id: str) -> None:
        """The engine freed the request's GPU blocks; it will be re-admitted through a lookup."""
        state = self.transfers.requests.get(request_id)
        if state is not None and state.phase is Phase.RUNNING:
            state.move_to(Phase.NEW)
            state.gpu_block_ids = []
            state.group_block_ids = None  # resumed with every group's whole list (replace_blocks)
            state.num_store_checked_blocks = 0

    def close_session(self, session: str) -> int:
        """The client's session ended (`Admissions.close_session`); returns how many CPU copies moved."""
        return self.admissions.close_session(session)

    def reset_cache(self) -> bool:
        """Forget the CPU tier's contents (vLLM's `reset_prefix_cache(reset_connector=True)`, run by sleep
        and after weight updates): nothing stored or being stored before the call is hit-able afterwards.

        Every cached entry is dropped (free blocks go to the head of the free queue; a load in flight still
        reads its blocks, which are then not cached again); pending hits are dropped (their requests look
        up again); in-flight stores complete as failed (counted in `num_failed_store_blocks`), so their
        content is never committed. No reference moves except the pending hits'. All that happens either
        way; False says the store policy still holds GPU blocks it has not issued a store for (stored after
        this call; vLLM's GPU reset fails then too): call again after a step. Between engine steps only."""
        transfers = self.transfers
        if transfers.loads_to_send:
            raise SchedulerError(f"reset_cache with {len(transfers.loads_to_send)} loads not yet sent: called in "
                                 "the middle of a step (between allocation and build_connector_meta)")
        for state in transfers.requests.values():
            if state.pending_hit is not None:
                self.lookups.drop_pending_hit(state)
                state.move_to(Phase.NEW)
        for event in transfers.store_events.values():
            event.failed = True
        for tier in self._tiers:
            tier.fail_in_flight()
        pool = self.cpu_pool
        for block in list(pool.cached.values()):
            if not pool.discard(block):  # held by a load in flight: keeps its place, loses its content key
                pool.uncache(block)
        return not self.policy.num_held_blocks

    # ------------------------------------------------------------------ introspection
    def take_events(self) -> list[KVEvent]:
        return self.kv_events.take()

    def is_saved(self, key: bytes) -> bool:
        """A copy of this block's content is on the CPU tier or being stored there."""
        return self.policy_view.is_saved(key)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.transfers.requests

    def has_live_requests(self) -> bool:
        """Some request is looked up, waiting for its load, or running (O(1))."""
        return bool(self.transfers.requests)

    def phase_of(self, request_id: str) -> Phase | None:
        """The request's lifecycle phase, or None when the connector holds no state for it."""
        state = self.transfers.requests.get(request_id)
        return None if state is None else state.phase

    def gpu_blocks_being_stored(self) -> set[int]:
        """GPU blocks an outstanding store event copies from (O(blocks in flight): tests, tools)."""
        return self.transfers.gpu_blocks_being_stored()

    @property
    def num_blocks_in_quarantine(self) -> int:
        """GPU blocks (and as many CPU blocks) kept out of use now for copies that may still run."""
        return self.transfers.num_blocks_in_quarantine

    @property
    def num_inflight_transfers(self) -> int:
        """Transfers in flight or queued (the engine should keep stepping until this is zero)."""
        return (self.transfers.num_in_flight() + self.policy.num_held_blocks
                + (sum(tier.num_events for tier in self._tiers) if self._tiers else 0))

    def is_idle(self) -> bool:
        if self._tiers and any(tier.num_events for tier in self._tiers):
            return False
        return not self.policy.num_held_blocks and self.transfers.is_quiet()

    def check_integrity(self) -> None:
        """Pool invariants, the stores-and-reads invariant (module docstring), and: when idle, the connector
        holds no CPU references at all. O(CPU blocks + transfers in flight): tests and idle checks only."""
        self.cpu_pool.check_integrity()
        overlaps = self.transfers.store_read_overlaps()
        if overlaps:
            raise SchedulerError(f"{len(overlaps)} CPU blocks a store writes are still read (our bug): "
                                 + "; ".join(overlaps[:4]))
        held = self.transfers.held_cpu_block_ids()
        for tier in self._tiers:
            held |= tier.held_block_ids()
        for block in self.cpu_pool.blocks[1:]:
            if block.ref_cnt > 0 and block.block_id not in held:
                raise SchedulerError(f"CPU {block} is referenced but no transfer or pending hit holds it")
        if self.is_idle() and self.cpu_pool.num_held_blocks():
            raise SchedulerError(f"idle, yet {self.cpu_pool.num_held_blocks()} CPU blocks are still referenced")

    def close(self) -> None:
        """Stop the lower tiers' threads (nothing else to release)."""
        for tier in self._tiers:
            tier.close()


def _fan_out(listeners: list[Callable[[Block], None]]) -> Callable[[Block], None]:
    """One eviction callback that tells every listener, in order."""
    def hear_all(block: Block) -> None:
        for hear in listeners:
            hear(block)
    return hear_all
