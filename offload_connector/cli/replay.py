"""Replaying a Mooncake trace through the fake engine with the connector: the `replay` job's logic.

`replay_config(...)` builds the `OffloadConfig` (YAML or embedded default, then command-line overrides, all
validated by `load_config`). `run_replay(...)` feeds the trace's requests in order, keeping at most
`2 * max_num_seqs` of them queued (a request is built only when it is about to be admitted, so memory stays
bounded on full-size traces; the engine keeps no finished request's output tokens), steps the engine until
everything finished, drains the transfers and checks for leaks. An `IntegrityError` stops the replay; the
result then carries `integrity_errors > 0` and the message. Trace timestamps give the order, and the time
of delayed session closes.

Sessions (a trace's `session` field): each request carries its session as a hint (`kv_transfer_params`).
With `session_close` (default), a session is closed after its last request: by a `close_session` hint on
that request, or with `session_close_delay` > 0 by a `close_session` call when the replay first feeds a
request at least that many seconds of trace time after the session's last request.
The replay runs torch on one intra-op thread (restored afterwards): the fake engine's tensor operations are
small, and on a shared 2-core machine extra threads made replays up to 8 times slower, never faster.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from offload_connector.cli.trace import TraceRequest, output_length, prompt_tokens
from offload_connector.config import (
    OffloadConfig,
    config_source_dict,
    load_config,
    merge_configs,
)
from offload_connector.fake_engine import FakeEngine, IntegrityError
from offload_connector.fake_engine.stats import EngineStats
from scheduler_side.tiers.disk.tier import DiskTier


@dataclass(slots=True)
class ReplayResult:
    stats: EngineStats
    wall_seconds: float
    trace: str
    scaled: bool
    config: OffloadConfig
    num_cpu_blocks: int
    error: str | None = None
    connector: dict[str, float] = field(default_factory=dict)  # the scheduler side's counters (SchedulerStats)
    sizes_from: dict[str, str] = field(default_factory=dict)  # "gpu_blocks"/"cpu_blocks" -> where it was set
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # each configured lower tier's counters

    def to_dict(self) -> dict[str, Any]:
        eng = self.config.engine
        out: dict[str, Any] = dict(self.stats.to_dict())
        out.update(
            wall_seconds=round(self.wall_seconds, 3),
            trace=self.trace,
            scaled=self.scaled,
            store_policy=self.config.store_policy,
            eviction=self.config.eviction,
            max_num_seqs=eng.max_num_seqs,
            gpu_blocks=eng.num_gpu_blocks,
            cpu_blocks=self.num_cpu_blocks,
            block_size=eng.block_size,
            sliding_window=eng.sliding_window,
            error=self.error,
        )
        out["connector"] = dict(self.connector)
        # tokens read from the disk tier into the CPU tier for requests that missed there (0 without it)
        out["disk_hit_tokens"] = self.tiers.get("disk", {}).get("lookup_hit_blocks", 0) * eng.block_size
        out["sizes_from"] = dict(self.sizes_from)
        out.update({name: dict(counters) for name, counters in self.tiers.items()})  # e.g. "remote": {...}
        return out


def replay_config(config: str | Path | Mapping[str, Any] | None = None, *, gpu_blocks: int | None = None,
                  cpu_blocks: int | None = None, store_policy: str | None = None, eviction: str | None = None,
                  max_num_seqs: int | None = None, branch_filter: bool | None = None,
                  hybrid_window: int | None = None, disk_dir: str | None = None,
                  disk_bytes: str | None = None) -> OffloadConfig:
    """The replay's config: the file (or mapping, or the embedded default) with the overrides applied.
    `hybrid_window` (tokens; 0: `HYBRID_WINDOW_BLOCKS` blocks) turns on the fake engine's hybrid mode
    (`engine.sliding_window`)."""
    data = config_source_dict(config)
    override: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    if gpu_blocks is not None:
        engine["num_gpu_blocks"] = gpu_blocks
    if max_num_seqs is not None:
        engine["max_num_seqs"] = max_num_seqs
    if engine:
        override["engine"] = engine
    if eviction is not None:
        override["eviction"] = eviction
    if cpu_blocks is not None:
        override["num_cpu_blocks"] = cpu_blocks
    if store_policy is not None:
        override["store_policy"] = store_policy
    if branch_filter is not None:
        override["branch_filter"] = branch_filter
    if disk_dir is not None:
        override["disk"] = {"path": disk_dir} | ({"bytes": disk_bytes} if disk_bytes is not None else {})
    config = load_config(merge_configs(data, override))
    if hybrid_window is None:
        return config
    engine["sliding_window"] = hybrid_window or HYBRID_WINDOW_BLOCKS * config.engine.block_size
    override["engine"] = engine
    return load_config(merge_configs(data, override))


ProgressFn = Callable[[int, int, EngineStats], None]
HYBRID_WINDOW_BLOCKS = 4  # `replay --hybrid` without a window: a sliding window of 4 blocks


def run_replay(config: OffloadConfig, requests: list[TraceRequest], *, scaled: bool, trace_name: str = "",
               progress: ProgressFn | None = None, session_close: bool = True,
               session_close_delay: float = 0.0, check_each_step: bool = False) -> ReplayResult:
    """Replay `requests` in order through a FakeEngine with the connector; never raises IntegrityError.
    `session_close`/`session_close_delay` (seconds of trace time): see the module docstring.
    `check_each_step`: the engine checks the connector's invariants after every step (`FakeEngine`); a
    broken one raises `SchedulerError`, or ends the replay with an error like a wrong K/V."""
    if session_close_delay < 0:
        raise ValueError(f"session_close_delay: got {session_close_delay}; allowed: seconds >= 0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        closes = SessionCloses(requests, session_close, session_close_delay)
        return _run_replay(config, requests, scaled, trace_name, progress, closes, check_each_step)
    finally:
        torch.set_num_threads(threads)


class SessionCloses:
    """When the replay closes each session: the hints of request `i`, and the sessions due at a time."""

    def __init__(self, requests: list[TraceRequest], enabled: bool, delay: float) -> None:
        last: dict[str, int] = {}
        for i, req in enumerate(requests):
            if req.session is not None:
                last[req.session] = i
        self.enabled, self.delay = enabled, delay
        self.last_index = {i: s for s, i in last.items()}  # index of a session's last request -> session
        # Delayed: (due time in ms, session), in order of due time (last requests come in trace order).
        self.due: deque[tuple[float, str]] = deque(sorted(
            (requests[i].timestamp + 1000 * delay, s) for s, i in last.items())) if enabled and delay else deque()

    def hints(self, index: int, req: TraceRequest) -> dict | None:
        if req.session is None:
            return None
        close = self.enabled and not self.delay and self.last_index.get(index) == req.session
        return {"session": req.session, "close_session": True} if close else {"session": req.session}

    def take_due(self, now: float | None) -> list[str]:
        """Sessions whose delayed close is due at trace time `now` (ms; None: the end, all of them)."""
        out = []
        while self.due and (now is None or self.due[0][0] <= now):
            out.append(self.due.popleft()[1])
        return out


def _run_replay(config: OffloadConfig, requests: list[TraceRequest], scaled: bool, trace_name: str,
                progress: ProgressFn | None, closes: SessionCloses, check_each_step: bool) -> ReplayResult:
    eng = config.engine
    start = time.perf_counter()
    error = None
    # sync_stores: deterministic, stores land before the next step; outputs are not kept (only counted)
    with FakeEngine(config, sync_stores=True, keep_outputs=False, check_each_step=check_each_step) as engine:
        disk = engine.connector.tiers.get("disk") if engine.connector is not None else None
        if isinstance(disk, DiskTier):  # a warm run: the records found are indexed before request 1
            disk.wait_scan()
        max_queued = 2 * eng.max_num_seqs
        next_index = 0
        total = len(requests)
        try:
            while next_index < total or engine.has_unfinished():
                while next_index < total and len(engine.scheduler.waiting) < max_queued:
                    req = requests[next_index]
                    for session in closes.take_due(req.timestamp):
                        if engine.connector is not None:
                            engine.connector.close_session(session)
                    engine.add_request(f"req-{next_index}", prompt_tokens(req, eng.block_size, scaled),
                                       output_length(req, eng.block_size, scaled),
                                       closes.hints(next_index, req))
                    next_index += 1
                engine.step()
                if progress is not None:
                    done = engine.stats.finished_requests + engine.stats.aborted_requests
                    progress(done + engine.stats.rejected_requests, total, engine.stats)
            engine.check()
        except IntegrityError as exc:
            error = str(exc)
        num_cpu_blocks = engine.worker.num_cpu_blocks if engine.worker is not None else 0
        stats = engine.stats
        connector = engine.connector.stats.snapshot() if engine.connector is not None else {}
        tiers = {name: dict(zip(tier.COUNTERS, tier.counter_values(), strict=True))
                 for name, tier in (engine.connector.tiers.items() if engine.connector is not None else ())}
        if disk is not None:  # its capacity and occupancy too
            tiers["disk"] |= disk.gauges()
    return ReplayResult(stats, time.perf_counter() - start, trace_name, scaled, config, num_cpu_blocks, error,
                        connector, tiers=tiers)


class ProgressBar:
    """A progress line on stderr for long runs: redrawn in place on a terminal, a line every 10 s otherwise."""

    def __init__(self, stream: Any = None, delay: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.delay = delay
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int, stats: EngineStats) -> None:
        now = time.perf_counter()
        interval = 0.2 if self.tty else 10.0
        if now - self.start < self.delay or (now - self.last < interval and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        hits = stats.ratio(stats.gpu_hit_tokens + stats.cpu_hit_tokens)
        line = (f"replay [{bar}] {done}/{total} requests  step {stats.steps}  hit {hits:.1%}  "
                f"{now - self.start:.0f}s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn and self.tty:
            self.stream.write("\n")
            self.stream.flush()
