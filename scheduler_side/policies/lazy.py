"""The lazy store policy (exclusive-leaning tier): store only what the GPU is about to evict.

Only free, hashed GPU blocks within `lookahead` blocks of the GPU pool's eviction frontier that are not on
the CPU yet (and not dead: see admission.py) are stored, so the GPU evicts only saved blocks. A stored
block goes back where it was picked, behind the block before it then (`stored_blocks_places`), so the
GPU's LRU order is kept; at the head where that block is gone.

The saved head (saved_head.py): the free blocks at the head of the GPU free queue that the policy scanned
and did not pick, up to the cursor; each step scans on from the cursor only as far as the budget exceeds
it. Blocks leave it as the engine takes them (`on_allocated`, `on_scheduled`) and when the tier drops their
CPU copies (`on_cpu_copy_dropped`, `on_cpu_copies_evicted`: picked again at the next step).
In a step that ran at most one request, the saved blocks within a deferred admission's span have their CPU
copies made most recently used before the step's stores take CPU blocks (the admission drops them from the
GPU next step: in an exclusive tier they are newer than anything on the CPU, and a copy the stores evicted
would be lost then).
CPU copies of blocks that were just loaded to the GPU, or that an admitted request hit on the GPU, are
forgotten (empty room, taken first; the GPU holds them now; the tiers stay mostly exclusive) once the CPU
tier is under pressure: it has evicted a block, which the CPU pool does only once no empty block is free
(`BlockPool(empty_first=True)`): the tier filled up. Until then a loaded block's copy is kept as the most
recently used content: once the GPU evicts that block, this copy is the one the tier has. A quiet
spell does not end the pressure: a copy kept then sits on both tiers once the tier is busy again, and
when the GPU evicts that block its copy is where the CPU last saw it, not the newest.

What the next step allocates, and who saves it: an admission's allocation is checked at its lookup against
the blocks it will really evict (its own free GPU hits skipped); if unsaved ones lie there it is deferred
while this step's store saves its whole span, goes through blind the very next step, and is checked again
if the engine reached it later (at most `MAX_DEFERRALS` deferrals in a row). Requests still allocating
their prompt (chunked prefill, or the rest after a CPU load) have that rest saved ahead. The lookahead
covers the rest: twice the decaying peak of what nothing above covered, plus a mean of the admissions of
steps that ran at most one request. There a deferral saves exactly what the admission takes, so one long
prompt must not make many later steps keep hundreds of blocks on both tiers; with more requests running,
their allocations move the frontier before a deferred request's turn, so admissions count in the peak.

What it holds on the GPU, and the bound: when the engine's free queue is shorter than what the last store
meant to save (the lookahead, deferred spans, prompt rests), a finishing request's unsaved blocks are held
(one reference each) until the next step's store event takes them, at most as many as the CPU tier has free
blocks; every hold ends at the next `pick_stores` (its reference becomes the store event's, or is released).
So the engine's GPU cache can keep, for one step, blocks vLLM alone would have evicted.
Cost per step: the frontier read past the cursor (`gpu_frontier`: O(blocks that entered the budget since the
last step), as list building, no Python step of ours per block) plus O(unsaved blocks in it) Python steps
(frontier_scan.py); O(1) per CPU copy dropped; O(blocks stored) when a store completes; per admission
O(blocks allocated + its GPU hit), with no read when the saved head covers what it allocates and the tier
dropped none of its copies since the last step. Nothing grows with the GPU pool, the CPU tier or the free
queue.
Follows store_policy's call order.
"""

from __future__ import annotations

from math import ceil

from offload_connector.hashing import group_suffix, with_group_id
from scheduler_side.policies.evicted_keys import EvictedKeys
from scheduler_side.policies.finish_holds import FinishHolds
from scheduler_side.policies.saved_head import SavedHead
from scheduler_side.policies.store_policy import EagerStorePolicy, StorePicks, StorePolicy, StorePolicyView
from scheduler_side.request_state import LoadJob, RequestState

MAX_DEFERRALS = 4  # lookups a request may be deferred so that its allocation evicts only saved blocks
LOOKAHEAD_FACTOR = 2.0  # lookahead / (recent peak of uncovered allocations + mean largest admission)
ADMIT_WEIGHT = 0.1  # weight of this step's largest admission in their mean


class LazyStorePolicy(StorePolicy):
    def __init__(self, view: StorePolicyView) -> None:
        super().__init__(view)
        self._inclusive = EagerStorePolicy(view)  # picks every computed block while the tier has room
        self._suffix = group_suffix(view.group_id)  # a block hash + this = its key (`with_group_id`)
        self._block_size = view.block_size
        self._step_alloc = 0  # blocks the engine handed to requests this step
        self._peak_alloc = 0.0  # decaying peak of per-step allocations
        self._admit_mean = 0.0  # mean largest admission of steps that ran at most one request (EMA)
        self._head = SavedHead(view)  # the saved head of the GPU free queue (saved_head.py)
        self._holds = FinishHolds(view)  # a finishing request's blocks held for the next store (finish_holds.py)
        self._last_event_id: int | None = None  # our most recent store event
        self._steps = 0  # pick_stores calls (engine steps)
        # Pressure: a lookup missed on content dropped within the last `num_gpu_blocks` drops (`_evicted`):
        # the CPU tier's evictions, or, over a write-back lower tier that keeps them (the disk tier), that
        # tier's own evictions (a CPU eviction it keeps comes back from it: nothing was lost). Room an
        # exclusive tier would have had. From then on space spent on copies of blocks the
        # GPU holds costs hits, for good: a quiet spell (a session's turns all GPU hits) would keep copies
        # that cost room once the tier is busy again. Until then lazy stores what eager stores: a tier that
        # evicts only content nobody asks for again loses nothing by holding copies of the GPU's blocks.
        self._cpu_under_pressure = False
        self._evicted: EvictedKeys | None = EvictedKeys(view.num_gpu_blocks)  # None under pressure
        self._deficit = 0  # blocks that admissions deferred this step need saved by its store event
        self._p_inflight = 0.0  # how often a store event outlasted the next step's allocations (EMA)
        self._admit_alloc = 0  # blocks this step's largest admission took
        self._num_scheduled = 0  # requests scheduled this step
        self._pending = 0  # prompt blocks the requests scheduled this step have still to allocate
        self._covered = 0  # `_pending` at the last pick: what this step's running allocations may take
        self._deferred: dict[str, tuple[int, int]] = {}  # request id -> (step clock, deferrals in a row)
        self._demand = 0  # blocks the last store event meant to save: what the next step may allocate

    @property
    def gpu_copy_worthless_after_store(self) -> bool:  # type: ignore[override]
        """Under pressure a stored block goes to the head of the GPU free queue (the CPU has it); while the
        tier has room the GPU keeps its LRU order, as with eager stores."""
        return self._cpu_under_pressure

    @property
    def under_pressure(self) -> bool:
        """The CPU tier evicted content that was asked for again: lazy stores only near the GPU's eviction
        frontier, for good."""
        return self._cpu_under_pressure

    def on_cpu_evicted(self, key: bytes) -> None:
        if self._evicted is not None:
            self._evicted.add(key)

    def on_cpu_copy_dropped(self, key: bytes, evicted: bool = True) -> None:
        """A block of the saved head holding this content is unsaved now: picked again at the next step."""
        self._head.on_copy_dropped(key)

    def on_cpu_copies_evicted(self, keys: list[bytes]) -> None:
        self._head.on_copies_dropped(keys)

    @property
    def hears_cpu_copy_drops(self) -> bool:
        """Under pressure: a block of the saved head whose copy the tier evicted must be saved again."""
        return self._cpu_under_pressure

    @property
    def hears_cpu_evictions(self) -> bool:
        """Until the pressure starts: the evicted keys it counts then end with it."""
        return self._evicted is not None

    def _missed_evicted(self, state: RequestState, num_cpu_hit_blocks: int) -> bool:
        """The lookup's first miss (the block after its GPU and CPU hits) is a recently evicted copy."""
        i = state.num_gpu_hit_blocks + num_cpu_hit_blocks
        request = state.request
        if self._evicted is None or i >= min(len(request.block_hashes), (request.num_tokens - 1) // self._block_size):
            return False  # (the hit reaches as far as a lookup looks: no miss)
        return with_group_id(request.block_hashes[i], self.view.group_id) in self._evicted

    @property
    def lookahead(self) -> int:
        """Blocks from the eviction frontier to keep saved: `lazy_lookahead_blocks` if set, else the larger
        of the engine's per-step bound and twice the recent peak of uncovered allocations plus the mean
        admission of lone steps (CPU hits allocate outside the token budget, so the bound alone can fall
        short)."""
        fixed = self.view.lazy_lookahead_blocks
        if fixed is not None:
            return fixed
        return max(16, self.view.max_blocks_per_step or 0,
                   int(LOOKAHEAD_FACTOR * (self._peak_alloc + self._admit_mean)))

    def on_allocated(self, state: RequestState, num_gpu_hit_blocks: int) -> list[bytes]:
        """The request now holds its GPU-hit blocks: under CPU pressure their CPU copies give way. (Not at
        lookup: a request that then fails to allocate leaves those blocks free, maybe at the frontier.)"""
        self._admit_alloc = max(self._admit_alloc, len(state.gpu_block_ids) - num_gpu_hit_blocks)
        self._head.take(state.gpu_block_ids)  # its new blocks left the free queue's head, its GPU hits the queue
        if state.pending_hit is not None:  # a CPU hit, loaded first: its prompt's rest is allocated after
            self._pending += max(0, -(-state.request.num_tokens // self._block_size) - len(state.gpu_block_ids))
        if not num_gpu_hit_blocks or not self._cpu_under_pressure:
            return []
        suffix = self._suffix
        return [h + suffix for h in state.request.block_hashes[:num_gpu_hit_blocks]]  # with_group_id, inlined

    def on_load_complete(self, job: LoadJob) -> bool:
        """The loaded blocks are resident on the GPU now: under CPU pressure their CPU copies give way."""
        return self._cpu_under_pressure

    def lends_load_slots(self) -> bool:
        """Under CPU pressure a loaded block's copy gives way anyway (`on_load_complete`): its slot may take a
        store of the same step, which then evicts nothing. Otherwise the store would evict an older block
        while the slot sits read and empty: for the load's length both tiers hold the loaded blocks."""
        return self._cpu_under_pressure

    def on_blocks_allocated(self, num_blocks: int) -> None:
        self._step_alloc += num_blocks

    def on_scheduled(self, state: RequestState, num_computed_tokens: int) -> None:
        """A request still allocating its prompt (chunked prefill) takes the rest in the next steps: the
        next store event saves that much more of the frontier, and those allocations stay out of the peak.
        Lazy stores nothing through the store cursor, so it keeps there the request's block count at the
        last check: a step that gave the request no new block (most decode steps) costs one comparison."""
        self._num_scheduled += 1
        if not self._cpu_under_pressure:
            self._inclusive.on_scheduled(state, num_computed_tokens)
            return
        num_blocks, checked = len(state.gpu_block_ids), state.num_store_checked_blocks
        if num_blocks == checked:
            return
        state.num_store_checked_blocks = num_blocks
        self._head.take(state.gpu_block_ids[checked:])  # the blocks it took this step
        rest = -(-state.request.num_tokens // self._block_size) - num_blocks
        if rest > 0:
            self._pending += rest

    def may_admit(self, state: RequestState, num_cpu_hit_blocks: int) -> bool:
        """Defer a request whose allocation would reach past the saved part of the GPU frontier.

        The lookahead covers a typical step; one admission can take more (a long prompt, a large CPU hit,
        which allocates outside the token budget). Its allocation happens right after this lookup, so the
        free queue is exactly what it will draw from, less its own free GPU hits (taken out, not evicted):
        if unsaved cached blocks lie within the blocks it evicts and the CPU tier has room for them, answer
        "next step" and add its span to this step's stores (the policy's own `_deficit`). The next step it
        goes through unchecked (that store saved its span); looked up later, other allocations have moved
        the frontier, so it is checked again, up to `MAX_DEFERRALS` deferrals in a row.
        Cost O(blocks it allocates + its GPU hit).
        """
        if not self._cpu_under_pressure:
            if self._missed_evicted(state, num_cpu_hit_blocks):
                self._cpu_under_pressure, self._evicted = True, None  # from the next lookup and store on
            return True  # every computed block was stored as it was computed: the frontier is saved
        deferred_at, in_a_row = self._deferred.pop(state.request_id, (None, 0))
        if deferred_at == self._steps - 1 or in_a_row >= MAX_DEFERRALS:
            return True  # the last step's store saved its span (or it waited long enough)
        if deferred_at == self._steps:  # asked again within the step: this step's store still saves its span
            self._deferred[state.request_id] = (deferred_at, in_a_row + 1)
            return False
        view = self.view
        rest = -(-state.request.num_tokens // self._block_size) - state.num_gpu_hit_blocks - num_cpu_hit_blocks
        bound = view.max_blocks_per_step
        need = num_cpu_hit_blocks + (rest if bound is None else min(rest, bound))
        if need <= 0:
            return True
        # Within the saved head, less what this step's running requests may have taken from it already
        # (told at the metadata, after the lookups): nothing unsaved to evict, no read.
        head = self._head
        if not head.unsaved and need + state.num_gpu_hit_blocks + ceil(self._peak_alloc) <= len(head):
            return True
        cached, reserved = view.saved_key_maps()
        dead = view.is_dead if view.may_have_dead() else None
        own = self._gpu_hit_keys(state)
        num = need + len(own)  # the frontier it reaches, unless a key of its own is there twice: then more
        while True:
            _, keys = view.gpu_frontier(num)
            unsaved = taken = span = 0  # span: frontier blocks the allocation reaches (its own free hits too)
            for key in keys:
                if taken >= need:
                    break
                span += 1
                if key in own:
                    continue  # its own GPU hit: the allocation takes it out of the queue, evicting nothing
                taken += 1
                if key is not None and key not in cached and key not in reserved and not (dead and dead(key)):
                    unsaved += 1
            if taken >= need or len(keys) < num:
                break
            num *= 2
        # Worth a step only if the CPU tier can take them (a tiny tier would defer in vain).
        if unsaved == 0 or unsaved > view.cpu_num_free_blocks():
            return True
        self._deficit += span
        self._deferred[state.request_id] = (self._steps, in_a_row + 1)
        return False

    def _gpu_hit_keys(self, state: RequestState) -> frozenset[bytes | None]:
        """Keys of the request's GPU-hit blocks. Some may be free, near the frontier: its allocation takes
        them out of the free queue without evicting them, so the blocks it evicts lie that much further on."""
        if not state.num_gpu_hit_blocks:
            return frozenset()
        suffix = self._suffix
        return frozenset([h + suffix for h in state.request.block_hashes[:state.num_gpu_hit_blocks]])

    def _tick(self) -> None:
        """One engine step: CPU pressure, the decaying peak of allocations nothing covered (not the prompt
        chunks the last store saved ahead, nor the admission of a step that ran at most one request: that
        goes into a mean), how long store events last."""
        self._steps += 1
        alone = self._admit_alloc if self._num_scheduled <= 1 else 0
        self._num_scheduled = 0
        uncovered = max(0, self._step_alloc - alone - self._covered)
        self._peak_alloc = max(float(uncovered), 0.9 * self._peak_alloc)
        self._admit_mean = (1.0 - ADMIT_WEIGHT) * self._admit_mean + ADMIT_WEIGHT * alone
        self._step_alloc = self._admit_alloc = 0
        bound = self.view.max_blocks_per_step
        self._covered = self._pending if bound is None else min(self._pending, bound)
        self._pending = 0
        event = self._last_event_id
        if event is not None:
            outstanding = self.view.is_store_outstanding(event)
            self._p_inflight = 0.8 * self._p_inflight + (0.2 if outstanding else 0.0)

    def pick_stores(self) -> StorePicks:
        """Held blocks first, then unsaved free blocks from the eviction frontier, up to the lookahead (plus
        what deferred admissions need) and the CPU tier's free room."""
        lone = self._num_scheduled <= 1  # (before the tick resets it)
        self._tick()
        if not self._cpu_under_pressure:
            return self._inclusive.pick_stores()  # (nothing is held: holds start under pressure, which lasts)
        if self._inclusive.num_picked:  # (none: under pressure `on_scheduled` gives it nothing)
            self._inclusive.pick_stores()
        view = self.view
        cached, reserved = view.saved_key_maps()
        dead = view.is_dead if view.may_have_dead() else None
        picks = self._holds.release(cached, reserved, dead)  # every hold ends with this event
        picked = set(picks.keys)
        # A picked block leaves the free queue while its store is in flight. If that outlasts the next
        # step's allocations, those allocations reach past it, so a pick must not count against the
        # lookahead; if the store lands first, the block is back (saved) and it should. Weigh each pick by
        # how often the last event was still in flight at the next step's metadata (`_p_inflight`).
        pick_cost = 1.0 - self._p_inflight
        budget = float(self.lookahead + self._deficit + self._covered)
        self._demand = int(budget)
        # Deferred admissions' spans (the head of the frontier): where at most one request ran, what they
        # allocate next step is exactly that; with more running, other allocations come first.
        span, self._deficit = (self._deficit if lone else 0), 0
        room = view.cpu_num_free_blocks() - len(picks.gpu_ids)
        # Block by block on from the saved head while the budget lasts: an unsaved block is picked (while the
        # tier has room) at `pick_cost`, any other block costs 1 (frontier_scan.py walks the runs between
        # unsaved ones). The blocks of the saved head cost 1 each without a read.
        head = self._head
        head.check_cursor()  # (the engine took the last block scanned: scan again from the head)
        rest = budget - len(head)
        if head.unsaved:  # (each still in the queue costs what it would cost the scan)
            room, cost = head.save_again(picks, picked, room, pick_cost, cached, reserved, dead)
            rest -= cost
        if rest > 0:
            head.scan(picks, picked, rest, pick_cost, room, cached, reserved, dead)
        if span:
            for key in view.gpu_frontier(span)[1]:
                if key is not None and (key in cached or key in reserved) and not (dead and dead(key)):
                    picks.refresh_keys.append(key)  # the deferred admission evicts it next: keep its copy
        return picks

    def on_stores_emitted(self, event_id: int | None, stored_gpu_ids: list[int]) -> None:
        """Under pressure the stored blocks go back where they were picked (`stored_blocks_places`)."""
        self._last_event_id = event_id
        self._head.remember(event_id if self._cpu_under_pressure else None, stored_gpu_ids)

    def stored_blocks_places(self, event_id: int) -> list[tuple[int | None, list[int]]] | None:
        """Each block the scan picked goes back where it was, behind the block before it then, while that
        one is still in the saved head; the others at the head (saved_head.py)."""
        return self._head.places(event_id)

    def on_store_complete(self, event_id: int) -> None:
        """The stored blocks join the saved head."""
        self._head.on_store_complete(event_id)

    def on_request_finished(self, state: RequestState) -> list[int]:
        """Blocks freed now are scanned only at the next step's metadata, after that step's allocations.
        When the free queue is shorter than the lookahead, those allocations could evict them unsaved: hold
        them until the next store event takes them, as many as the CPU tier has room for (holding what
        cannot be stored would only shrink the GPU's free queue)."""
        if self._deferred:
            self._deferred.pop(state.request_id, None)
        if not self._cpu_under_pressure:
            return []  # its computed blocks are stored or being stored
        view = self.view
        if view.gpu_num_free_blocks() >= max(self.lookahead, self._demand):
            return []
        room = view.cpu_num_free_blocks() - len(self._holds)
        return self._holds.hold(state, room) if room > 0 else []

    @property
    def num_held_blocks(self) -> int:
        return len(self._holds)
