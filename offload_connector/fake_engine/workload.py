"""Synthetic workloads for the fake engine: small configs, random requests with shared prefixes, runs.

Used by the integrity suite and the soak; deterministic given the seed. `run_workload` adds every
request, applies the aborts scheduled at given steps, steps until all are done, then `check()`s leaks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from offload_connector.config import OffloadConfig, load_config
from offload_connector.fake_engine.engine import FakeEngine


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
