"""Worker data path: CPU throughput vs memcpy, CUDA submission cost on the simulated device, GPU throughput.

`--backend cpu` (default): for 64 KiB and 2 MiB blocks, one batch moves `--batch-mib` MiB through
`OffloadWorker` (CPU backend, `--threads` copy threads), timed from `start_*` to `get_finished`; the
baseline is `dst.copy_(src)` of one contiguous buffer of the same size, measured in the same run (best of
before and after). Block-id patterns: `runs` (random runs of 16 consecutive ids on both sides, what the
scheduler's pools mostly hand out) and `scattered` (independent random permutations). Best of `--reps`.
JSON: `store_vs_memcpy` / `load_vs_memcpy` (min over sizes, `runs`), `*_scattered`, per-size under `sizes`.

`--backend cuda-sim`: the CUDA backend on the simulated device (worker_side.testing.cuda_sim), a Llama-8B-like KV
cache (32 layers, 8 KV heads of 128, fp16, 16-token blocks: 2 MiB a block) in each layout (block first, K/V
first, head-major LHBNC), 1 to 1024 blocks per job, runs and scattered ids, under three copy policies:
`default` (the configuration's: staged both ways; no calibration), `dma` (batched DMA only) and
`kernel_both` (every job by the direct kernel).
Per policy, `copy_calls_per_job`: copy or kernel-launch calls the backend made per job (max over everything);
`host_us_per_job`: per block count, Python time on the calling thread per `start_*` (the worker's checks
of the metadata's id lists included; min over reps, the simulator's own time subtracted; max over layouts,
patterns and directions); `backend_us_per_job` the same for the backend's `submit` alone.

`--backend cuda` (needs a GPU; benchmarks/datapath_gpu.py): store and load GB/s for 2 MiB blocks in runs
and scattered 64 KiB and 16 KiB blocks, per policy (the defaults with calibration, kernel only, DMA only),
against a contiguous pinned-host <-> device `copy_` of the same bytes in the same run (`*_vs_copy`), copy
calls per job, the path each job took, and how much a matmul loop on the compute stream slows while loads
and stores run (kernel vs DMA).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker

SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}


def best_of(reps: int, fn) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def id_pattern(pattern: str, n: int, pool: int, rng: random.Random) -> list[int]:
    if pattern == "scattered":
        return rng.sample(range(1, pool), n)
    run = 16
    starts = rng.sample(range((pool - 1) // run), -(-n // run))
    return [1 + s * run + i for s in starts for i in range(run)][:n]


def bench_size(block_bytes: int, batch_bytes: int, threads: int, reps: int, rng: random.Random) -> dict:
    n = max(1, batch_bytes // block_bytes)
    pool = 2 * n + 1
    engine = torch.randint(0, 256, (pool, block_bytes), dtype=torch.uint8)
    worker = OffloadWorker(load_config({"num_cpu_blocks": pool, "transfer": {"backend": "cpu", "num_streams": threads}}))
    worker.register_kv_caches({"kv": engine})
    a, b = torch.empty(n * block_bytes, dtype=torch.uint8), torch.randint(0, 256, (n * block_bytes,), dtype=torch.uint8)
    memcpy_s = best_of(reps, lambda: a.copy_(b))
    out: dict = {"num_blocks": n, "memcpy_gbps": round(n * block_bytes / memcpy_s / 1e9, 2)}
    event = iter(range(1, 1 << 30))
    for pattern in ("runs", "scattered"):
        gpu, cpu = id_pattern(pattern, n, pool, rng), id_pattern(pattern, n, pool, rng)

        def store(gpu: list[int] = gpu, cpu: list[int] = cpu) -> None:
            worker.start_store(TransferMetadata(store_event=next(event), store_gpu_blocks=gpu, store_cpu_blocks=cpu))
            worker.wait_all()
            worker.get_finished()

        def load(gpu: list[int] = gpu, cpu: list[int] = cpu) -> None:
            worker.start_load(TransferMetadata(load_event=next(event), load_gpu_blocks=gpu, load_cpu_blocks=cpu,
                                               load_event_reqs=["r"]))
            worker.get_finished()

        store_s, load_s = best_of(reps, store), best_of(reps, load)
        out[pattern] = {"store_vs_memcpy": round(memcpy_s / store_s, 3), "load_vs_memcpy": round(memcpy_s / load_s, 3),
                        "store_gbps": round(n * block_bytes / store_s / 1e9, 2),
                        "load_gbps": round(n * block_bytes / load_s / 1e9, 2)}
    memcpy_s = min(memcpy_s, best_of(reps, lambda: a.copy_(b)))  # again after: the machine is shared
    out["memcpy_gbps"] = round(n * block_bytes / memcpy_s / 1e9, 2)
    for pattern in ("runs", "scattered"):
        for key in ("store", "load"):
            out[pattern][f"{key}_vs_memcpy"] = round(out[pattern][f"{key}_gbps"] / out["memcpy_gbps"], 3)
    worker.shutdown()
    return out


SIM_COUNTS = (1, 16, 256, 1024)
SIM_LAYOUTS = ("block_first", "kv_first", "LHBNC")  # a Llama-8B-like KV cache: 32 layers, 8 KV heads x 128, fp16


def sim_layout(layout: str, num_blocks: int, rt) -> tuple[dict[str, torch.Tensor], str | None]:
    """Per-layer KV tensors on the simulated device, 16-token blocks (64 KiB of K and V per layer)."""
    def one() -> torch.Tensor:
        if layout == "block_first":
            return rt.alloc_device((num_blocks, 2, 16, 8, 128), torch.float16)
        if layout == "kv_first":
            return rt.alloc_device((2, num_blocks, 16, 8, 128), torch.float16)
        # head-major: physical [H, B, N, 2 * head] seen as vLLM's logical [B, H, N, C]
        return rt.alloc_device((8, num_blocks, 16, 256), torch.float16).permute(1, 0, 2, 3)
    return {f"l{i}": one() for i in range(32)}, ("LHBNC" if layout == "LHBNC" else None)


SIM_POLICIES = {  # the configuration's defaults (staged both ways), DMA only, and the direct kernel for both
    "default": {},
    "dma": {"staging_bytes": 0},
    "kernel_both": {"kernel_directions": ("load", "store"), "kernel_max_segment_bytes": 1 << 30,
                    "kernel_min_segments": 1, "staging_bytes": 0},
}


def bench_cuda_sim(reps: int, seed: int) -> dict:
    return {"backend": "cuda-sim", "reps": reps,
            "policies": {name: bench_cuda_sim_policy(reps, seed, name) for name in SIM_POLICIES}}


def bench_cuda_sim_policy(reps: int, seed: int, policy: str) -> dict:
    from worker_side.backends.cuda.backend import CudaBackend
    from worker_side.testing.cuda_sim import SimCudaRuntime

    rng = random.Random(seed)
    pool = max(SIM_COUNTS) + 1
    host_us: dict[int, float] = dict.fromkeys(SIM_COUNTS, 0.0)
    backend_us: dict[int, float] = dict.fromkeys(SIM_COUNTS, 0.0)
    calls, per_layout = 0, {}
    event = iter(range(1, 1 << 30))
    t = load_config(None).transfer  # the configuration's defaults, without the calibration
    options = {"kernel_directions": t.kernel_directions, "kernel_max_segment_bytes": int(t.kernel_max_segment_bytes),
               "kernel_min_segments": t.kernel_min_segments, "staging_bytes": int(t.staging_bytes),
               **SIM_POLICIES[policy]}
    for layout in SIM_LAYOUTS:
        # nothing runs inside a timed call; copies are checked but move no bytes (2 GiB per job at 1024 blocks)
        rt = SimCudaRuntime(schedule="random", seed=seed, burst=0, copy_bytes=False)
        kv, hint = sim_layout(layout, pool, rt)
        worker = OffloadWorker(load_config({"num_cpu_blocks": pool}), backend=CudaBackend(runtime=rt, **options))
        worker.register_kv_caches(kv, num_gpu_blocks=pool, layout=hint)
        backend, layout_calls = worker.backend, 0
        inner_submit, in_backend = backend.submit, [0.0]

        def timed_submit(job, inner_submit=inner_submit, in_backend=in_backend) -> None:
            t0 = time.perf_counter()
            inner_submit(job)
            in_backend[0] += time.perf_counter() - t0

        backend.submit = timed_submit
        for n in SIM_COUNTS:
            for pattern in ("runs", "scattered"):
                gpu, cpu = id_pattern(pattern, n, pool, rng), id_pattern(pattern, n, pool, rng)
                for kind in ("store", "load"):
                    best = best_backend = float("inf")
                    for _ in range(reps):
                        meta = (TransferMetadata(store_event=next(event), store_gpu_blocks=gpu, store_cpu_blocks=cpu)
                                if kind == "store" else
                                TransferMetadata(load_event=next(event), load_gpu_blocks=gpu, load_cpu_blocks=cpu,
                                                 load_event_reqs=["r"]))
                        worker.begin_step()
                        before_calls, before_sim = backend.num_copy_calls, rt.self_time
                        in_backend[0] = 0.0
                        t0 = time.perf_counter()
                        (worker.start_store if kind == "store" else worker.start_load)(meta)
                        elapsed = time.perf_counter() - t0 - (rt.self_time - before_sim)
                        best = min(best, elapsed)
                        best_backend = min(best_backend, in_backend[0] - (rt.self_time - before_sim))
                        layout_calls = max(layout_calls, backend.num_copy_calls - before_calls)
                        rt.drain()
                        worker.get_finished()
                    host_us[n] = max(host_us[n], best * 1e6)
                    backend_us[n] = max(backend_us[n], best_backend * 1e6)
        per_layout[layout] = {"copy_calls_per_job": layout_calls, "planes": backend.paths.geometry["store"].num_planes,
                              "jobs_by_path": {k: v for k, v in backend.num_jobs_by_path.items() if v}}
        calls = max(calls, layout_calls)
        worker.shutdown()
        if rt.faults:
            raise RuntimeError(f"simulated device faults in {layout}: {rt.faults[:3]}")
    return {"policy": backend.policy.describe(), "copy_calls_per_job": calls,
            "host_us_per_job": {str(n): round(us, 1) for n, us in host_us.items()},
            "host_us_max_over_min": round(max(host_us.values()) / min(host_us.values()), 2),
            "backend_us_per_job": {str(n): round(us, 1) for n, us in backend_us.items()},
            "backend_us_max_over_min": round(max(backend_us.values()) / min(backend_us.values()), 2),
            "layouts": per_layout}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["cpu", "cuda-sim", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true")
    p.add_argument("--batch-mib", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.backend != "cpu":
        if args.backend == "cuda-sim":
            result = bench_cuda_sim(max(args.reps, 50), args.seed)
        else:
            if not torch.cuda.is_available():
                raise SystemExit("bench_datapath.py --backend cuda: torch sees no CUDA device here; "
                                 "allowed here: --backend cpu or --backend cuda-sim")
            from datapath_gpu import bench_cuda  # benchmarks/datapath_gpu.py

            result = bench_cuda(args.batch_mib << 20, args.reps, args.seed)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return
    rng = random.Random(args.seed)
    sizes = {name: bench_size(size, args.batch_mib << 20, args.threads, args.reps, rng) for name, size in SIZES.items()}
    result = {
        "store_vs_memcpy": min(s["runs"]["store_vs_memcpy"] for s in sizes.values()),
        "load_vs_memcpy": min(s["runs"]["load_vs_memcpy"] for s in sizes.values()),
        "store_vs_memcpy_scattered": min(s["scattered"]["store_vs_memcpy"] for s in sizes.values()),
        "load_vs_memcpy_scattered": min(s["scattered"]["load_vs_memcpy"] for s in sizes.values()),
        "threads": args.threads, "batch_mib": args.batch_mib, "torch_threads": torch.get_num_threads(),
        "sizes": sizes,
    }
    if args.json:
        print(json.dumps(result))
        return
    for name, s in sizes.items():
        for pattern in ("runs", "scattered"):
            r = s[pattern]
            print(f"{name:>6} {pattern:>9}: store {r['store_gbps']:6.2f} GB/s ({r['store_vs_memcpy']:.2f}x memcpy)  "
                  f"load {r['load_gbps']:6.2f} GB/s ({r['load_vs_memcpy']:.2f}x)  memcpy {s['memcpy_gbps']} GB/s")


if __name__ == "__main__":
    main()
