"""Which GPU blocks to store to the CPU tier each step.

- `EagerStorePolicy` (inclusive tier): every full, hashed block whose KV this step's forward completes,
  unless it is already cached on the CPU or being stored. Cost per step: O(newly completed blocks).
- `LazyStorePolicy` (exclusive-leaning tier): only free, hashed GPU blocks within `lookahead` blocks of the
  GPU pool's eviction frontier that are not on the CPU yet, so the GPU evicts only saved blocks. Saved GPU
  blocks return to their place in the GPU free queue (LRU order is kept), and CPU copies of blocks that
  were just loaded to the GPU, or that an admitted request hit on the GPU, are forgotten and go to the head of
  the CPU free queue (the GPU holds them now; the tiers stay mostly exclusive) while the CPU tier is under
  pressure (it evicted within the last `PRESSURE_STEPS` steps); without pressure they are kept. A request
  whose allocation would evict unsaved blocks (a burst beyond the lookahead) is deferred one step, once,
  while this step's store saves them. Cost per step: O(lookahead); per admission O(blocks allocated).

A policy never allocates; the scheduler allocates CPU blocks for what it selects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload_connector.config import OffloadConfig
from offload_connector.hashing import with_group_id

if TYPE_CHECKING:
    from scheduler_side.connector import OffloadScheduler, StoreEvent
    from scheduler_side.request_state import LoadJob, RequestState


PRESSURE_STEPS = 64  # lazy: steps after a CPU eviction during which the tier counts as under pressure
MAX_DEFERRALS = 1  # lazy: steps a request may be deferred so that its allocation evicts only saved blocks
LOOKAHEAD_FACTOR = 2.0  # lazy lookahead / recent peak per-step allocation (loads included)


class StorePolicy:
    cpu_copy_worthless_after_load = False
    gpu_copy_worthless_after_store = False

    def __init__(self, sched: OffloadScheduler) -> None:
        self.sched = sched

    def _is_saved(self, key: bytes) -> bool:
        return self.sched.is_saved(key)

    def on_allocated(self, state: RequestState, num_gpu_hit_blocks: int) -> None:
        """The engine allocated the request's blocks; its first `num_gpu_hit_blocks` were GPU hits."""

    def may_admit(self, state: RequestState, num_cpu_hit_blocks: int) -> bool:
        """At lookup (GPU hit known, CPU hit found): may the engine allocate now? False: retry next step."""
        return True

    def on_blocks_allocated(self, num_blocks: int) -> None:
        """The engine took `num_blocks` blocks from its free queue this step (new blocks, loads included)."""

    def on_scheduled(self, state: RequestState, num_computed_tokens: int) -> None: ...

    def select_stores(self) -> tuple[list[int], list[bytes]]:
        return [], []

    def on_load_scheduled(self, job: LoadJob) -> None: ...

    def on_load_complete(self, job: LoadJob) -> None: ...

    def on_stores_emitted(self, event: StoreEvent | None) -> None:
        """After `select_stores`: the store event made of its picks (None if nothing could be stored)."""

    def on_store_complete(self, event: StoreEvent) -> None: ...

    def on_request_finished(self, state: RequestState) -> None: ...

    @property
    def num_held_blocks(self) -> int:
        """GPU blocks the policy holds a reference on while they wait for the next store event."""
        return 0


class EagerStorePolicy(StorePolicy):
    def __init__(self, sched: OffloadScheduler) -> None:
        super().__init__(sched)
        self._block_size = sched.block_size
        self._gpu_ids: list[int] = []
        self._keys: list[bytes] = []
        self._picked: set[bytes] = set()

    def on_scheduled(self, state: RequestState, num_computed_tokens: int) -> None:
        start = state.num_store_checked_blocks
        end = num_computed_tokens // self._block_size
        if end <= start:
            return  # the common decode step: no block completed
        hashes, gpu_block_ids = state.request.block_hashes, state.gpu_block_ids
        end = min(end, len(hashes), len(gpu_block_ids))
        group = self.sched.group_id
        picked, cached, inflight = self._picked, self.sched.cpu_pool.cached, self.sched._inflight_store_keys
        for i in range(start, end):
            key = with_group_id(hashes[i], group)
            gpu_id = gpu_block_ids[i]
            if gpu_id == 0 or key in picked or key in cached or key in inflight:
                continue  # the null block, or already picked, on the CPU or being stored
            picked.add(key)
            self._gpu_ids.append(gpu_id)
            self._keys.append(key)
        state.num_store_checked_blocks = max(start, end)

    def select_stores(self) -> tuple[list[int], list[bytes]]:
        out = self._gpu_ids, self._keys
        self._gpu_ids, self._keys, self._picked = [], [], set()
        return out


class LazyStorePolicy(StorePolicy):
    cpu_copy_worthless_after_load = True
    gpu_copy_worthless_after_store = True

    def __init__(self, sched: OffloadScheduler) -> None:
        super().__init__(sched)
        self._fixed = sched.config.lazy_lookahead_blocks
        self._step_alloc = 0  # blocks the engine handed to requests this step
        self._peak_alloc = 0.0  # decaying peak of per-step allocations
        self._scanned: list[tuple[int, bytes | None]] = []  # the frontier this step's selection scanned
        self._frontier_of: dict[int, list[tuple[int, bytes | None]]] = {}  # store event -> its frontier
        self._held: dict[bytes, int] = {}  # key -> GPU block we hold for the next store event
        self._last_event_id: int | None = None  # our most recent store event
        self._steps = 0  # select_stores calls (engine steps)
        self._evictions_seen = 0  # the CPU pool's LRU eviction count at the last step
        self._last_eviction_step = -PRESSURE_STEPS - 1  # the last step that saw a CPU eviction
        self._deficit = 0  # blocks that admissions deferred this step need saved by its store event
        self._p_inflight = 0.0  # how often a store event outlasted the next step's allocations (EMA)

    @property
    def lookahead(self) -> int:
        """Blocks from the eviction frontier to keep saved: `lazy_lookahead_blocks` if set, else the larger
        of the engine's per-step bound and a multiple of the recent peak allocation (CPU hits allocate
        outside the token budget, so the bound alone can fall short)."""
        if self._fixed is not None:
            return self._fixed
        return max(16, self.sched.max_blocks_per_step or 0, int(LOOKAHEAD_FACTOR * self._peak_alloc))

    @property
    def _cpu_under_pressure(self) -> bool:
        """The CPU tier evicted within the last `PRESSURE_STEPS` steps: space spent on copies of blocks
        the GPU holds costs hits. Without pressure such copies are kept (a free second chance)."""
        return self._steps - self._last_eviction_step <= PRESSURE_STEPS

    def on_allocated(self, state: RequestState, num_gpu_hit_blocks: int) -> None:
        """The request now holds its GPU-hit blocks: under CPU pressure their CPU copies give way. (Not at
        lookup: a request that then fails to allocate leaves those blocks free, maybe at the frontier.)"""
        if not num_gpu_hit_blocks or not self._cpu_under_pressure:
            return
        hashes = state.request.block_hashes
        cpu_pool, group = self.sched.cpu_pool, self.sched.group_id
        for i in range(min(num_gpu_hit_blocks, len(hashes))):
            block = cpu_pool.lookup(with_group_id(hashes[i], group))
            if block is not None:
                cpu_pool.discard(block)

    def on_load_complete(self, job: LoadJob) -> None:
        """The loaded blocks are resident on the GPU now: under CPU pressure their CPU copies give way."""
        if not self._cpu_under_pressure:
            return
        for block in job.cpu_blocks:
            if block.ref_cnt == 1:  # only the load's own reference, dropped right after this
                self.sched.cpu_pool.uncache(block)

    def on_blocks_allocated(self, num_blocks: int) -> None:
        self._step_alloc += num_blocks

    def may_admit(self, state: RequestState, num_cpu_hit_blocks: int) -> bool:
        """Defer a request (once) whose allocation would reach past the saved part of the GPU frontier.

        The lookahead covers a typical step; one admission can take more (a long prompt, a large CPU hit,
        which allocates outside the token budget). Its allocation happens right after this lookup, so the
        free queue is exactly what it will draw from: if unsaved cached blocks lie within the blocks it
        takes and the CPU tier has room for them, answer "next step" and add its need to this step's
        stores. Cost O(blocks it allocates).
        """
        if state.num_deferrals >= MAX_DEFERRALS:
            return True
        req, bs = state.request, self.sched.block_size
        rest = -(-req.num_tokens // bs) - state.num_gpu_hit_blocks - num_cpu_hit_blocks
        bound = self.sched.max_blocks_per_step
        need = num_cpu_hit_blocks + (rest if bound is None else min(rest, bound))
        if need <= 0:
            return True
        is_saved, unsaved = self._is_saved, 0
        for n, (_, key) in enumerate(self.sched.gpu_pool.eviction_candidates()):
            if n >= need:
                break
            if key is not None and not is_saved(key):
                unsaved += 1
        # Worth a step only if the CPU tier can take them (a tiny tier would defer in vain).
        if unsaved == 0 or unsaved > self.sched.cpu_pool.num_free_blocks:
            return True
        state.num_deferrals += 1
        self._deficit += need
        return False

    def select_stores(self) -> tuple[list[int], list[bytes]]:
        self._steps += 1
        evictions = self.sched.cpu_pool.num_evictions
        if evictions != self._evictions_seen:
            self._evictions_seen, self._last_eviction_step = evictions, self._steps
        self._peak_alloc = max(float(self._step_alloc), 0.9 * self._peak_alloc)
        self._step_alloc = 0
        gpu_ids = list(self._held.values())
        keys = list(self._held)
        picked = set(keys)
        scanned: list[tuple[int, bytes | None]] = []
        # A picked block leaves the free queue while its store is in flight. If that outlasts the next
        # step's allocations, those allocations reach past it, so a pick must not count against the
        # lookahead; if the store lands first, the block is back (saved) and it should. Weigh each pick by
        # how often the last event was still in flight at the next step's metadata (`_p_inflight`).
        event = self._last_event_id
        if event is not None:
            outstanding = event in self.sched._store_events
            self._p_inflight = 0.8 * self._p_inflight + (0.2 if outstanding else 0.0)
        pick_cost = 1.0 - self._p_inflight
        budget = float(self.lookahead + self._deficit)
        self._deficit = 0
        room = self.sched.cpu_pool.num_free_blocks - len(gpu_ids)
        for gpu_id, key in self.sched.gpu_pool.eviction_candidates():
            if budget <= 0:
                break
            scanned.append((gpu_id, key))
            if room > 0 and key is not None and key not in picked and not self._is_saved(key):
                picked.add(key)
                gpu_ids.append(gpu_id)
                keys.append(key)
                room -= 1
                budget -= pick_cost
            else:
                budget -= 1
        self._scanned = scanned
        return gpu_ids, keys

    def on_stores_emitted(self, event: StoreEvent | None) -> None:
        """Hand held blocks over to the store event (which took its own reference); remember the frontier
        up to the last scanned block the event stores (a full CPU pool may have cut the list)."""
        if self._held:
            self.sched.gpu_pool.free(list(self._held.values()))
            self._held = {}
        frontier, self._scanned = self._scanned, []
        self._last_event_id = None if event is None else event.event_id
        if event is None:
            return
        stored = set(event.gpu_block_ids)
        end = next((i for i in range(len(frontier) - 1, -1, -1) if frontier[i][0] in stored), -1)
        if end >= 0:
            self._frontier_of[event.event_id] = frontier[:end + 1]

    def on_store_complete(self, event: StoreEvent) -> None:
        """Saved blocks went back to the head; restore the frontier's LRU order around them."""
        frontier = self._frontier_of.pop(event.event_id, None)
        if frontier:
            self.sched.gpu_pool.move_to_front(frontier)

    def on_request_finished(self, state: RequestState) -> None:
        """Blocks freed now are scanned only at the next step's metadata, after that step's allocations.
        When the free queue is shorter than the lookahead, those allocations could evict them unsaved: hold
        them (one reference each) until the next store event takes them, as many as the CPU tier has room
        for (holding what cannot be stored would only shrink the GPU's free queue)."""
        pool = self.sched.gpu_pool
        room = self.sched.cpu_pool.num_free_blocks - len(self._held)
        if pool.num_free_blocks() >= self.lookahead or room <= 0:
            return
        hashes = state.request.block_hashes
        n = min(state.num_computed_tokens // self.sched.block_size, len(hashes), len(state.gpu_block_ids))
        ids = []
        for i in range(n):
            if len(ids) >= room:
                break
            key = with_group_id(hashes[i], self.sched.group_id)
            gpu_id = state.gpu_block_ids[i]
            if gpu_id == 0 or key in self._held or self._is_saved(key):
                continue
            self._held[key] = gpu_id
            ids.append(gpu_id)
        if ids:
            pool.touch(ids)

    @property
    def num_held_blocks(self) -> int:
        return len(self._held)


def make_store_policy(config: OffloadConfig, sched: OffloadScheduler) -> StorePolicy:
    if config.store_policy == "eager":
        return EagerStorePolicy(sched)
    if config.store_policy == "lazy":
        return LazyStorePolicy(sched)
    raise ValueError(f"unknown store_policy {config.store_policy!r}; allowed: eager, lazy")
