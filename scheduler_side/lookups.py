"""`Lookups`: a request's CPU hit after the engine's GPU hit (step 1 of the scheduler's step, SPEC §4).

Walk the request's block keys after the GPU hit in the CPU prefix cache, stop at the first miss, and pin
the run found (a pending hit) until allocation consumes it (allocations.py). A block of the run still
being stored, another request's load of its first block, a lower tier still answering, or the store
policy deferring the request makes the engine ask again next step (None). Per call: O(blocks walked), no
allocation but the pending hit's list.

Mutates: the request's `RequestState` (created here on first sight: phase, pending hit, wait counters,
GPU hit) in `Transfers.requests`; one CPU reference per pinned block (`drop_pending_hit` gives them back);
the lookup counters of `SchedulerStats`; the eviction policy's hints on misses (policies that want them);
the lower tiers' waits (through `LowerTier.start`/`waiting`, nearest first). Reads the store policy's
`may_admit`.
With several KV-cache groups the walk past the common checks is hybrid.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_connector.hashing import group_suffix, with_group_id
from scheduler_side.errors import SchedulerError
from scheduler_side.hybrid import HybridGroups
from scheduler_side.interfaces import RequestLike
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.pool.block import Block
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import PendingHit, Phase, RequestState
from scheduler_side.stats import SchedulerStats
from scheduler_side.tiers.base import LowerTier
from scheduler_side.transfers import Transfers
from scheduler_side.waits import asks_again_for_load, asks_again_for_store


class Lookups:
    def __init__(self, transfers: Transfers, cpu_pool: BlockPool, policy: StorePolicy, stats: SchedulerStats,
                 tiers: tuple[LowerTier, ...], hybrid: HybridGroups | None, block_size: int, group_id: int,
                 max_store_wait_steps: int) -> None:
        self.transfers, self.cpu_pool, self.policy, self.stats = transfers, cpu_pool, policy, stats
        self.tiers, self.hybrid = tiers, hybrid  # the lower tiers, nearest first (empty: none)
        self.block_size, self.group_id, self.max_store_wait_steps = block_size, group_id, max_store_wait_steps
        self.hints = cpu_pool.free_queue.wants_hints  # misses cost a loop per lookup; only some policies learn
        self._suffix = group_suffix(group_id)  # a block hash + this = its CPU key (`with_group_id`)

    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        """CPU hit after the engine's GPU hit: (tokens to load, load is async), or (None, False) to retry.

        The hit is the longest run of consecutive cached blocks starting at the GPU hit, capped so that at
        least one prompt token is still computed. Its CPU blocks are pinned until allocation. A block of
        the run still being stored makes the request ask again next step (None), at most
        `max_store_wait_steps` times per request; then the hit ends before that block. The store policy
        may defer the request a step (None) so that the GPU saves what its allocation would evict.
        """
        requests = self.transfers.requests
        state = requests.get(request.request_id)
        if state is None:
            state = requests[request.request_id] = RequestState(request)
        elif state.phase is Phase.FINISHED:  # a new request reuses the id of a finished one still loading
            return None, False  # ask again once that load is done and its state is gone
        elif state.phase is Phase.LOADING:
            raise SchedulerError(f"lookup for request {request.request_id} while its load is in flight")
        elif state.request is not request:
            # Adopting it would store the new request's blocks under the old prompt's hashes: wrong KV later.
            raise SchedulerError(f"lookup for request id {request.request_id!r} with a different request object "
                                 "while the first is still live (not finished); request ids must be unique")
        self.drop_pending_hit(state)
        self.stats.num_lookups += 1
        if self.tiers and any(tier.waiting(state) for tier in self.tiers):
            state.move_to(Phase.NEW)
            return None, False  # its blocks are being looked up or fetched on a lower tier

        bs = self.block_size
        state.num_gpu_hit_blocks = num_computed_tokens // bs
        if num_computed_tokens % bs:
            state.move_to(Phase.LOOKED_UP)
            return 0, False  # a partial GPU hit: the CPU run could not start on a block boundary
        if self.hybrid is not None:
            return self.hybrid.lookup(state, request, num_computed_tokens)
        hashes = request.block_hashes
        first = num_computed_tokens // bs
        last = min(len(hashes), (request.num_tokens - 1) // bs)  # keep >= 1 token to compute
        hits: list[Block] = []
        cached, reserved, suffix = self.cpu_pool.cached, self.cpu_pool.reserved, self._suffix
        for i in range(first, last):
            key = hashes[i] + suffix  # with_group_id, inlined (per block)
            block = cached.get(key)
            if block is None:
                if key in reserved:
                    if asks_again_for_store(state, self.max_store_wait_steps, self.stats):
                        return None, False
                else:
                    if self.hints:
                        self._note_misses(hashes, i, last)
                    if self.tiers and any(tier.start(state, hashes, i, last) for tier in self.tiers):
                        state.move_to(Phase.NEW)
                        return None, False  # ask again once the lower tier answered
                break
            hits.append(block)
        if hits and hits[0].ref_cnt and asks_again_for_load(state, self.max_store_wait_steps, self.stats):
            return None, False  # another request is loading its first CPU block: the GPU will have it
        if not self.policy.may_admit(state, len(hits)):
            state.num_deferrals += 1
            state.move_to(Phase.NEW)
            self.stats.num_deferred_lookups += 1
            if hits:  # the stores that save its span evict from the CPU's LRU end: not the hit it waits for
                self.cpu_pool.make_recent(hits)
            return None, False  # its allocation would evict GPU blocks not saved yet: ask again next step
        if not hits:
            state.move_to(Phase.LOOKED_UP)
            return 0, False
        self.cpu_pool.touch(hits)
        state.pending_hit = PendingHit(hits, num_computed_tokens)
        state.move_to(Phase.PENDING_HIT)
        return len(hits) * bs, True

    def drop_pending_hit(self, state: RequestState) -> None:
        """Give back the CPU references of the request's pending hit, if any."""
        if state.pending_hit is not None:
            self.cpu_pool.free(state.pending_hit.cpu_blocks)
            state.pending_hit = None

    def _note_misses(self, hashes: Sequence[bytes], first: int, last: int) -> None:
        """Blocks `first`..`last` missed on the CPU; the first miss alone adapts (ARC's target)."""
        pool, group = self.cpu_pool, self.group_id
        for i in range(first, last):
            pool.note_miss(with_group_id(hashes[i], group), adapt=i == first)
