"""Host time of one CUDA-backend job up to its first launch, on the simulated device with its calls stubbed out.

What it measures: Python time on the engine thread for one `start_store` / `start_load` of a 128 MiB job of
scattered block ids (drawn from pools 4x the job), default configuration without the calibration (staged
both ways), on a Llama-8B-like layer-compact cache (32 layers, K/V first, 16-token blocks) whose segment (one
layer's K or V of one block) is 32 KiB (8 KV heads of 128, fp16: 2 MiB blocks, 64 a job) or 4 KiB (one head:
256 KiB blocks, 512 a job). Per job, the median over `--reps` of:
- `first_us`: from the call's entry to the first copy call reaching the runtime (a store's first gather
  launch, a load's first DMA), the worker's checks of the id lists included;
- `backend_first_us`: the same from the backend's `submit` entry;
- `total_us`: the whole call; `calls_before_first`: runtime calls (streams, events, copies) made before it.
The worker binds on the simulated device (worker_side/testing/cuda_sim.py); then every runtime call the
jobs make is replaced by a no-op that only counts (and notes the time of the first copy call), so the
figures are the connector's own Python and numpy, with no simulator and no driver in them. They are NOT
GPU figures: on a GPU each of `calls_before_first` adds a driver call's cost (a few µs) on top.

`--baseline DIR`: also run the same measurement over the project tree in DIR (another checkout, e.g. the
branch point), alternating the two trees `--rounds` times in separate processes, and print the ratio
baseline / this tree per figure (min over rounds of each tree's median).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

JOB_BYTES = 128 << 20
POOL_FACTOR = 4
SEGMENTS = {"32KiB": 8, "4KiB": 1}  # segment name: KV heads of 128 fp16 values, 16 tokens
LAYERS = 32
ROOT = Path(__file__).resolve().parents[1]  # this checkout
COPY_CALLS = ("launch_staged_copy", "launch_block_copy", "memcpy_batch", "memcpy")
STUBBED = ("get_device", "compute_stream", "create_event", "record_event", "wait_event", "query_event",
           "synchronize_event", "synchronize_stream", *COPY_CALLS)


class FirstCopyClock:
    """Wraps a runtime's calls on the instance (every part of the backend holds the same runtime object): notes
    when the first copy call (`COPY_CALLS`) since `reset` arrives, and how many wrapped calls came before it.
    Calls named in `stubbed` become no-ops returning a canned value; the others go through (on a GPU:
    benchmarks/datapath_gpu.py)."""

    def __init__(self, rt: object, stubbed: tuple[str, ...] = ()) -> None:
        self.calls = 0
        self.first_at: float | None = None
        self.calls_before_first = 0
        canned = {}
        if stubbed:
            canned = {"compute_stream": rt.compute_stream(), "create_event": rt.create_event(),
                      "query_event": True, "get_device": rt.get_device()}
        for name in dict.fromkeys((*stubbed, *COPY_CALLS)):
            inner = None if name in stubbed else getattr(rt, name)
            setattr(rt, name, self._wrap(name, inner, canned.get(name)))

    def _wrap(self, name: str, inner, result: object):
        copy = name in COPY_CALLS

        def call(*args, **kwargs) -> object:
            self.calls += 1
            if copy and self.first_at is None:
                self.first_at = time.perf_counter()
                self.calls_before_first = self.calls - 1
            return result if inner is None else inner(*args, **kwargs)
        return call

    def reset(self) -> None:
        self.calls, self.first_at, self.calls_before_first = 0, None, 0


def make_worker(heads: int, pool: int):
    import torch

    from offload_connector import load_config
    from worker_side import OffloadWorker
    from worker_side.backends.cuda.backend import CudaBackend
    from worker_side.testing.cuda_sim import SimCudaRuntime

    rt = SimCudaRuntime(schedule="random", seed=0, burst=0, copy_bytes=False)
    kv = {f"l{i}": rt.alloc_device((2, pool, 16, heads, 128), torch.float16) for i in range(LAYERS)}
    t = load_config(None).transfer
    backend = CudaBackend(runtime=rt, kernel_directions=t.kernel_directions,
                          kernel_max_segment_bytes=int(t.kernel_max_segment_bytes),
                          kernel_min_segments=t.kernel_min_segments, staging_bytes=int(t.staging_bytes))
    worker = OffloadWorker(load_config({"num_cpu_blocks": pool}), backend=backend)
    worker.register_kv_caches(kv, num_gpu_blocks=pool)
    return rt, worker


def measure(reps: int, seed: int) -> dict:
    from offload_connector.metadata import TransferMetadata

    out: dict = {}
    for name, heads in SEGMENTS.items():
        block = 2 * LAYERS * 16 * heads * 128 * 2
        n = JOB_BYTES // block
        pool = POOL_FACTOR * n + 1
        rt, worker = make_worker(heads, pool)
        backend = worker.backend
        clock = FirstCopyClock(rt, STUBBED)
        inner, entered = backend.submit, [0.0]

        def submit(job, inner=inner, entered=entered) -> None:
            entered[0] = time.perf_counter()
            inner(job)

        backend.submit = submit
        rng, events = random.Random(seed), iter(range(1, 1 << 30))
        row: dict = {"num_blocks": n, "block_bytes": block,
                     "chunks_per_job": -(-n // backend.paths.staged.plan.slot_blocks) if backend.paths.staged else 0}
        for kind in ("store", "load"):
            first, backend_first, total, calls = [], [], [], 0
            for _ in range(reps + 3):  # the first three warm up
                gpu, cpu = rng.sample(range(1, pool), n), rng.sample(range(1, pool), n)
                meta = (TransferMetadata(store_event=next(events), store_gpu_blocks=gpu, store_cpu_blocks=cpu)
                        if kind == "store" else
                        TransferMetadata(load_event=next(events), load_gpu_blocks=gpu, load_cpu_blocks=cpu,
                                         load_event_reqs=["r"]))
                worker.begin_step()
                clock.reset()
                t0 = time.perf_counter()
                (worker.start_store if kind == "store" else worker.start_load)(meta)
                t1 = time.perf_counter()
                if clock.first_at is None:
                    raise RuntimeError(f"{name} {kind}: no copy call reached the runtime")
                first.append(clock.first_at - t0)
                backend_first.append(clock.first_at - entered[0])
                total.append(t1 - t0)
                calls = clock.calls_before_first
                worker.get_finished()
                backend.end_step()
            med = {k: round(statistics.median(v[3:]) * 1e6, 1) for k, v in
                   (("first_us", first), ("backend_first_us", backend_first), ("total_us", total))}
            row[kind] = {**med, "calls_before_first": calls}
        row["paths"] = {k: v for k, v in backend.num_jobs_by_path.items() if v}
        worker.shutdown()
        out[name] = row
    return out


def run_tree(tree: Path, reps: int, seed: int) -> dict:
    """This script's measurement over the project tree at `tree`, in a fresh process."""
    done = subprocess.run([sys.executable, __file__, "--json", "--reps", str(reps), "--seed", str(seed),
                           "--tree", str(tree)], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def compare(baseline: Path, rounds: int, reps: int, seed: int) -> dict:
    here = ROOT
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    for _ in range(rounds):  # alternate: the machine is shared, drift hits both trees alike
        runs["baseline"].append(run_tree(baseline, reps, seed)["segments"])
        runs["this"].append(run_tree(here, reps, seed)["segments"])
    best = {tree: {seg: {kind: {k: min(r[seg][kind][k] for r in rs) for k in ("first_us", "backend_first_us",
                                                                               "total_us", "calls_before_first")}
                         for kind in ("store", "load")} for seg in SEGMENTS} for tree, rs in runs.items()}
    ratios = {seg: {kind: {k: round(best["baseline"][seg][kind][k] / best["this"][seg][kind][k], 2)
                           for k in ("first_us", "backend_first_us", "total_us")}
                    for kind in ("store", "load")} for seg in SEGMENTS}
    return {"rounds": rounds, "reps": reps, **best, "baseline_over_this": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--baseline", type=Path, help="another checkout of the project to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", type=Path, default=ROOT, help="the project tree to import (default: this checkout)")
    args = p.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    if args.baseline is not None:
        result = compare(args.baseline.resolve(), args.rounds, args.reps, args.seed)
    else:
        result = {"what": "host-side Python on the simulated device, runtime calls stubbed: not GPU time",
                  "reps": args.reps, "segments": measure(args.reps, args.seed)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
