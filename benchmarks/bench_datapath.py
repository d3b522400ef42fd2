"""Worker data path throughput: batched stores/loads vs a contiguous copy of the same bytes.

For 64 KiB and 2 MiB blocks, one batch moves `--batch-mib` MiB through `OffloadWorker` (CPU backend,
`--threads` copy threads) and is timed from `start_*` to `get_finished`; the baseline is `dst.copy_(src)` of
one contiguous buffer of the same size, measured in the same run (best of before and after). Block-id patterns: `runs` (random runs of
16 consecutive ids on both sides, what the scheduler's pools mostly hand out) and `scattered` (independent
random permutations: every block is its own copy). Best of `--reps`. Prints a table, or one JSON object with
`--json`: `store_vs_memcpy` / `load_vs_memcpy` (min over sizes, `runs` pattern), `*_scattered` (min over
sizes, scattered), and per-size figures under `sizes`.
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
                                               load_event_reqs=["r"], load_req_num_blocks=[n]))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--batch-mib", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
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
