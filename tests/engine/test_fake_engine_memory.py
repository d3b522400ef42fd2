"""The fake engine's memory stays flat however many requests it serves (issue 12 item 9).

A replay of 24,000 requests once kept every KV event the connector emitted (77,541 pending at the end).
Here a synthetic workload of 20,000 requests, with GPU prefix hits, CPU hits, evictions and preemptions,
runs through one engine; after 5,000 and after 20,000 requests (each time drained: nothing in flight) we
measure everything the engine object retains: every object reachable from it (sizes from
`sys.getsizeof`, tensors by their storage). Between the two it must not grow by more than a few bytes per
request. Retaining each KV event, each finished request or its expected K/V would add hundreds of bytes
per request. The engine runs as a long replay would: `keep_outputs=False`, `keep_samples=False` (those two
records grow by design, one entry per request, and are covered by their own test below).
"""

from __future__ import annotations

import gc
import random
import sys
import threading
import types
from collections.abc import Iterator

import torch

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import small_config

# Not followed: shared program structure (classes, modules, code, functions' globals) and worker threads
# (the worker object itself, which the engine holds, is followed).
_SHARED = (type, types.ModuleType, types.CodeType, types.BuiltinFunctionType, threading.Thread)


def _referents(obj: object) -> list[object]:
    if isinstance(obj, types.FunctionType):  # its closure and defaults, not the module it lives in
        return [*(c.cell_contents for c in obj.__closure__ or ()), *(obj.__defaults__ or ())]
    if isinstance(obj, types.MethodType):
        return [obj.__self__]
    return gc.get_referents(obj)


def retained_bytes(root: object) -> int:
    """Bytes held by every object reachable from `root` (tensors: their storage, counted once)."""
    seen: set[int] = set()
    storages: set[int] = set()
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SHARED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        total += sys.getsizeof(obj)
        stack.extend(_referents(obj))
    return total


def synthetic_requests(seed: int, num_requests: int) -> Iterator[tuple[str, list[int], int]]:
    """Requests on 16 shared prefixes with short random suffixes, generated one at a time."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(16)]
    for i in range(num_requests):
        suffix = [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        yield f"r{i}", rng.choice(prefixes) + suffix, rng.randrange(1, 6)


def serve(engine: FakeEngine, requests: Iterator[tuple[str, list[int], int]], num_requests: int) -> None:
    """Add `num_requests` more requests (at most 32 queued, as a replay does), run them all, drain."""
    for _, (request_id, prompt, max_tokens) in zip(range(num_requests), requests, strict=False):
        engine.add_request(request_id, prompt, max_tokens)
        while len(engine.scheduler.waiting) >= 32:
            engine.step()
    engine.run()
    engine.drain()
    gc.collect()


def test_memory_per_request_stays_flat_over_20k_requests() -> None:
    cfg = small_config(num_gpu_blocks=48, num_cpu_blocks=96, max_num_seqs=16, max_num_batched_tokens=128)
    requests = synthetic_requests(0, 20_000)
    with FakeEngine(cfg, keep_outputs=False, keep_samples=False) as engine:
        serve(engine, requests, 5_000)
        after_5k = retained_bytes(engine)
        serve(engine, requests, 15_000)
        after_20k = retained_bytes(engine)
        s = engine.stats
        assert s.finished_requests == 20_000 and engine.check() == 0 and s.integrity_errors == 0
        assert s.cpu_hit_tokens > 0 and s.gpu_hit_tokens > 0 and s.num_preemptions > 0  # every path ran
    growth_per_request = (after_20k - after_5k) / 15_000
    assert growth_per_request < 4, (f"the engine grew by {after_20k - after_5k} bytes over 15,000 requests "
                                    f"({after_5k} -> {after_20k})")


def test_outputs_and_samples_are_the_only_per_request_records() -> None:
    """With the defaults the engine keeps one output list and one hit sample per request; nothing else."""
    cfg = small_config(num_gpu_blocks=48, num_cpu_blocks=96, max_num_seqs=16, max_num_batched_tokens=128)
    requests = synthetic_requests(1, 600)
    with FakeEngine(cfg) as engine:
        serve(engine, requests, 600)
        assert len(engine.outputs) == 600 and len(engine.stats.samples) == 600
    with FakeEngine(cfg, keep_outputs=False, keep_samples=False) as engine:
        serve(engine, synthetic_requests(1, 600), 600)
        assert engine.outputs == {} and engine.stats.samples == []
        assert engine.stats.finished_requests == 600
