"""Time the scheduler side alone, per engine step, with N running requests (default 256).

Workload: every step each running request decodes one token (a block completes every `block_size`
steps and is stored eagerly); every step a few requests finish and as many new ones are admitted, half of
them sharing a prefix that is on the CPU (a CPU hit and a load). Worker completions are reported at once.
Times the connector's calls (lookup, allocation update, build_connector_meta, completions, finishes) and
the engine's frees of finished requests; not the engine's per-step allocations or hashing.

    python benchmarks/bench_scheduler_core.py [--requests 256] [--steps 2000] [--policy eager|lazy] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import FakeRequest  # noqa: E402

from offload_connector.config import load_config  # noqa: E402
from offload_connector.hashing import hash_request_tokens, with_group_id  # noqa: E402
from offload_connector.metadata import WorkerReport  # noqa: E402
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler, StepRequest  # noqa: E402


def run(num_requests: int, steps: int, policy: str, block_size: int = 16, prompt_blocks: int = 32,
        eviction: str = "lru") -> dict:
    rng = random.Random(0)
    gpu = BlockPool(num_requests * (prompt_blocks + steps // block_size + 4) + 1)
    cfg = load_config({"num_cpu_blocks": 20_000, "store_policy": policy, "eviction": eviction})
    sched = OffloadScheduler(cfg, block_size, 20_000, BlockPoolGpuView(gpu),
                             max_blocks_per_step=2 * num_requests)
    shared = [rng.randrange(50_000) for _ in range(prompt_blocks * block_size)]
    running: dict[str, tuple[FakeRequest, list[int]]] = {}
    counter = 0

    def make_request(sharing: bool) -> FakeRequest:
        nonlocal counter
        counter += 1
        toks = (shared if sharing else [rng.randrange(50_000) for _ in shared]) + [counter] * 5
        return FakeRequest(f"r{counter}", toks, block_size)  # hashing is the engine's work

    def admit(req: FakeRequest) -> tuple[str, list[int], int]:
        hit, _ = sched.get_num_new_matched_tokens(req, 0)
        ids = [b.block_id for b in gpu.allocate(-(-req.num_tokens // block_size) + 1)]
        sched.update_state_after_alloc(req, ids, hit or 0)
        running[req.request_id] = (req, ids)
        return req.request_id, ids, hit or 0

    def grow(req: FakeRequest) -> None:
        req.tokens.append(rng.randrange(50_000))
        if len(req.tokens) % block_size == 0:
            n = len(req.block_hashes)
            req.block_hashes.extend(hash_request_tokens(req.tokens, block_size, start=n, parent=req.block_hashes[-1]))

    # warm-up: fill the batch (not timed)
    first = [admit(make_request(sharing=False)) for _ in range(num_requests)]
    meta = sched.build_connector_meta([StepRequest(r, ids, running[r][0].num_tokens, True) for r, ids, _ in first])
    if meta.store_event is not None:
        sched.update_connector_output(WorkerReport(completed_store_events=[meta.store_event]))
    for req, ids in running.values():
        for gid, h in zip(ids, req.block_hashes, strict=False):
            gpu.cache(gpu.blocks[gid], with_group_id(h))

    timed = 0.0
    churn = max(1, num_requests // 64)
    for step in range(steps):
        for req, _ in running.values():
            grow(req)  # the engine's own work, not timed
        done = rng.sample(sorted(running), churn)
        arriving = [make_request(sharing=(step + i) % 2 == 0) for i in range(churn)]
        t0 = time.perf_counter()
        scheduled = []
        for rid in done:
            req, ids = running.pop(rid)
            sched.request_finished(req)
            gpu.free([gpu.blocks[i] for i in reversed(ids)])
        for req in arriving:
            admit(req)
        timed += time.perf_counter() - t0
        for rid, (req, ids) in running.items():  # the engine's own allocation: not timed
            if len(req.tokens) % block_size == 1 and len(ids) * block_size < len(req.tokens):
                more = gpu.allocate(1)
                if more:
                    ids.append(more[0].block_id)
                    scheduled.append(StepRequest(rid, [more[0].block_id], req.num_tokens - 1))
                    continue
            scheduled.append(StepRequest(rid, (), req.num_tokens - 1))
        t0 = time.perf_counter()
        meta = sched.build_connector_meta(scheduled)
        sched.update_connector_output(WorkerReport(
            finished_load_reqs=list(meta.load_event_reqs),
            completed_store_events=[] if meta.store_event is None else [meta.store_event]))
        timed += time.perf_counter() - t0
    sched.check_integrity()
    return {"requests": num_requests, "steps": steps, "policy": policy, "eviction": eviction,
            "us_per_step": round(timed / steps * 1e6, 1),
            "stored_blocks": sched.stats.num_stored_blocks, "loaded_blocks": sched.stats.num_loaded_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--policy", choices=["eager", "lazy"], default="eager")
    ap.add_argument("--eviction", choices=["lru", "arc"], default="lru")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args.requests, args.steps, args.policy, eviction=args.eviction)
    print(json.dumps(out) if args.json else
          f"{out['us_per_step']} us/step with {out['requests']} running requests ({out['policy']}/{out['eviction']}, "
          f"{out['steps']} steps; {out['stored_blocks']} blocks stored, {out['loaded_blocks']} loaded)")


if __name__ == "__main__":
    main()
