"""Synthetic workloads for the fake engine: small configs, random requests with shared prefixes, runs.

Used by the integrity suite and the soak; deterministic given the seed. `run_workload` adds every
request, applies the aborts scheduled at given steps, steps until all are done, then `check()`s leaks.
`run_aborting_in_states` instead aborts requests caught in a chosen state between steps (a pending CPU
hit, a load in flight, a store of their blocks in flight, preempted and not re-admitted): the states
where a finish races a transfer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from offload_connector.config import OffloadConfig, load_config
from offload_connector.fake_engine.engine import FakeEngine
from offload_connector.fake_engine.request import EngineRequest, RequestStatus
from scheduler_side.request_state import Phase


def small_config(num_gpu_blocks: int = 24, num_cpu_blocks: int = 24, block_size: int = 4,
                 store_policy: str = "eager", max_num_batched_tokens: int = 32, max_num_seqs: int = 4,
                 **overrides: Any) -> OffloadConfig:
    """A tiny engine (pools of a few dozen blocks) where eviction, CPU hits and preemption all happen."""
    engine = {"num_gpu_blocks": num_gpu_blocks, "block_size": block_size, "num_layers": 2, "num_kv_heads": 2,
              "head_dim": 4, "dtype": "float16", "max_num_batched_tokens": max_num_batched_tokens,
              "max_num_seqs": max_num_seqs}
    engine.update(overrides.pop("engine", {}))
    return load_config({"num_cpu_blocks": num_cpu_blocks, "store_policy": store_policy,
                        "transfer": {"backend": "cpu", "num_streams": 2}, "engine": engine, **overrides})


@dataclass
class Workload:
    requests: list[tuple[str, list[int], int]]  # (request id, prompt, max_tokens)
    aborts: dict[int, list[str]] = field(default_factory=dict)  # step -> request ids to abort before it


def random_workload(seed: int, num_requests: int = 30, num_prefixes: int = 8, max_prefix: int = 40,
                    max_suffix: int = 12, max_tokens: int = 12, abort_fraction: float = 0.0,
                    max_abort_step: int = 60) -> Workload:
    """Requests sharing a few random prefixes (so they hit each other's blocks), some aborted at random steps."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, max_prefix))] for _ in range(num_prefixes)]
    wl = Workload([])
    for i in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, max_suffix))]
        wl.requests.append((f"r{i}", prompt, rng.randrange(1, max_tokens)))
        if rng.random() < abort_fraction:
            wl.aborts.setdefault(rng.randrange(max_abort_step), []).append(f"r{i}")
    return wl


ABORT_STATES = ("pending_hit", "loading", "store_in_flight", "preempted")


def request_states(engine: FakeEngine, req: EngineRequest, being_stored: set[int]) -> list[str]:
    """Which of `ABORT_STATES` the request is in right now."""
    out = []
    if engine.connector is not None and engine.connector.phase_of(req.request_id) is Phase.PENDING_HIT:
        out.append("pending_hit")
    if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
        out.append("loading")
    if being_stored and not being_stored.isdisjoint(req.gpu_block_ids):
        out.append("store_in_flight")
    if req.status is RequestStatus.PREEMPTED:
        out.append("preempted")
    return out


def run_aborting_in_states(engine: FakeEngine, wl: Workload, seed: int, rate: float = 0.25,
                           max_steps: int = 100_000) -> tuple[set[str], dict[str, int]]:
    """Run to completion, aborting (with probability `rate`) each request found in one of `ABORT_STATES`
    after a step; returns the aborted ids and how many aborts hit each state. Then `check()`s leaks."""
    rng = random.Random(seed)
    for request_id, prompt, max_tokens in wl.requests:
        engine.add_request(request_id, prompt, max_tokens)
    aborted: set[str] = set()
    hits = dict.fromkeys(ABORT_STATES, 0)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
        being_stored = engine.connector.gpu_blocks_being_stored() if engine.connector is not None else set()
        for req in list(engine.scheduler.requests.values()):
            states = request_states(engine, req, being_stored)
            if states and rng.random() < rate and engine.abort_request(req.request_id):
                aborted.add(req.request_id)
                for state in states:
                    hits[state] += 1
    else:
        raise RuntimeError(f"workload did not finish in {max_steps} steps")
    engine.check()
    return aborted, hits


def run_workload(engine: FakeEngine, wl: Workload, max_steps: int = 100_000) -> set[str]:
    """Run to completion; returns the ids actually aborted (an abort after the finish is a no-op)."""
    for request_id, prompt, max_tokens in wl.requests:
        engine.add_request(request_id, prompt, max_tokens)
    aborted: set[str] = set()
    step = 0
    while engine.has_unfinished():
        for request_id in wl.aborts.get(step, ()):
            if engine.abort_request(request_id):
                aborted.add(request_id)
        engine.step()
        step += 1
        if step > max_steps:
            raise RuntimeError(f"workload did not finish in {max_steps} steps")
    engine.check()
    return aborted
