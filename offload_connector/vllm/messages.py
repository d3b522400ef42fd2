"""What the vLLM adapter's two roles exchange through vLLM, and what it hands to vLLM's event stream.

- `OffloadConnectorMetadata`: scheduler -> workers once per step; wraps our flat `TransferMetadata`.
- `OffloadWorkerMetadata`: workers -> scheduler once per step; one msgpack-encoded `WorkerReport` per
  rank. vLLM's output aggregator concatenates ranks with `aggregate`, so the scheduler sees every rank's
  report and can count a store event complete only when all `world_size` ranks reported it.
- `to_vllm_events`: our CPU-tier changes as vLLM `BlockStored` / `BlockRemoved` events, medium "CPU".
Everything here is plain data (picklable, msgpack-able) so it crosses vLLM's process boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from offload_connector.metadata import TierReport, TransferMetadata, WorkerReport
from scheduler_side import KVEvent


@dataclass
class OffloadConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the step's one load event and one store event."""

    transfer: TransferMetadata = field(default_factory=TransferMetadata)


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: one msgpack-encoded `WorkerReport` per rank (vLLM concatenates them)."""

    reports: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, OffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate OffloadWorkerMetadata with {type(other).__name__}")
        return OffloadWorkerMetadata(reports=self.reports + other.reports)


def merge_reports(a: WorkerReport, b: WorkerReport) -> WorkerReport:
    """Two reports of the same rank (get_finished called twice before the rank's report was sent)."""
    if a.rank != b.rank:
        raise ValueError(f"merge_reports: reports of ranks {a.rank} and {b.rank} cannot merge (our bug)")
    return WorkerReport(
        rank=a.rank,
        finished_load_reqs=a.finished_load_reqs + b.finished_load_reqs,
        completed_store_events=a.completed_store_events + b.completed_store_events,
        failed_store_events=a.failed_store_events + b.failed_store_events,
        failed_load_gpu_blocks=a.failed_load_gpu_blocks + b.failed_load_gpu_blocks,
        failed_load_reqs=a.failed_load_reqs + b.failed_load_reqs,
        bytes_stored=a.bytes_stored + b.bytes_stored, bytes_loaded=a.bytes_loaded + b.bytes_loaded,
        store_seconds=a.store_seconds + b.store_seconds, load_seconds=a.load_seconds + b.load_seconds,
        expired_load_events=a.expired_load_events + b.expired_load_events,
        ended_load_events=a.ended_load_events + b.ended_load_events,
        tiers=_merge_tier_reports(a.tiers + b.tiers),
    )


def _merge_tier_reports(reports: list[TierReport]) -> list[TierReport]:
    """One report per tier, in first-seen order: lists concatenated, counters summed."""
    merged: dict[str, TierReport] = {}
    for r in reports:
        m = merged.get(r.tier)
        if m is None:
            merged[r.tier] = TierReport(tier=r.tier, completed_fetch_events=list(r.completed_fetch_events),
                                        failed_fetch_cpu_blocks=list(r.failed_fetch_cpu_blocks),
                                        written_keys=list(r.written_keys), counters=dict(r.counters))
            continue
        m.completed_fetch_events += r.completed_fetch_events
        m.failed_fetch_cpu_blocks += r.failed_fetch_cpu_blocks
        m.written_keys += r.written_keys
        for k, v in r.counters.items():
            m.counters[k] = m.counters.get(k, 0) + v
    return list(merged.values())


def to_vllm_events(events: Iterable[KVEvent], block_size: int) -> list[KVCacheEvent]:
    """Our cache keys are block hash + 4-byte group id; vLLM's events carry them split, the hash in the
    same external form as vLLM's own GPU events (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    out: list[KVCacheEvent] = []
    for event in events:
        block_hash = maybe_convert_block_hash(BlockHash(event.block_hash[:-4]))
        group_id = int.from_bytes(event.block_hash[-4:], "big")
        if event.kind == "stored":
            out.append(BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[],
                                   block_size=block_size, lora_id=None, medium=event.medium, lora_name=None,
                                   group_idx=group_id))
        else:
            out.append(BlockRemoved(block_hashes=[block_hash], medium=event.medium, group_idx=group_id))
    return out
