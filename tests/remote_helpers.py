"""Workloads and checks shared by the remote-tier tests on fake engines."""

from __future__ import annotations

import random

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import Workload, run_workload, small_config


def prefixes(seed: int, n: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(length)] for _ in range(n)]


def one_per_prefix(tag: str, shared: list[list[int]], seed: int) -> Workload:
    """One request per prefix with its own suffix: no request of this workload hits another's blocks."""
    rng = random.Random(seed)
    return Workload([(f"{tag}{i}", p + [rng.randrange(1000) for _ in range(5)], 4) for i, p in enumerate(shared)])


def remote_config(url: str, num_cpu_blocks: int = 48, **remote):
    return small_config(num_gpu_blocks=32, num_cpu_blocks=num_cpu_blocks,
                        remote={"url": url, "timeout_ms": 5000, "namespace": "t", **remote})


def reference_outputs(wl: Workload) -> dict[str, list[int]]:
    with FakeEngine(small_config(num_gpu_blocks=32), connector=False) as engine:
        run_workload(engine, wl)
        return engine.outputs


def clean(engine: FakeEngine) -> None:
    """Every block read was verified right, nothing leaked, and something was verified at all."""
    assert engine.stats.integrity_errors == 0 and engine.stats.leaked_blocks == 0
    assert engine.stats.verified_tokens > 0


def worker_counter(engine: FakeEngine, name: str) -> int:
    return sum(getattr(w.tier_ios["remote"].counters, name) for w in engine.workers)
