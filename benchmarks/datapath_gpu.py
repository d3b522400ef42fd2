"""`bench_datapath.py --backend cuda`: the CUDA data path on a real GPU (needs one; nothing here runs without).

What it records (one JSON object; scripts/gpu_check.sh saves it):
- per block size (2 MiB blocks in runs of 16, scattered 64 KiB and 16 KiB blocks; one `--batch-mib` job
  each way) and per policy (`default`: the configuration's defaults with the start-up calibration; `kernel`:
  every job by the block-copy kernel; `dma`: every job by batched DMA): store and load GB/s, best of
  `--reps`, against a contiguous pinned-host <-> device `copy_` of the same bytes in the same run
  (`*_vs_copy`), copy calls per job, the path each job took, and what the calibration picked;
- `forward_slowdown`: a bf16 matmul loop on the compute stream, timed alone and while a store and a load of
  scattered 16 KiB blocks run on the copy streams, per policy (`kernel` / `dma`): `matmul_slowdown` is the
  cost our copies impose on the forward, `copy_slowdown` what the forward costs the copies.
Each store / load is timed from `begin_step` to the end of `wait_all` (the host's submission included),
with `torch.cuda.synchronize()` after, so a figure is the time a step would wait for it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker

GPU_SIZES = {"2MiB": (2 << 20, "runs"), "64KiB": (64 << 10, "scattered"), "16KiB": (16 << 10, "scattered")}
POLICIES = {
    "default": {},
    "kernel": {"kernel_directions": ["load", "store"], "kernel_max_segment_bytes": "1GiB", "kernel_min_segments": 1,
               "calibrate": False},
    "dma": {"kernel_directions": [], "calibrate": False},
}
MATMUL_N = 8192


def id_pattern(pattern: str, n: int, pool: int, rng: random.Random) -> list[int]:
    if pattern == "scattered":
        return rng.sample(range(1, pool), n)
    run = 16
    starts = rng.sample(range((pool - 1) // run), -(-n // run))
    return [1 + s * run + i for s in starts for i in range(run)][:n]


def best_gpu_seconds(reps: int, fn: Callable[[], None]) -> float:
    """Best wall time of `fn` followed by a device synchronize (one untimed warm-up first)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def make_worker(kv: torch.Tensor, pool: int, policy: str) -> OffloadWorker:
    transfer = {"backend": "cuda", **POLICIES[policy]}
    worker = OffloadWorker(load_config({"num_cpu_blocks": pool, "transfer": transfer}))
    worker.register_kv_caches({"kv": kv})
    return worker


class Jobs:
    """One worker's store / load steps, with fresh event ids."""

    def __init__(self, worker: OffloadWorker) -> None:
        self.worker, self._event = worker, iter(range(1, 1 << 30))

    def store(self, gpu: list[int], cpu: list[int]) -> None:
        self.worker.start_store(TransferMetadata(store_event=next(self._event), store_gpu_blocks=gpu,
                                                 store_cpu_blocks=cpu))

    def load(self, gpu: list[int], cpu: list[int]) -> None:
        self.worker.start_load(TransferMetadata(load_event=next(self._event), load_gpu_blocks=gpu,
                                                load_cpu_blocks=cpu, load_event_reqs=["r"]))

    def finish(self) -> None:
        self.worker.wait_all()
        self.worker.get_finished()

    def store_step(self, gpu: list[int], cpu: list[int]) -> None:
        self.worker.begin_step()
        self.store(gpu, cpu)
        self.finish()

    def load_step(self, gpu: list[int], cpu: list[int]) -> None:
        self.worker.begin_step()
        self.load(gpu, cpu)
        self.finish()


def bench_policy(kv: torch.Tensor, pool: int, policy: str, gpu: list[int], cpu: list[int], reps: int,
                 d2h: float, h2d: float) -> dict:
    worker = make_worker(kv, pool, policy)
    jobs, backend = Jobs(worker), worker.backend
    gb = len(gpu) * kv.shape[1] / 1e9
    calls_before = backend.num_copy_calls
    store_s = best_gpu_seconds(reps, lambda: jobs.store_step(gpu, cpu))
    load_s = best_gpu_seconds(reps, lambda: jobs.load_step(gpu, cpu))
    num_jobs = 2 * (reps + 1)
    out = {"store_gbps": round(gb / store_s, 2), "load_gbps": round(gb / load_s, 2),
           "store_vs_copy": round(d2h / store_s, 3), "load_vs_copy": round(h2d / load_s, 3),
           "copy_calls_per_job": round((backend.num_copy_calls - calls_before) / num_jobs, 2),
           "jobs_by_path": dict(backend.num_jobs_by_path), "policy": backend.policy.describe(),
           "kernel_off_reason": backend.kernel_off_reason, "pinned": backend.pinned}
    if backend.calibration:
        out["calibration"] = [{"kind": m.kind, "segments": m.num_segments, "avg_segment_bytes": m.avg_segment_bytes,
                               "kernel_us": round(m.kernel_s * 1e6, 1), "dma_us": round(m.dma_s * 1e6, 1)}
                              for m in backend.calibration]
    worker.shutdown()
    return out


def bench_size(block_bytes: int, pattern: str, batch_bytes: int, reps: int, rng: random.Random) -> dict:
    n = max(1, batch_bytes // block_bytes)
    pool = 2 * -(-n // 16) * 16 + 1  # room for twice the job in whole runs of 16
    kv = torch.randint(0, 256, (pool, block_bytes), dtype=torch.uint8, device="cuda")
    host = torch.empty(n * block_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n * block_bytes, dtype=torch.uint8, device="cuda")
    gpu, cpu = id_pattern(pattern, n, pool, rng), id_pattern(pattern, n, pool, rng)
    gb = n * block_bytes / 1e9
    d2h = best_gpu_seconds(reps, lambda: host.copy_(dev, non_blocking=True))
    h2d = best_gpu_seconds(reps, lambda: dev.copy_(host, non_blocking=True))
    out: dict = {"pattern": pattern, "num_blocks": n, "d2h_copy_gbps": round(gb / d2h, 2),
                 "h2d_copy_gbps": round(gb / h2d, 2)}
    for policy in POLICIES:
        out[policy] = bench_policy(kv, pool, policy, gpu, cpu, reps, d2h, h2d)
    return out


class _Matmuls:
    """A bf16 matmul loop on the current (compute) stream, timed with CUDA events."""

    def __init__(self) -> None:
        self.a, self.b = (torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        self.c = torch.empty_like(self.a)

    def launch(self, k: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            torch.matmul(self.a, self.b, out=self.c)
        end.record()
        return start, end

    def seconds(self, k: int) -> float:
        start, end = self.launch(k)
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def slowdown_policy(kv: torch.Tensor, pool: int, policy: str, store_ids: tuple[list[int], list[int]],
                    load_ids: tuple[list[int], list[int]], mm: _Matmuls, one_matmul_s: float, reps: int) -> dict:
    worker = make_worker(kv, pool, policy)
    jobs = Jobs(worker)
    jobs.store(*load_ids)  # the host blocks the loads read hold something
    jobs.finish()

    def copies() -> None:  # submitted before the matmuls: they start at once and overlap the whole loop
        worker.begin_step()
        jobs.store(*store_ids)
        jobs.load(*load_ids)

    def copies_waited() -> None:
        copies()
        jobs.finish()

    copy_alone = best_gpu_seconds(reps, copies_waited)
    k = max(1, round(copy_alone / one_matmul_s))
    alone = together = copy_together = float("inf")
    for _ in range(reps):
        alone = min(alone, mm.seconds(k))
        t0 = time.perf_counter()
        copies()
        start, end = mm.launch(k)
        jobs.finish()
        copy_together = min(copy_together, time.perf_counter() - t0)
        end.synchronize()
        together = min(together, start.elapsed_time(end) / 1e3)
    out = {"matmuls": k, "matmul_alone_ms": round(alone * 1e3, 3), "matmul_with_copies_ms": round(together * 1e3, 3),
           "matmul_slowdown": round(together / alone, 3), "copies_alone_ms": round(copy_alone * 1e3, 3),
           "copies_with_matmul_ms": round(copy_together * 1e3, 3), "copy_slowdown": round(copy_together / copy_alone, 3),
           "jobs_by_path": dict(worker.backend.num_jobs_by_path)}
    worker.shutdown()
    return out


def forward_slowdown(batch_bytes: int, reps: int, rng: random.Random) -> dict:
    """How much a matmul loop on the compute stream slows while a store and a load run, per policy."""
    block_bytes = 16 << 10
    n = max(1, batch_bytes // block_bytes)
    pool = 4 * n + 1
    kv = torch.randint(0, 256, (pool, block_bytes), dtype=torch.uint8, device="cuda")
    gpu, cpu = rng.sample(range(1, pool), 2 * n), rng.sample(range(1, pool), 2 * n)
    store_ids, load_ids = (gpu[:n], cpu[:n]), (gpu[n:], cpu[n:])  # disjoint on both tiers, as the scheduler keeps them
    mm = _Matmuls()
    mm.seconds(1)  # warm-up (cuBLAS handle, kernel selection)
    one_matmul_s = mm.seconds(3) / 3
    out: dict = {"block_bytes": block_bytes, "num_blocks": n, "matmul": f"{MATMUL_N}x{MATMUL_N} bf16",
                 "one_matmul_ms": round(one_matmul_s * 1e3, 3)}
    for policy in ("kernel", "dma"):
        out[policy] = slowdown_policy(kv, pool, policy, store_ids, load_ids, mm, one_matmul_s, reps)
    return out


def bench_cuda(batch_bytes: int, reps: int, seed: int) -> dict:
    rng = random.Random(seed)
    sizes = {name: bench_size(block_bytes, pattern, batch_bytes, reps, rng)
             for name, (block_bytes, pattern) in GPU_SIZES.items()}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"backend": "cuda", "device": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "batch_mib": batch_bytes >> 20, "reps": reps, "sizes": sizes,
            "forward_slowdown": forward_slowdown(batch_bytes, reps, rng)}
