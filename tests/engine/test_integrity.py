"""Randomized integrity runs: small pools (eviction, CPU hits, preemption), random aborts, delayed and failing
transfers injected through worker_side.testing.faults. Every run must end with zero integrity errors (the fake
model checks every block read before each step), zero leaked blocks, every request finished or aborted,
and outputs identical to a run without the connector. The soak (OFFLOAD_SOAK=1) runs many more seeds.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import (
    ABORT_STATES,
    Workload,
    random_workload,
    run_aborting_in_states,
    run_workload,
    small_config,
)
from worker_side import CpuBackend
from worker_side.testing.faults import FaultyBackend

_reference_cache: dict[tuple, dict[str, list[int]]] = {}


def reference_outputs(wl: Workload, key: tuple) -> dict[str, list[int]]:
    """Outputs of the same requests without the connector (and without aborts)."""
    if key not in _reference_cache:
        with FakeEngine(small_config(num_gpu_blocks=64), connector=False) as engine:
            run_workload(engine, Workload(wl.requests))
            _reference_cache[key] = dict(engine.outputs)
    return _reference_cache[key]


def faulty_backend(seed: int, fail_rate: float, max_delay_s: float) -> FaultyBackend:
    rng = random.Random(seed)
    return FaultyBackend(CpuBackend(), fail_rate=fail_rate, seed=seed,
                         delay_s=lambda job: rng.choice([0.0, 0.0, max_delay_s / 2, max_delay_s]))


def check_run(seed: int, store_policy: str, num_gpu_blocks: int, num_cpu_blocks: int, fail_rate: float,
              wait_for_loads: bool, num_requests: int = 30, abort_fraction: float = 0.15,
              max_delay_s: float = 0.002, eviction: str = "lru") -> FakeEngine:
    wl = random_workload(seed, num_requests=num_requests, abort_fraction=abort_fraction)
    cfg = small_config(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, store_policy=store_policy,
                       eviction=eviction)
    with FakeEngine(cfg, backend=faulty_backend(seed, fail_rate, max_delay_s),
                    wait_for_loads=wait_for_loads) as engine:
        aborted = run_workload(engine, wl)
        s = engine.stats
        assert s.integrity_errors == 0
        assert s.leaked_blocks == 0, f"leaked {s.leaked_gpu_blocks} GPU + {s.leaked_cpu_blocks} CPU blocks"
        assert s.finished_requests + s.aborted_requests == len(wl.requests)
        assert set(engine.outputs) | aborted == {r[0] for r in wl.requests}
        ref = reference_outputs(wl, (seed, num_requests))
        for request_id, tokens in engine.outputs.items():
            assert tokens == ref[request_id], f"request {request_id} diverged from the run without connector"
    return engine


@pytest.mark.parametrize("store_policy", ["eager", "lazy"])
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_with_faults(seed: int, store_policy: str) -> None:
    engine = check_run(seed, store_policy, num_gpu_blocks=20 + seed % 3 * 4, num_cpu_blocks=12 + seed * 3,
                       fail_rate=0.1 if seed % 2 else 0.0, wait_for_loads=seed % 3 != 0,
                       eviction="arc" if seed >= 3 else "lru")
    assert engine.stats.steps > 0


def test_random_runs_exercise_every_path() -> None:
    """Across a few seeds the suite really sees eviction, CPU hits, preemption, aborts and failures."""
    totals = dict(cpu_hits=0, preemptions=0, aborts=0, failed_loads=0, evictions=0)
    for seed in range(4):
        e = check_run(seed, "eager", num_gpu_blocks=16, num_cpu_blocks=24, fail_rate=0.3, wait_for_loads=False,
                      num_requests=40)
        totals["cpu_hits"] += e.stats.cpu_hit_tokens
        totals["preemptions"] += e.stats.num_preemptions
        totals["aborts"] += e.stats.aborted_requests
        totals["failed_loads"] += e.stats.failed_load_blocks
        assert e.connector is not None
        totals["evictions"] += e.connector.stats.num_cpu_evictions + e.gpu.pool.num_evictions
    assert all(v > 0 for v in totals.values()), totals


def test_aborts_in_every_transfer_state() -> None:
    """Requests aborted while holding a pending CPU hit, while loading, while their blocks are being
    stored, and while preempted (not re-admitted): each state is hit across the seeds, every run clean."""
    totals = dict.fromkeys(ABORT_STATES, 0)
    for seed in range(8):
        wl = random_workload(seed, num_requests=30)
        cfg = small_config(num_gpu_blocks=16 + seed % 3 * 4, num_cpu_blocks=24,
                           store_policy="lazy" if seed % 2 else "eager")
        with FakeEngine(cfg, backend=faulty_backend(seed, 0.0, 0.004), wait_for_loads=False) as engine:
            aborted, hits = run_aborting_in_states(engine, wl, seed)
        s = engine.stats
        assert s.integrity_errors == 0 and s.leaked_blocks == 0, (seed, s.integrity_errors, s.leaked_blocks)
        assert len(engine.outputs) + len(aborted) + s.rejected_requests == len(wl.requests)
        ref = reference_outputs(wl, ("aborts by state", seed))  # this workload's own cache entry
        assert all(tokens == ref[rid] for rid, tokens in engine.outputs.items()), seed
        for state, n in hits.items():
            totals[state] += n
    assert all(n > 0 for n in totals.values()), totals


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), gpu=st.integers(16, 40), cpu=st.integers(3, 40),
       policy=st.sampled_from(["eager", "lazy"]), fail_rate=st.sampled_from([0.0, 0.05, 0.3]),
       wait=st.booleans(), eviction=st.sampled_from(["lru", "arc"]))
def test_property_any_pool_sizes_and_faults(seed: int, gpu: int, cpu: int, policy: str, fail_rate: float,
                                            wait: bool, eviction: str) -> None:
    check_run(seed, policy, gpu, cpu, fail_rate, wait, num_requests=20, max_delay_s=0.001, eviction=eviction)


@pytest.mark.soak
@pytest.mark.skipif(os.environ.get("OFFLOAD_SOAK") != "1", reason="long soak: set OFFLOAD_SOAK=1")
@pytest.mark.parametrize("store_policy", ["eager", "lazy"])
def test_soak(store_policy: str) -> None:
    for seed in range(100, 100 + int(os.environ.get("OFFLOAD_SOAK_SEEDS", "60"))):
        check_run(seed, store_policy, num_gpu_blocks=16 + seed % 24, num_cpu_blocks=3 + seed % 50,
                  fail_rate=(seed % 4) * 0.1, wait_for_loads=seed % 2 == 0, num_requests=80,
                  abort_fraction=0.2, max_delay_s=0.004, eviction="arc" if seed % 3 == 0 else "lru")
