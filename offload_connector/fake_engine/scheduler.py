"""The fake engine's scheduler: vLLM v1's waiting/running queues, token budget and the connector's
scheduler-side hooks, called in vLLM's order.

Per step, `schedule()`:
1. running requests first, in order: each gets min(remaining tokens, token budget) new tokens (chunked
   prefill, then one token per decode step); when the GPU pool is short, the last running request is
   preempted (blocks freed, `request_preempted`, back to the front of the waiting queue, KV recomputed);
2. then, unless something was preempted, waiting requests in FCFS order while budget and `max_num_seqs`
   allow: a request holding no blocks (new or preempted) does a GPU prefix-cache lookup, then
   `get_num_new_matched_tokens` (None: skip it this step); blocks are allocated, then
   `update_state_after_alloc`; an async CPU load parks it in WAITING_FOR_REMOTE_KVS (not computed this step);
   a request whose load finished resumes with its loaded blocks cached (vLLM's delayed caching) and its
   `num_computed_tokens` cut before the first failed block, if any (no new lookup: the rest is recomputed).
   When a request without blocks cannot be allocated, only requests already holding blocks (finished loads)
   are admitted behind it, and when nothing runs at all the last of those gives its blocks up: two
   deviations from vLLM that keep tiny pools from deadlocking on parked requests.
Blocks enter the GPU prefix cache when scheduled, as in vLLM's `allocate_slots`: a request admitted later in
the same step may hit blocks an earlier one computes in this forward (the model runs requests in scheduling
order, so the writes come first). `update_from_output` applies the forward (advance, append sampled tokens,
finish) and
`update_from_connector` the worker's report. Hybrid mode (`gpu.hybrid`: a sliding-window group beside the
full-attention one) uses the GPU cache's per-group calls and hands the connector one block list per group;
a hybrid load with a failed block is redone from scratch (the request's blocks freed, looked up again), as
vLLM does for models with several groups. Finishing or aborting calls `request_finished` *before* the
engine frees the blocks. Per-step cost is O(scheduled requests + their new blocks + parked loads).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from offload_connector.config import EngineConfig
from offload_connector.fake_engine.gpu_cache import GpuCache
from offload_connector.fake_engine.request import EngineRequest, RequestStatus
from offload_connector.fake_engine.stats import EngineStats, HitSample
from offload_connector.metadata import WorkerReport
from scheduler_side import OffloadScheduler, StepRequest


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (request, new tokens)
    step_requests: list[StepRequest] = field(default_factory=list)
    num_parked: int = 0  # requests waiting for a CPU load this step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class EngineScheduler:
    def __init__(self, engine: EngineConfig, gpu: GpuCache, connector: OffloadScheduler | None,
                 stats: EngineStats, on_done: Callable[[EngineRequest], None],
                 keep_samples: bool = True) -> None:
        self.block_size = engine.block_size
        self.max_num_batched_tokens = engine.max_num_batched_tokens
        self.max_num_seqs = engine.max_num_seqs
        self.gpu = gpu
        self.connector = connector
        self.stats = stats
        self.on_done = on_done
        self.keep_samples = keep_samples  # one HitSample per admitted request in stats.samples (plots)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}  # every unfinished request
        self._loading: dict[int, EngineRequest] = {}  # GPU block id -> request it is being loaded for
        self.step_index = 0

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: EngineRequest) -> bool:
        """Queue a request; False (and ABORTED) if the GPU pool could never hold it, like max_model_len."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.stats.requests += 1
        if self.gpu.hybrid:
            req.group_block_ids = [req.gpu_block_ids] + [[] for _ in self.gpu.groups[1:]]
        # Hybrid: room for a whole copy in each group, a bound that never stalls (a window group needs less).
        if -(-req.max_num_tokens // self.block_size) * len(self.gpu.groups) > self.gpu.num_usable_blocks:
            req.status = RequestStatus.ABORTED
            self.stats.rejected_requests += 1
            return False
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return True

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.ABORTED)
        return True

    def _finish(self, req: EngineRequest, status: RequestStatus) -> None:
        if self.connector is not None:
            self.connector.request_finished(req)  # before the blocks are freed, as in vLLM
        self._clear_load(req)
        self._free(req)
        req.status = status
        del self.requests[req.request_id]
        if status is RequestStatus.FINISHED:
            self.stats.finished_requests += 1
        else:
            self.stats.aborted_requests += 1
        self.on_done(req)

    def _clear_load(self, req: EngineRequest) -> None:
        for gpu_block_id in req.load_gpu_block_ids:
            self._loading.pop(gpu_block_id, None)
        req.load_gpu_block_ids = []
        req.load_done = False
        req.failed_load_gpu_blocks = set()

    def _free(self, req: EngineRequest) -> None:
        if self.gpu.hybrid:
            self.gpu.free_groups(req)
        else:
            self.gpu.free(req)

    def _allocate(self, req: EngineRequest, num_tokens: int, num_computed: int, hit_blocks: list) -> list | None:
        """New block ids (per group in hybrid mode), or None: `GpuCache.allocate` / `allocate_groups`."""
        if self.gpu.hybrid:
            return self.gpu.allocate_groups(req, num_tokens, num_computed, hit_blocks or None)
        return self.gpu.allocate(req, num_tokens, hit_blocks)

    def _cache(self, req: EngineRequest, num_computed_tokens: int) -> None:
        if self.gpu.hybrid:
            self.gpu.cache_blocks_groups(req, num_computed_tokens)
        else:
            self.gpu.cache_blocks(req, num_computed_tokens)

    def _block_lists(self, req: EngineRequest) -> list:
        """The request's blocks as the connector takes them: one list, or one per group (hybrid)."""
        return [list(ids) for ids in req.group_block_ids] if self.gpu.hybrid else list(req.gpu_block_ids)

    def _preempt(self, req: EngineRequest, requeue: bool = True) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if self.connector is not None:
            self.connector.request_preempted(req.request_id)
        if requeue:
            self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    def _break_deadlock(self) -> None:
        """Nothing runs and nothing could be admitted: free the blocks of the last waiting request that
        holds some with its load done (it recomputes), so the queue can move. vLLM would wait forever here."""
        for req in reversed(self.waiting):
            if req.gpu_block_ids and req.status is RequestStatus.WAITING:
                self._preempt(req, requeue=False)
                return

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            new_ids = self._allocate(req, req.num_computed_tokens + num_new, req.num_computed_tokens, [])
            while new_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_ids = self._allocate(req, req.num_computed_tokens + num_new, req.num_computed_tokens, [])
            if new_ids is None:
                break
            self._cache(req, req.num_computed_tokens + num_new)
            out.chunks.append((req, num_new))
            out.step_requests.append(StepRequest(req.request_id, new_ids, req.num_computed_tokens + num_new))
            budget -= num_new
            i += 1
        if not preempted:
            self._schedule_waiting(out, budget)
        if not out.chunks and not self.running and self.waiting:
            self._break_deadlock()
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[EngineRequest] = []
        blocked = False  # a request without blocks could not be allocated: admit only block holders now
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if blocked and not req.gpu_block_ids:
                skipped.append(self.waiting.popleft())
                continue
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not req.load_done:
                    skipped.append(self.waiting.popleft())
                    continue
                self._finish_load(req)
            fresh = not req.gpu_block_ids  # new or preempted: look up; else resuming after a load
            hit_blocks = []
            num_external = 0
            load_async = False
            num_computed = req.num_computed_tokens
            if fresh and self.gpu.hybrid:
                num_hit, hit_blocks = self.gpu.find_hit_groups(req)
                num_computed = num_hit * self.block_size
            elif fresh:
                hit_blocks = self.gpu.find_hit(req)
                num_computed = len(hit_blocks) * self.block_size
            if fresh:
                if self.connector is not None:
                    matched, load_async = self.connector.get_num_new_matched_tokens(req, num_computed)
                    if matched is None:
                        skipped.append(self.waiting.popleft())  # ask again next step
                        continue
                    num_external = matched
                if num_external and not load_async:
                    raise RuntimeError("the fake engine only supports async loads from the connector")
            num_new = 0 if load_async else min(req.num_tokens - num_computed - num_external, budget)
            if self._allocate(req, num_computed + num_external + num_new, num_computed + num_external,
                              hit_blocks) is None:
                # No preemption for waiting requests (vLLM); the pending hit is dropped at the next lookup.
                # Requests behind it that already hold blocks (loaded) may still run, or they could
                # deadlock the queue: they hold what the head waits for.
                if fresh and any(r.gpu_block_ids for r in self.waiting):
                    blocked = True
                    skipped.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self._block_lists(req), num_external)
            if req.is_first_admission and fresh:
                req.num_gpu_hit_tokens = num_computed
                if self.gpu.hybrid:
                    for g, blocks in enumerate(hit_blocks):
                        self.stats.group_gpu_hit_blocks[g] += sum(1 for b in blocks if b is not None)
            req.num_computed_tokens = num_computed
            if load_async:
                self._park(req, num_external)
                skipped.append(req)
                continue
            self._cache(req, num_computed + num_new)
            self._start_running(req)
            out.chunks.append((req, num_new))
            out.step_requests.append(
                StepRequest(req.request_id, self._block_lists(req), num_computed + num_new, True))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        out.num_parked = sum(1 for r in skipped if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS)

    def _park(self, req: EngineRequest, num_external: int) -> None:
        """The request waits for its CPU load (blocks after its GPU hit) before it can run."""
        first = req.num_computed_tokens // self.block_size
        last = first + num_external // self.block_size
        req.load_num_tokens = num_external
        if self.gpu.hybrid:  # every group's blocks vLLM allocated in the range (not the null block)
            per_group = [[i for i in ids[first:last] if i] for ids in req.group_block_ids]
            for g, ids in enumerate(per_group):
                self.stats.group_loaded_blocks[g] += len(ids)
            req.load_gpu_block_ids = [i for ids in per_group for i in ids]
        else:
            req.load_gpu_block_ids = req.gpu_block_ids[first:last]
        for gpu_block_id in req.load_gpu_block_ids:
            self._loading[gpu_block_id] = req
        req.load_done = False
        req.load_issue_step = self.step_index
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.stats.num_loads += 1

    def _finish_load(self, req: EngineRequest) -> None:
        """The load finished: count loaded tokens up to the first failed block, cache them, resume."""
        if self.gpu.hybrid and req.failed_load_gpu_blocks:  # vLLM with several groups: redo the request
            self.stats.failed_load_blocks += len(req.failed_load_gpu_blocks)
            self._clear_load(req)
            self._free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            return
        loaded = len(req.load_gpu_block_ids)
        for k, gpu_block_id in enumerate(req.load_gpu_block_ids):
            if gpu_block_id in req.failed_load_gpu_blocks:
                loaded = k
                self.stats.failed_load_blocks += len(req.load_gpu_block_ids) - k
                break
        num_loaded = req.load_num_tokens if self.gpu.hybrid else loaded * self.block_size
        req.num_computed_tokens += num_loaded
        if req.is_first_admission:
            req.num_cpu_hit_tokens = num_loaded
        self._cache(req, req.num_computed_tokens)
        self._clear_load(req)
        req.status = RequestStatus.WAITING

    def _start_running(self, req: EngineRequest) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.is_first_admission:
            req.is_first_admission = False
            s = self.stats
            s.prompt_tokens += req.num_prompt_tokens
            s.gpu_hit_tokens += req.num_gpu_hit_tokens
            s.cpu_hit_tokens += req.num_cpu_hit_tokens
            if self.keep_samples:
                s.samples.append(HitSample(self.step_index, req.num_prompt_tokens, req.num_gpu_hit_tokens,
                                           req.num_cpu_hit_tokens))

    # ------------------------------------------------------------------ results of the step
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[EngineRequest]:
        """Apply the forward: advance, cache computed full blocks, append sampled tokens, finish."""
        finished = []
        for req, num_new in out.chunks:
            start = req.num_computed_tokens
            req.num_computed_tokens = start + num_new
            self.stats.computed_tokens += num_new
            if start < req.num_ever_computed:
                self.stats.recomputed_tokens += min(req.num_ever_computed, start + num_new) - start
            req.num_ever_computed = max(req.num_ever_computed, req.num_computed_tokens)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output_token(token)
            self.stats.output_tokens += 1
            if req.is_finished:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED)
                finished.append(req)
        return finished

    def update_from_connector(self, report: WorkerReport) -> None:
        """Record the worker's load completions and failed load blocks (the connector already saw them)."""
        for gpu_block_id in report.failed_load_gpu_blocks:
            req = self._loading.get(gpu_block_id)
            if req is not None:
                req.failed_load_gpu_blocks.add(gpu_block_id)
        for req_id in report.finished_load_reqs:
            req = self.requests.get(req_id)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not req.load_done:
                req.load_done = True
                waited = self.step_index - req.load_issue_step + 1  # the issuing step included
                self.stats.load_wait_steps += waited
                self.stats.max_load_wait_steps = max(self.stats.max_load_wait_steps, waited)
