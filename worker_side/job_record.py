"""`JobRecord`: what the worker keeps of a copy job in flight, and which requests a failed load names.

A record lives from `OffloadWorker._submit` until the backend reports the job (or, for a load past the
deadline, until its late copy ends: `expired`). `failed_requests` maps a load's failed GPU blocks back to the
requests that own them, so only those recompute; `expire_loads` reports the loads past the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from offload_connector.metadata import WorkerReport
from worker_side.backends.base import JobKind
from worker_side.tiers.base import TierIO


@dataclass(slots=True)
class JobRecord:
    kind: JobKind
    event_id: int
    num_blocks: int
    submitted_at: float
    load_reqs: tuple[str, ...] = ()  # the requests a load job resumes; empty for stores
    load_req_num_blocks: tuple[int, ...] = ()  # blocks of each of load_reqs, in order (may be empty)
    load_dst: np.ndarray | None = None  # a load's GPU block ids (to name the requests of failed blocks)
    tier_writes: tuple[tuple[TierIO, ...], np.ndarray, list[bytes]] | None = None  # a store's: tiers, CPU blocks, keys
    expired: bool = False  # a load reported as failed after the deadline; its copy may still run


def failed_requests(rec: JobRecord, failed_dst_ids: Sequence[int]) -> list[str]:
    """The requests of a load job that own a failed GPU block: by `load_req_num_blocks` (each request's
    blocks follow the previous one's), or all of them when the metadata did not say. O(job blocks)."""
    counts = rec.load_req_num_blocks
    if rec.load_dst is None or len(counts) != len(rec.load_reqs) or sum(counts) != len(rec.load_dst):
        return list(rec.load_reqs)
    failed = set(int(i) for i in failed_dst_ids)
    out, start = [], 0
    for req_id, count in zip(rec.load_reqs, counts, strict=True):
        if any(int(i) in failed for i in rec.load_dst[start:start + count]):
            out.append(req_id)
        start += count
    return out


def expire_loads(records: Iterable[JobRecord], timeout_s: float, report: WorkerReport) -> int:
    """Report each load job older than `timeout_s` as failed whole, once (its requests finished, every GPU
    block failed, its event expired); mark it expired. Returns how many expired. O(jobs in flight)."""
    waiting = [rec for rec in records if rec.kind == "load" and not rec.expired]
    if not waiting:
        return 0  # (no clock reading)
    cutoff, expired = time.perf_counter() - timeout_s, 0
    for rec in waiting:
        if rec.submitted_at > cutoff:
            continue
        rec.expired = True
        expired += 1
        report.expired_load_events.append(rec.event_id)
        report.finished_load_reqs.extend(rec.load_reqs)
        report.failed_load_reqs.extend(rec.load_reqs)
        if rec.load_dst is not None:
            report.failed_load_gpu_blocks.extend(int(i) for i in rec.load_dst)
    return expired
