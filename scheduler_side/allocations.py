"""`Allocations`: the engine allocated a request's blocks (step 2 of the scheduler's step, SPEC §4): the
request is admitted, and its pending hit becomes a load job that the next metadata sends (step 3's loads).

`update_state_after_alloc` checks the engine's claim against the pending hit first and raises
`SchedulerError` changing nothing when they cannot match; then the request's GPU blocks and store cursor
are set, the store policy hears of the allocation (`on_allocated`, `on_blocks_allocated`), the admission
filter of the request's keys, the eviction policy (if it wants hints) of the reused blocks, and the
pinned CPU blocks the engine took move to a `LoadJob`, the rest are freed. `send_loads` gives every job
created since the last metadata one load event id. O(blocks of the request) per call.

Mutates: the request's `RequestState` (phase, blocks, load job, store cursor), `Transfers.requests` (an
allocation with no lookup before creates the state) and `Transfers.loads_to_send`, the CPU references of
the pending hit, the CPU copies the policy asks to discard, `SchedulerStats` (lookup and hit tokens,
loaded blocks), and through admissions.py the admission filter.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_connector.hashing import with_group_id
from offload_connector.metadata import TransferMetadata
from scheduler_side.admissions import Admissions
from scheduler_side.errors import SchedulerError
from scheduler_side.hybrid import HybridGroups
from scheduler_side.interfaces import RequestLike
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import LoadJob, PendingHit, Phase, RequestState
from scheduler_side.stats import SchedulerStats
from scheduler_side.transfers import Transfers


class Allocations:
    def __init__(self, transfers: Transfers, cpu_pool: BlockPool, policy: StorePolicy, stats: SchedulerStats,
                 admissions: Admissions, hybrid: HybridGroups | None, block_size: int, group_id: int) -> None:
        self.transfers, self.cpu_pool, self.policy, self.stats = transfers, cpu_pool, policy, stats
        self.admissions, self.hybrid = admissions, hybrid
        self.block_size, self.group_id = block_size, group_id
        self.hints = cpu_pool.free_queue.wants_hints  # reuse hints cost a loop per admission; LRU needs none

    def update_state_after_alloc(
        self, request: RequestLike, gpu_block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Map the pending hit onto the newly allocated GPU blocks and start tracking the request.

        `gpu_block_ids` are all of the request's blocks (GPU-hit ones first), as vLLM passes them; with
        several KV-cache groups, one such list per group. Stores start after the GPU-hit and loaded blocks
        (eager stores what the forward computes). A call that does not match the pending hit raises
        `SchedulerError` and changes nothing.
        """
        group_block_ids, hybrid = None, self.hybrid
        if hybrid is not None:
            group_block_ids, gpu_block_ids = gpu_block_ids, gpu_block_ids[0] if gpu_block_ids else []
        requests = self.transfers.requests
        state = requests.get(request.request_id)
        if state is not None and state.request is not request:
            raise SchedulerError(f"update_state_after_alloc for request id {request.request_id!r} with a different "
                                 "request object than the live one; request ids must be unique")
        if state is not None and (state.phase is Phase.LOADING or state.phase is Phase.FINISHED):
            raise SchedulerError(f"update_state_after_alloc for request {request.request_id} while "
                                 f"{state.phase.value}")
        hit = state.pending_hit if state is not None else None
        n = self._check_external_tokens(request, hit, gpu_block_ids, num_external_tokens)
        job = hybrid.load(state, hit, group_block_ids, n) if hybrid is not None and n else None
        if state is None:
            state = requests[request.request_id] = RequestState(request)
        if hybrid is not None:
            hybrid.set_blocks(state, group_block_ids)
        else:
            state.gpu_block_ids = list(gpu_block_ids)
        state.num_computed_tokens = 0
        if state.phase is Phase.LOOKED_UP or state.phase is Phase.PENDING_HIT:  # admitted: the GPU hit is now its
            state.num_store_checked_blocks = state.num_gpu_hit_blocks + n
            self.stats.num_lookup_tokens += max(0, request.num_tokens - state.num_gpu_hit_blocks * self.block_size)
            if self.hints:
                self._note_reuse(state, state.num_gpu_hit_blocks + n)
            self.admissions.admit_keys(state, extends=True, first_new=state.num_gpu_hit_blocks + n)
            cpu_pool = self.cpu_pool
            # (most were forgotten at an earlier hit: the lookups in C)
            for block in filter(None, map(cpu_pool.cached.get, self.policy.on_allocated(state, state.num_gpu_hit_blocks))):
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
        self.transfers.loads_to_send.append(state)

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

    def _note_reuse(self, state: RequestState, num_blocks: int) -> None:
        """The request's first `num_blocks` blocks were hits (GPU or CPU): their content is reused."""
        pool, group, hashes = self.cpu_pool, self.group_id, state.request.block_hashes
        for i in range(min(num_blocks, len(hashes))):
            pool.note_reuse(with_group_id(hashes[i], group))

    def send_loads(self, meta: TransferMetadata) -> list[LoadJob]:
        """Put every load job created since the last metadata into `meta` as one load event; returns them
        (this step's stores may take their slots, stores.py)."""
        loaded: list[LoadJob] = []
        loads_to_send = self.transfers.loads_to_send
        if not loads_to_send:
            return loaded
        meta.load_event = self.transfers.issue_load_event()
        for state in loads_to_send:
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
        loads_to_send.clear()
        return loaded
