"""The lookup half of `OffloadScheduler` (connector.py): a request's CPU hit after the engine's GPU hit.

A mixin, kept apart because it is one idea: walk the request's block keys after the GPU hit in the CPU
prefix cache, stop at the first miss, and pin the run found (a pending hit) until allocation consumes it.
A block of the run still being stored, the remote tier still answering, or the store policy deferring the
request makes the engine ask again next step (None). Per call: O(blocks walked), no allocation but the
pending hit's list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from offload_connector.config import OffloadConfig
from offload_connector.hashing import group_suffix, with_group_id
from scheduler_side.errors import SchedulerError
from scheduler_side.interfaces import RequestLike
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.pool.free_queue import Block
from scheduler_side.request_state import PendingHit, Phase, RequestState
from scheduler_side.stats import SchedulerStats
from scheduler_side.tiers.remote.tier import RemoteTier


class Lookups:
    """The lookup half of `OffloadScheduler` (which defines these attributes)."""

    config: OffloadConfig
    block_size: int
    group_id: int
    cpu_pool: BlockPool
    policy: StorePolicy
    stats: SchedulerStats
    remote: RemoteTier | None
    _arc: bool
    _hybrid: bool  # several KV-cache groups (hybrid.py)
    _requests: dict[str, RequestState]

    _drop_pending_hit: Callable[[RequestState], None]  # completions.py (an annotation: MRO keeps the method)
    _lookup_groups: Callable[[RequestState, RequestLike, int], tuple[int | None, bool]]  # hybrid.py

    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        """CPU hit after the engine's GPU hit: (tokens to load, load is async), or (None, False) to retry.

        The hit is the longest run of consecutive cached blocks starting at the GPU hit, capped so that at
        least one prompt token is still computed. Its CPU blocks are pinned until allocation. A block of
        the run still being stored makes the request ask again next step (None), at most
        `max_store_wait_steps` times per request; then the hit ends before that block. The store policy
        may defer the request a step (None) so that the GPU saves what its allocation would evict.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestState(request)
        elif state.phase is Phase.FINISHED:  # a new request reuses the id of a finished one still loading
            return None, False  # ask again once that load is done and its state is gone
        elif state.phase is Phase.LOADING:
            raise SchedulerError(f"lookup for request {request.request_id} while its load is in flight")
        elif state.request is not request:
            # Adopting it would store the new request's blocks under the old prompt's hashes: wrong KV later.
            raise SchedulerError(f"lookup for request id {request.request_id!r} with a different request object "
                                 "while the first is still live (not finished); request ids must be unique")
        self._drop_pending_hit(state)
        self.stats.num_lookups += 1
        if self.remote is not None and self.remote.waiting(state):
            state.move_to(Phase.NEW)
            return None, False  # its blocks are being looked up or fetched on the remote tier

        bs = self.block_size
        state.num_gpu_hit_blocks = num_computed_tokens // bs
        if num_computed_tokens % bs:
            state.move_to(Phase.LOOKED_UP)
            return 0, False  # a partial GPU hit: the CPU run could not start on a block boundary
        if self._hybrid:
            return self._lookup_groups(state, request, num_computed_tokens)  # hybrid.py
        hashes = request.block_hashes
        first = num_computed_tokens // bs
        last = min(len(hashes), (request.num_tokens - 1) // bs)  # keep >= 1 token to compute
        hits: list[Block] = []
        cached, reserved, suffix = self.cpu_pool.cached, self.cpu_pool.reserved, group_suffix(self.group_id)
        for i in range(first, last):
            key = hashes[i] + suffix  # with_group_id, inlined (per block)
            block = cached.get(key)
            if block is None:
                if key in reserved:
                    if self._asks_again_for_store(state):
                        return None, False
                else:
                    if self._arc:
                        self._note_misses(hashes, i, last)
                    if self.remote is not None and self.remote.start(state, hashes, i, last):
                        state.move_to(Phase.NEW)
                        return None, False  # ask again once the remote tier answered
                break
            hits.append(block)
        if hits and hits[0].ref_cnt and self._asks_again_for_load(state):
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

    def _asks_again_for_store(self, state: RequestState) -> bool:
        """A block of the hit is being stored: its store completes soon, so the request asks again next
        step (True), at most `max_store_wait_steps` times; after that the hit ends there (False)."""
        if state.num_store_waits < self.config.max_store_wait_steps:
            state.num_store_waits += 1
            state.move_to(Phase.NEW)
            return True
        self.stats.num_store_wait_timeouts += 1
        return False

    def _asks_again_for_load(self, state: RequestState) -> bool:
        """The hit's first block is held: another request's load reads it (or will, this step: a pending
        hit). Once that load is done the engine's GPU prefix cache has it, so ask again next step (True)
        rather than load the same blocks twice; at most `max_store_wait_steps` times per request."""
        if state.num_load_waits < self.config.max_store_wait_steps:
            state.num_load_waits += 1
            state.move_to(Phase.NEW)
            self.stats.num_load_waits += 1
            return True
        return False

    def _note_misses(self, hashes: Sequence[bytes], first: int, last: int) -> None:
        """ARC: blocks `first`..`last` missed on the CPU; the first miss alone adapts the target."""
        pool, group = self.cpu_pool, self.group_id
        for i in range(first, last):
            pool.note_miss(with_group_id(hashes[i], group), adapt=i == first)

    def _note_reuse(self, state: RequestState, num_blocks: int) -> None:
        """ARC: the request's first `num_blocks` blocks were hits (GPU or CPU): their content is reused."""
        pool, group, hashes = self.cpu_pool, self.group_id, state.request.block_hashes
        for i in range(min(num_blocks, len(hashes))):
            pool.note_reuse(with_group_id(hashes[i], group))
