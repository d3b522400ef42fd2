"""`Completions`: transfers coming back (step 4 of the scheduler's step, SPEC §4): each rank's report
completes loads and stores.

- A report names its rank. A load or store completes once each of the `world_size` ranks reported it
  once; a rank repeating itself, or a late report, is logged and ignored; a rank outside
  `[0, world_size)` or a store event never issued (a negative id included) raises `SchedulerError`.
- A failed load's GPU blocks come in the same report as its request: they map through that request's
  `LoadJob` to the CPU blocks whose content is then forgotten.
- A completed store commits its CPU blocks' reservations (hit-able from now on) and frees them to the
  MRU end; a failed one aborts them and frees them to the LRU end; the GPU sources are released either way.
- A load a rank gave up on at its deadline (`transfer.load_timeout_s`, `expired_load_events`) comes as
  failed whole: its request recomputes now. Its copy may still run, so once the job completes, its GPU
  blocks (one reference of ours each) and its CPU blocks (the job's, content forgotten) are quarantined
  in `Transfers.expired` until every rank that gave up on it reports the copy over (`ended_load_events`):
  the late copy then reads a slot nobody rewrote and writes the same tokens' KV into blocks no other
  request got. A copy that never ends keeps its blocks forever, never a request waiting.

Mutates: `Transfers` (completed load jobs and store events leave it, a finished request's state with its
load, expired load events come and go), the requests' phase (LOADING -> RUNNING), CPU blocks (committed,
aborted, uncached, freed), GPU references (released, or taken for a quarantine), the transfer counters of
`SchedulerStats`, the KV event log, and the lower tiers through `LowerTier.on_report` (a report for a tier
this scheduler does not have raises `SchedulerError`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from offload_connector.metadata import TierReport, WorkerReport
from scheduler_side.errors import SchedulerError
from scheduler_side.interfaces import GpuPool
from scheduler_side.kv_events import KVEventLog
from scheduler_side.policies.store_policy import StorePolicy
from scheduler_side.pool.block_pool import BlockPool
from scheduler_side.request_state import LoadJob, Phase
from scheduler_side.stats import SchedulerStats
from scheduler_side.tiers.base import LowerTier
from scheduler_side.transfers import ExpiredLoad, Transfers

logger = logging.getLogger("scheduler_side.scheduler")



_PATH_COUNTERS = {"staged": "num_staged_jobs", "kernel": "num_kernel_jobs", "batch": "num_dma_jobs",
                  "per_segment": "num_dma_jobs", "pageable": "num_dma_jobs"}


def count_paths(stats: SchedulerStats, jobs_by_path: dict[str, int]) -> None:
    """Add a worker report's jobs to the copy-path counters (a path we do not know is not counted)."""
    for path, n in jobs_by_path.items():
        counter = _PATH_COUNTERS.get(path)
        if counter is not None:
            setattr(stats, counter, getattr(stats, counter) + n)

class Completions:
    def __init__(self, transfers: Transfers, cpu_pool: BlockPool, gpu_pool: GpuPool, policy: StorePolicy,
                 stats: SchedulerStats, kv_events: KVEventLog, tiers: dict[str, LowerTier], world_size: int) -> None:
        self.transfers, self.cpu_pool, self.gpu_pool, self.policy = transfers, cpu_pool, gpu_pool, policy
        self.stats, self.kv_events, self.tiers, self.world_size = stats, kv_events, tiers, world_size

    def update_connector_output(self, reports: WorkerReport | Iterable[WorkerReport]) -> None:
        """Apply worker reports (any number per rank; each names its rank). A load or store completes once
        every rank has reported it once; a rank repeating itself is logged and ignored. A rank outside
        `[0, world_size)` or an event id that was never issued (negative included) raises `SchedulerError`."""
        if isinstance(reports, WorkerReport):
            reports = [reports]
        stats = self.stats
        for report in reports:
            rank = report.rank
            if not 0 <= rank < self.world_size:
                raise SchedulerError(f"worker report from rank {rank}; allowed: 0..{self.world_size - 1}")
            stats.bytes_stored += report.bytes_stored
            stats.bytes_loaded += report.bytes_loaded
            stats.store_seconds += report.store_seconds
            stats.load_seconds += report.load_seconds
            if report.jobs_by_path:
                count_paths(stats, report.jobs_by_path)
            failed = set(report.failed_load_gpu_blocks)  # blocks of this report's loads that failed
            stats.num_failed_load_blocks += len(failed)
            for event_id in report.expired_load_events:  # before its requests: their jobs may complete now
                self._on_load_expired(event_id, rank)
            for req_id in report.finished_load_reqs:
                self._on_load_report(req_id, rank, failed)
            for event_id in report.ended_load_events:  # after them: a merged report may carry all three
                self._on_expired_load_ended(event_id, rank)
            for event_id in report.completed_store_events:
                self._on_store_report(event_id, False, rank)
            for event_id in report.failed_store_events:
                self._on_store_report(event_id, True, rank)
            for tier_report in report.tiers:
                self._on_tier_report(tier_report, rank)

    def _on_tier_report(self, report: TierReport, rank: int) -> None:
        tier = self.tiers.get(report.tier)
        if tier is None:
            raise SchedulerError(f"worker report from rank {rank} for the {report.tier!r} tier, which this "
                                 f"scheduler does not have (it has: {sorted(self.tiers) or 'none'})")
        keys = tier.on_report(report, rank)  # fetched blocks are now cached like stored ones
        self.kv_events.stored(keys)
        self.kv_events.stored(tier.take_written(), tier.medium)

    def _on_load_report(self, req_id: str, rank: int, failed_gpu_block_ids: set[int]) -> None:
        state = self.transfers.requests.get(req_id)
        job = state.load if state is not None else None
        if state is None or job is None or job.event_id is None:
            logger.warning("ignoring a load completion for request %s with no load in flight", req_id)
            return
        if rank in job.reported_ranks:
            logger.warning("ignoring a repeated load completion for request %s from rank %d", req_id, rank)
            return
        if failed_gpu_block_ids:  # the engine recomputes these; never offer their CPU copies again (a copy
            for gpu_id, cpu_block in zip(job.gpu_block_ids, job.cpu_blocks, strict=True):  # failing every
                if gpu_id in failed_gpu_block_ids and cpu_block.block_id not in job.lent:  # time would
                    self.cpu_pool.uncache(cpu_block)  # otherwise be retried forever; a lent slot is a store's)
        job.reported_ranks.add(rank)
        if len(job.reported_ranks) < self.world_size:
            return
        state.load = None
        expired = self.transfers.expired.get(job.event_id)
        if expired is not None:  # a copy may still write its GPU blocks and read its CPU blocks
            self._quarantine(job, expired)
        else:
            self._release_load(job)
        if state.phase is Phase.FINISHED:
            del self.transfers.requests[req_id]
        else:
            state.move_to(Phase.RUNNING)

    def _release_load(self, job: LoadJob) -> None:
        """A completed load's references go back: the GPU ones it holds, and its CPU blocks (forgotten when
        the GPU holds their content under the policy's rule: then empty room, taken first; kept, they are
        content just reused: most recently used, as the policy counts on that copy once the GPU evicts the
        block). If the request finished while loading, the engine never caches those GPU blocks (they go
        back unhashed): the CPU copies are all that is left of that content, so they are kept, in their
        place."""
        cpu_pool = self.cpu_pool
        if job.holds_gpu:  # the request finished while loading (request_finished took these references)
            self.gpu_pool.free(job.gpu_block_ids)
            cpu_pool.free(job.cpu_blocks)
            return
        if self.policy.on_load_complete(job):  # the GPU holds the content now: forget the CPU copies
            for block in job.cpu_blocks:  # those with only the load's own reference, dropped right below (a
                if block.ref_cnt == 1 and block.block_id not in job.lent:  # lent slot holds a store's now)
                    cpu_pool.uncache(block)
        cpu_pool.free(job.cpu_blocks)

    def _on_load_expired(self, event_id: int, rank: int) -> None:
        """A rank gave up on a load event at its deadline (its requests come as failed in the same report)."""
        expired = self.transfers.expired.get(event_id)
        if expired is None:
            expired = self.transfers.expired[event_id] = ExpiredLoad(set(), [])
            self.stats.num_load_timeouts += 1
        expired.ranks.add(rank)

    def _quarantine(self, job: LoadJob, expired: ExpiredLoad) -> None:
        """Keep a completed job's blocks from every other use while an expired copy of it may run: one GPU
        reference of ours on each block (the engine may free and reallocate the request's blocks), and the
        job's CPU references (their content was forgotten with the failed blocks, so nothing hits them).
        Only references move: a block with one cannot be evicted, reallocated or rewritten."""
        if not job.holds_gpu:
            self.gpu_pool.touch(job.gpu_block_ids)
            job.holds_gpu = True
        expired.jobs.append(job)
        self.stats.num_quarantined_blocks += job.num_blocks

    def _on_expired_load_ended(self, event_id: int, rank: int) -> None:
        """A rank's expired copy is over: when no rank's is left, the quarantined blocks go back."""
        expired = self.transfers.expired.get(event_id)
        if expired is None or rank not in expired.ranks:
            logger.warning("ignoring the end of load event %d from rank %d, which did not give it up", event_id,
                           rank)
            return
        expired.ranks.discard(rank)
        if expired.ranks:
            return
        del self.transfers.expired[event_id]
        for job in expired.jobs:
            self.gpu_pool.free(job.gpu_block_ids)
            self.cpu_pool.free(job.cpu_blocks, front=True)

    def _on_store_report(self, event_id: int, failed: bool, rank: int) -> None:
        event = self.transfers.store_events.get(event_id)
        if event is None:
            if not 0 <= event_id < self.transfers.next_store_event:
                raise SchedulerError(f"completion for store event {event_id}, which was never issued "
                                     f"(issued so far: 0..{self.transfers.next_store_event - 1})")
            logger.warning("ignoring a late completion of store event %d (already complete)", event_id)
            return
        if rank in event.reported_ranks:
            logger.warning("ignoring a repeated completion of store event %d from rank %d", event_id, rank)
            return
        event.failed |= failed
        event.reported_ranks.add(rank)
        if len(event.reported_ranks) < self.world_size:
            return
        del self.transfers.store_events[event_id]
        cpu_pool, failed = self.cpu_pool, event.failed
        if failed:
            cpu_pool.abort(event.cpu_blocks)
            self.stats.num_failed_store_blocks += len(event.cpu_blocks)
            cpu_pool.free(event.cpu_blocks, front=True)
        else:
            keys = cpu_pool.commit(event.cpu_blocks)  # leaves out keys another block cached meanwhile
            self.kv_events.stored(keys)
            self.stats.num_stored_blocks += len(event.cpu_blocks)
            cpu_pool.free(event.cpu_blocks)
        policy = self.policy
        places = None if failed else policy.stored_blocks_places(event_id)
        if places is None:
            self.gpu_pool.free(event.gpu_block_ids, front=policy.gpu_copy_worthless_after_store and not failed)
        else:
            for anchor, gpu_ids in places:  # (in order: a group may go behind a block an earlier one freed)
                self.gpu_pool.free(gpu_ids, front=True, after=anchor)
        policy.on_store_complete(event_id)
