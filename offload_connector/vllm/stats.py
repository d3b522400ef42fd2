"""Connector stats for vLLM's logger and Prometheus (`KVConnectorStats` / `KVConnectorPromMetrics`).

Payload (`OffloadConnectorStats.data`, plain dict so it survives vLLM's IPC):
    {"counters": {name: number}, "gauges": {name: number}}
Counters are per-interval deltas and are summed by `aggregate`; gauges are snapshots and the newest wins.
Only the scheduler role produces stats (worker byte/second figures reach it through the worker reports),
so nothing is counted twice under tensor parallelism.

`StatsTracker` turns the scheduler side's running counters (`SchedulerStats`, never reset) into deltas;
its first report comes at the engine's first step, which the scheduler role asks for at start-up, before
any request (scheduler_role.py), so the gauges (capacity, occupancy) are set from the first scrape.
`OffloadPromMetrics` exports every counter and gauge of `COUNTERS` and `GAUGES` (prefixed
`vllm:offload_connector_`) for every engine from the moment vLLM builds its Prometheus logger, at 0 until
the first report: a dashboard shows 0, never "No data", for a counter nothing has touched yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from scheduler_side.stats import FIELDS
from scheduler_side.tiers.base import LowerTier
from scheduler_side.tiers.registry import TIERS

# Every SchedulerStats field is a running counter, in `SchedulerStats.values()` order, then each registered
# lower tier's, `<tier>_<counter>` (both roles summed, `LowerTier.counter_values()` order; zero without the
# tier); the same for gauges.
COUNTERS = FIELDS + tuple(f"{name}_{c}" for name, cls in TIERS.items() for c in cls.COUNTERS)
GAUGES = ("cpu_pool_usage", "cpu_blocks_cached", "cpu_capacity_blocks", "cpu_cached_bytes", "cpu_capacity_bytes",
          "cpu_hit_rate") + tuple(f"{name}_{g}" for name, cls in TIERS.items() for g in cls.GAUGES)
PROM_PREFIX = "vllm:offload_connector_"

_DOCS = {
    "num_lookups": "CPU-tier lookups (one per request admission attempt)",
    "num_deferred_lookups": "lookups deferred a step so the GPU could save what the admission evicts (lazy)",
    "num_lookup_tokens": "prompt tokens looked up in the CPU tier (after the GPU prefix hit)",
    "num_hit_tokens": "tokens loaded from the CPU tier instead of being recomputed",
    "num_loaded_blocks": "blocks loaded CPU->GPU",
    "num_stored_blocks": "blocks stored GPU->CPU",
    "num_store_skipped_blocks": "stores skipped because the CPU pool was pinned full",
    "num_failed_store_blocks": "blocks whose store failed",
    "num_failed_load_blocks": "blocks whose load failed (recomputed by vLLM)",
    "num_reused_load_slots": "stores written into the CPU slots of blocks their step's load had just read",
    "num_load_timeouts": "loads given up on after transfer.load_timeout_s (their requests recomputed)",
    "num_quarantined_blocks": "blocks of given-up loads kept out of use until their copy ended",
    "num_load_waits": "lookups that waited a step for another request's load of their first CPU block",
    "num_store_wait_timeouts": "lookups that stopped waiting for a block still being stored and computed it",
    "num_cpu_evictions": "CPU-tier blocks evicted (LRU or ARC)",
    "num_dropped_blocks": "CPU-tier copies dropped as a superseded branch (branch_filter)",
    "num_demoted_blocks": "CPU-tier copies moved to the eviction end by a session close",
    "num_closed_sessions": "sessions closed (close_session hint or close_session call)",
    "num_bad_hints": "requests whose kv_transfer_params hints were malformed (ignored)",
    "num_staged_jobs": "copy jobs (all ranks) by the staged path: a GPU gather/scatter and DMA of whole blocks",
    "num_dma_jobs": "copy jobs (all ranks) by DMA straight between the KV cache and the host pool",
    "num_kernel_jobs": "copy jobs (all ranks) by the direct block-copy kernel (transfer.kernel_directions)",
    "bytes_stored": "bytes stored GPU->CPU (all ranks)",
    "bytes_loaded": "bytes loaded CPU->GPU (all ranks)",
    "store_seconds": "seconds spent in stores (all ranks)",
    "load_seconds": "seconds spent in loads (all ranks)",
    "cpu_pool_usage": "fraction of CPU blocks referenced by transfers or pending hits",
    "cpu_blocks_cached": "CPU blocks holding a hit-able copy",
    "cpu_capacity_blocks": "CPU blocks per rank (the tier's capacity; block 0, reserved, not counted)",
    "cpu_cached_bytes": "host memory holding hit-able copies, all ranks (the tier's occupancy)",
    "cpu_capacity_bytes": "host memory of the CPU tier's blocks, all ranks (the tier's capacity)",
    "cpu_hit_rate": "since start-up: tokens loaded from the CPU tier / tokens looked up there (0 before any lookup)",
} | {f"{name}_{key}": f"{name} tier: {text}" for name, cls in TIERS.items() for key, text in cls.DESCRIPTIONS.items()}


def tier_counter_values(tiers: dict[str, LowerTier]) -> tuple[int, ...]:
    """Every registered tier's counters in `COUNTERS` order: the configured ones' values, zeros for the rest."""
    return tuple(v for name, cls in TIERS.items()
                 for v in (tiers[name].counter_values() if name in tiers else (0,) * len(cls.COUNTERS)))


@dataclass
class OffloadConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if "counters" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    @property
    def counters(self) -> dict[str, float]:
        return self.data["counters"]

    @property
    def gauges(self) -> dict[str, float]:
        return self.data["gauges"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, OffloadConnectorStats):
            raise TypeError(f"cannot aggregate OffloadConnectorStats with {type(other).__name__}")
        for name, value in other.counters.items():
            self.counters[name] = self.counters.get(name, 0) + value
        self.gauges.update(other.gauges)
        return self

    def reduce(self) -> dict[str, int | float]:
        c = self.counters
        out: dict[str, int | float] = {name: c[name] for name in COUNTERS if c.get(name)}
        lookup_tokens = c.get("num_lookup_tokens", 0)
        if lookup_tokens:
            out["cpu_hit_rate"] = round(c.get("num_hit_tokens", 0) / lookup_tokens, 4)
        for direction, moved in (("store", "bytes_stored"), ("load", "bytes_loaded")):
            seconds = c.get(f"{direction}_seconds", 0)
            if seconds > 0:
                out[f"{direction}_GBps"] = round(c.get(moved, 0) / seconds / 1e9, 3)
        out.update(self.gauges)
        return out

    def is_empty(self) -> bool:
        # Gauges alone are news too: the start-up report (capacity, before any request) has no counter.
        return not any(self.counters.values()) and not self.gauges


class StatsTracker:
    """Deltas of the scheduler side's running counters since the previous report, every `every` steps.

    vLLM asks for stats every step and ships what it gets to its front end. The counters' sum is what
    matters (Prometheus counters, the logger's interval sums), so a report every `every` steps carries
    the same totals at a fraction of the per-step cost; `flush` reports at once (the scheduler role
    flushes on every step without a live request, so nothing is held back once a burst ends). Works on `SchedulerStats.values()` tuples:
    an unchanged interval costs one tuple comparison.
    """

    def __init__(self, every: int = 16) -> None:
        if every < 1:
            raise ValueError(f"StatsTracker(every={every}) must report at least every step")
        self.every = every
        self._steps = every - 1  # the first step reports: the gauges (capacity) are set from then
        self._last: tuple[float, ...] = (0,) * len(COUNTERS)
        self._reported = False

    def take(self, values: Callable[[], tuple[float, ...]], gauges: Callable[[], dict[str, float]],
             flush: bool = False) -> OffloadConnectorStats | None:
        """Called once per step: the deltas since the last report, on every `every`-th step or `flush`;
        None otherwise or when nothing changed."""
        self._steps += 1
        if self._steps < self.every and not flush:
            return None
        self._steps = 0
        last, values = self._last, values()
        if values == last and self._reported:
            return None
        self._last, self._reported = values, True
        counters = {name: v - p for name, v, p in zip(COUNTERS, values, last, strict=True) if v != p}
        return OffloadConnectorStats(data={"counters": counters, "gauges": gauges()})


class OffloadPromMetrics(KVConnectorPromMetrics):
    """`vllm:offload_connector_*` counters and gauges, one child per engine, all created (at 0) here."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name in COUNTERS:
            self._metrics[name] = self._counter_cls(
                name=PROM_PREFIX + name, documentation=_DOCS[name], labelnames=labelnames)
        for name in GAUGES:
            self._metrics[name] = self._gauge_cls(
                name=PROM_PREFIX + name, documentation=_DOCS[name], labelnames=labelnames,
                multiprocess_mode="mostrecent")
        self._children: dict[tuple[int, str], Any] = {}
        for engine_idx in per_engine_labelvalues:
            for name in self._metrics:
                self._child(engine_idx, name)  # exported at 0 from now on

    def _child(self, engine_idx: int, name: str) -> Any:
        child = self._children.get((engine_idx, name))
        if child is None:
            child = self._metrics[name].labels(*self.per_engine_labelvalues[engine_idx])
            self._children[(engine_idx, name)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._metrics and value > 0:
                self._child(engine_idx, name).inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self._metrics:
                self._child(engine_idx, name).set(value)
