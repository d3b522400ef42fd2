"""`bench_datapath.py --backend cuda`: the CUDA data path on a real GPU (needs one; nothing here runs without).

One JSON object (scripts/gpu_check.sh saves it as bench_cuda.json):
- `sweep`: per segment size (the bytes of one layer's K or V of one block: 4 KiB to 2 MiB), per KV layout
  (`layer_compact`: vLLM's default, each layer its own region, a block is 2 x layers small chunks;
  `block_outermost`: vLLM's BLHNC, a block is one range across layers), per id pattern (`runs`: runs of 16
  consecutive ids on both sides; `scattered`: ids drawn at random from pools 4x the job) and per policy
  (`default`: the configuration's defaults with the start-up calibration; `staged`, `dma`, `kernel`: every
  job by that path), store and load GB/s of one `--batch-mib` job, best of `--reps`, and the ratio to a
  contiguous pinned-host <-> device `copy_` of the same bytes measured for that size (`*_vs_copy`);
  `min_default_vs_copy` is the smallest ratio of the default over every size, layout and direction
  (scattered ids).
- `forward_slowdown`: a bf16 matmul loop on the compute stream, timed alone and while stores and loads of
  scattered 32 KiB segments run, per path: `matmul_slowdown` (median of adjacent pairs) is what our copies
  cost the forward, `copy_slowdown` what the forward costs the copies. `contiguous_copy` is the floor: the
  same bytes as plain pinned `copy_` calls, one side stream per direction (any copy's DMA contends for HBM);
  `matmul_slowdown_over_copy` is each path's slowdown divided by that floor's, what our path adds to it.
- `submit_us`: host time of one `start_store` / `start_load` call (the engine thread's cost), 1 to 64 blocks
  of 32 KiB segments and 512 of 4 KiB, and the part of it before the first copy call reached the runtime.
- `round_trip`: random jobs through the default configuration on a 32-layer Llama-8B-shaped cache
  (FlashAttention's [2, blocks, 16, 8, 128] bf16 per layer) in both layouts, every block compared byte
  for byte after a store, a clobber and a load into other blocks.
- `dma_pieces`: one batched DMA call of scattered pieces (64 KiB to 16 MiB), on one stream and split over
  two, against the contiguous copy: how large the host side's pieces must be.
Each store / load is timed from `begin_step` to the end of `wait_all` (the host's submission included),
with `torch.cuda.synchronize()` after, so a figure is the time a step would wait for it. A section that
fails records its error and the others still run.
"""

from __future__ import annotations

import random
import statistics
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker

SEGMENTS = {"4KiB": 4 << 10, "8KiB": 8 << 10, "16KiB": 16 << 10, "32KiB": 32 << 10, "64KiB": 64 << 10,
            "256KiB": 256 << 10, "2MiB": 2 << 20}
LAYOUTS = ("layer_compact", "block_outermost")
POLICIES = {
    "default": {},
    "staged": {"kernel_directions": [], "calibrate": False},
    "dma": {"kernel_directions": [], "staging_bytes": 0, "calibrate": False},
    "kernel": {"kernel_directions": ["load", "store"], "kernel_max_segment_bytes": "1GiB", "kernel_min_segments": 1,
               "staging_bytes": 0, "calibrate": False},
}
MAX_BLOCK_BYTES = 8 << 20
MATMUL_N = 8192
POOL_FACTOR = 4  # scattered ids come from pools this many times the job's blocks


def num_layers(segment: int) -> int:
    """32 layers (K and V each) while a block stays within MAX_BLOCK_BYTES, fewer for huge segments."""
    return max(1, min(32, MAX_BLOCK_BYTES // (2 * segment)))


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


def make_kv(layout: str, segment: int, layers: int, blocks: int, dtype: torch.dtype = torch.uint8,
            inner: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """Per-layer views as vLLM hands them: `layer_compact` one [2, blocks, ...] region per layer (K/V first,
    FlashAttention's shape); `block_outermost` one allocation [blocks, layers, 2, ...] (BLHNC) seen per layer."""
    inner = inner if inner is not None else (segment // torch.empty(0, dtype=dtype).element_size(),)
    if layout == "layer_compact":
        whole = torch.randint(0, 256, (layers, 2, blocks, *inner), dtype=torch.uint8, device="cuda").view(dtype) \
            if dtype == torch.uint8 else torch.randn(layers, 2, blocks, *inner, device="cuda").to(dtype)
        return {f"l{i}": whole[i] for i in range(layers)}
    whole = torch.randint(0, 256, (blocks, layers, 2, *inner), dtype=torch.uint8, device="cuda") \
        if dtype == torch.uint8 else torch.randn(blocks, layers, 2, *inner, device="cuda").to(dtype)
    return {f"l{i}": whole[:, i] for i in range(layers)}


def make_worker(kv: dict[str, torch.Tensor], gpu_blocks: int, cpu_blocks: int, policy: str,
                extra: dict | None = None) -> OffloadWorker:
    transfer = {"backend": "cuda", **POLICIES[policy], **(extra or {})}
    worker = OffloadWorker(load_config({"num_cpu_blocks": cpu_blocks, "transfer": transfer}))
    worker.register_kv_caches(kv, num_gpu_blocks=gpu_blocks)
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

    def finish(self) -> dict:
        self.worker.wait_all()
        report = self.worker.get_finished()
        if report.failed_store_events or report.failed_load_gpu_blocks:
            raise RuntimeError(f"copies failed: {report.failed_store_events} {report.failed_load_gpu_blocks[:8]}")
        return report

    def store_step(self, gpu: list[int], cpu: list[int]) -> None:
        self.worker.begin_step()
        self.store(gpu, cpu)
        self.finish()

    def load_step(self, gpu: list[int], cpu: list[int]) -> None:
        self.worker.begin_step()
        self.load(gpu, cpu)
        self.finish()


def describe_backend(worker: OffloadWorker) -> dict:
    b = worker.backend
    out = {"policy": b.policy.describe(), "jobs_by_path": {k: v for k, v in b.num_jobs_by_path.items() if v},
           "host_layout": worker.host_pool.layout, "planes": b.paths.geometry["store"].num_planes,
           "kernel_off_reason": b.kernel_off_reason, "staged_off_reason": b.staged_off_reason, "pinned": b.pinned}
    if b.calibration:
        out["calibration"] = [{k: (round(v * 1e6, 1) if k.endswith("_s") else v) for k, v in
                               ((f, getattr(m, f)) for f in m.__slots__)} for m in b.calibration]
    return out


def contiguous_copy(nbytes: int, reps: int) -> tuple[float, float]:
    """Seconds of a pinned-host <-> device copy_ of `nbytes` (d2h, h2d)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    d2h = best_gpu_seconds(reps, lambda: host.copy_(dev, non_blocking=True))
    h2d = best_gpu_seconds(reps, lambda: dev.copy_(host, non_blocking=True))
    return d2h, h2d


def sweep_size(segment: int, batch_bytes: int, reps: int, rng: random.Random) -> dict:
    layers = num_layers(segment)
    block = 2 * layers * segment
    n = max(1, batch_bytes // block)
    pool = POOL_FACTOR * -(-n // 16) * 16 + 1
    d2h, h2d = contiguous_copy(n * block, reps)
    gb = n * block / 1e9
    out: dict = {"layers": layers, "block_bytes": block, "num_blocks": n, "pool_blocks": pool,
                 "d2h_copy_gbps": round(gb / d2h, 2), "h2d_copy_gbps": round(gb / h2d, 2)}
    ids = {p: (id_pattern(p, n, pool, rng), id_pattern(p, n, pool, rng)) for p in ("runs", "scattered")}
    for layout in LAYOUTS:
        kv = make_kv(layout, segment, layers, pool)
        per_layout: dict = {}
        for policy in POLICIES:
            try:
                worker = make_worker(kv, pool, pool, policy)
            except Exception as exc:
                per_layout[policy] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            jobs = Jobs(worker)
            row: dict = {}
            try:
                for pattern, (gpu, cpu) in ids.items():
                    store_s = best_gpu_seconds(reps, lambda j=jobs, g=gpu, c=cpu: j.store_step(g, c))
                    load_s = best_gpu_seconds(reps, lambda j=jobs, g=gpu, c=cpu: j.load_step(g, c))
                    row[pattern] = {"store_gbps": round(gb / store_s, 2), "load_gbps": round(gb / load_s, 2),
                                    "store_vs_copy": round(d2h / store_s, 3), "load_vs_copy": round(h2d / load_s, 3)}
                row.update(describe_backend(worker))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                worker.shutdown()
            per_layout[policy] = row
        out[layout] = per_layout
        del kv
        torch.cuda.empty_cache()
    return out


class Matmuls:
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


SLOWDOWN_CASES = {  # name: (layout, policy, extra transfer keys)
    "staged": ("layer_compact", "staged", {}),
    "staged_8ctas": ("layer_compact", "staged", {"staging_max_sms": 8}),
    "staged_32ctas": ("layer_compact", "staged", {"staging_max_sms": 32}),
    "dma": ("layer_compact", "dma", {}),
    "kernel": ("layer_compact", "kernel", {}),
    "default": ("layer_compact", "default", {}),
    "block_outermost_dma": ("block_outermost", "dma", {}),
    "block_outermost_default": ("block_outermost", "default", {}),
}


def forward_slowdown(batch_bytes: int, reps: int, rng: random.Random, repeat: int = 16, rounds: int = 9) -> dict:
    """How much a matmul loop on the compute stream slows while stores and loads of scattered 32 KiB
    segments run (`repeat` jobs each way, submitted before the loop), per path: in `rounds` adjacent pairs
    (the loop alone, then beside the copies), the median of the pairs' ratios (GPU clocks drift between
    pairs, not within one)."""
    segment = 32 << 10
    layers = num_layers(segment)
    block = 2 * layers * segment
    n = max(1, batch_bytes // block)
    pool = 2 * POOL_FACTOR * n + 1
    gpu, cpu = rng.sample(range(1, pool), 2 * n), rng.sample(range(1, pool), 2 * n)
    store_ids, load_ids = (gpu[:n], cpu[:n]), (gpu[n:], cpu[n:])  # disjoint on both tiers, as the scheduler keeps them
    mm = Matmuls()
    mm.seconds(200)  # warm-up: cuBLAS handle, kernel selection, clocks up
    one_matmul_s = mm.seconds(20) / 20
    out: dict = {"segment_bytes": segment, "layers": layers, "num_blocks": n, "jobs_each_way": repeat,
                 "rounds": rounds, "matmul": f"{MATMUL_N}x{MATMUL_N} bf16", "one_matmul_ms": round(one_matmul_s * 1e3, 3)}
    try:  # the floor: what plain copies of the same bytes cost the same loop
        out["contiguous_copy"] = copy_floor(n * block, mm, one_matmul_s, rounds, repeat)
    except Exception as exc:
        out["contiguous_copy"] = {"error": f"{type(exc).__name__}: {exc}"}
    kvs = {layout: make_kv(layout, segment, layers, pool) for layout in LAYOUTS}
    for name, (layout, policy, extra) in SLOWDOWN_CASES.items():
        try:
            out[name] = slowdown_case(kvs[layout], pool, policy, extra, store_ids, load_ids, mm, one_matmul_s,
                                      rounds, repeat, n * block)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    floor = out["contiguous_copy"].get("matmul_slowdown")
    if floor:
        for name in SLOWDOWN_CASES:
            if "matmul_slowdown" in out[name]:
                out[name]["matmul_slowdown_over_copy"] = round(out[name]["matmul_slowdown"] / floor, 4)
    return out


def slowdown_case(kv: dict[str, torch.Tensor], pool: int, policy: str, extra: dict,
                  store_ids: tuple[list[int], list[int]], load_ids: tuple[list[int], list[int]], mm: Matmuls,
                  one_matmul_s: float, rounds: int, repeat: int, job_bytes: int) -> dict:
    worker = make_worker(kv, pool, pool, policy, extra)
    jobs = Jobs(worker)
    try:
        jobs.store(*load_ids)  # the host blocks the loads read hold something
        jobs.finish()

        def copies() -> None:
            worker.begin_step()
            for _ in range(repeat):
                jobs.store(*store_ids)
                jobs.load(*load_ids)

        row = beside_matmuls(copies, jobs.finish, mm, one_matmul_s, rounds, 2 * repeat * job_bytes)
        return {**row, **describe_backend(worker)}
    finally:
        worker.shutdown()


class ContiguousCopies:
    """The floor of `forward_slowdown`: the same bytes as plain `copy_` calls between one pinned host buffer
    and one device buffer per direction, stores (device to host) and loads (host to device) each on its own
    side stream, no code of ours. Whatever any copy costs the forward (the DMA reads or writes HBM too)."""

    def __init__(self, job_bytes: int) -> None:
        self.host = [torch.empty(job_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.dev = [torch.randint(0, 256, (job_bytes,), dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())  # (pool streams: they never wait on the compute stream)
        torch.cuda.synchronize()

    def submit(self, repeat: int) -> None:
        for _ in range(repeat):
            with torch.cuda.stream(self.streams[0]):
                self.host[0].copy_(self.dev[0], non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.dev[1].copy_(self.host[1], non_blocking=True)

    def finish(self) -> None:
        for stream in self.streams:
            stream.synchronize()


def copy_floor(job_bytes: int, mm: Matmuls, one_matmul_s: float, rounds: int, repeat: int) -> dict:
    """`beside_matmuls` for `ContiguousCopies` of `repeat` jobs of `job_bytes` each way (freed on return)."""
    copies = ContiguousCopies(job_bytes)
    return beside_matmuls(lambda: copies.submit(repeat), copies.finish, mm, one_matmul_s, rounds,
                          2 * repeat * job_bytes)


def beside_matmuls(copies: Callable[[], None], finish: Callable[[], object], mm: Matmuls, one_matmul_s: float,
                   rounds: int, total_bytes: int) -> dict:
    """`copies()` submits a step's copies, `finish()` waits for them. In `rounds` adjacent pairs (a matmul loop
    alone, then beside the copies, the order alternating), the median ratio of the loop's times
    (`matmul_slowdown`) and of the copies' wall times beside the loop and alone (`copy_slowdown`)."""
    copies()
    finish()
    t0 = time.perf_counter()
    copies()
    submit_s = time.perf_counter() - t0
    finish()
    torch.cuda.synchronize()
    copy_alone = time.perf_counter() - t0
    # the loop starts once the copies are submitted and ends before they would end alone
    k = max(4, round(0.8 * (copy_alone - submit_s) / one_matmul_s))
    ratios, copy_ratio = [], []

    def alone() -> float:
        mm.launch(2)  # untimed: the clocks are up when the timed loop starts, as beside the copies
        return mm.seconds(k)

    def together() -> float:  # copies first: their fences precede the loop, which then runs beside them
        t0 = time.perf_counter()
        copies()
        start, end = mm.launch(k)
        finish()
        copy_ratio.append((time.perf_counter() - t0) / copy_alone)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    for r in range(rounds):  # the pair's order alternates: drift within a pair cancels over the rounds
        if r % 2 == 0:
            a = alone()
            ratios.append(together() / a)
        else:
            t = together()
            ratios.append(t / alone())
    return {"matmuls": k, "matmul_slowdown": round(statistics.median(ratios), 4),
            "matmul_slowdown_range": [round(min(ratios), 4), round(max(ratios), 4)],
            "copies_alone_ms": round(copy_alone * 1e3, 3), "copies_gbps_alone": round(total_bytes / 1e9 / copy_alone, 2),
            "submit_ms": round(submit_s * 1e3, 3), "copy_slowdown": round(statistics.median(copy_ratio), 3)}


SUBMIT_CASES = {"1": (32 << 10, 1), "8": (32 << 10, 8), "64": (32 << 10, 64), "4KiB_512": (4 << 10, 512)}


def submit_cost(reps: int, rng: random.Random) -> dict:
    """Host time on the engine thread per `start_store` / `start_load` call, layer-compact cache of 32 layers:
    32 KiB segments (Llama-8B-shaped, 2 MiB blocks) for 1, 8 and 64 blocks, and 4 KiB segments for 512
    blocks (both 128 MiB at the largest), scattered ids; median of `reps`. `*_us`: the whole call;
    `*_first_us`: from the call to the entry of its first copy call into the runtime (a store's first
    gather or kernel launch or DMA, a load's first DMA or launch): our Python and the driver calls before it,
    the time the copy engines wait for the host."""
    from bench_host_time import FirstCopyClock  # benchmarks/, on the path as this file is

    out: dict = {policy: {} for policy in ("default", "dma")}
    for segment in sorted({seg for seg, _ in SUBMIT_CASES.values()}, reverse=True):
        cases = {name: n for name, (seg, n) in SUBMIT_CASES.items() if seg == segment}
        blocks = POOL_FACTOR * max(cases.values()) + 1
        kv = make_kv("layer_compact", segment, 32, blocks)
        for policy, row in out.items():
            worker = make_worker(kv, blocks, blocks, policy)
            jobs, clock = Jobs(worker), FirstCopyClock(worker.backend.rt)
            try:
                for name, n in cases.items():
                    times: dict[str, list[float]] = {k: [] for k in ("store_us", "load_us", "store_first_us",
                                                                     "load_first_us")}
                    for _ in range(reps):
                        gpu, cpu = rng.sample(range(1, blocks), n), rng.sample(range(1, blocks), n)
                        for kind in ("store", "load"):
                            worker.begin_step()
                            clock.reset()
                            t0 = time.perf_counter()
                            getattr(jobs, kind)(gpu, cpu)
                            times[f"{kind}_us"].append((time.perf_counter() - t0) * 1e6)
                            if clock.first_at is not None:
                                times[f"{kind}_first_us"].append((clock.first_at - t0) * 1e6)
                            jobs.finish()
                    row[name] = {k: round(statistics.median(v), 1) for k, v in times.items() if v}
                row["policy"] = worker.backend.policy.describe()
            finally:
                worker.shutdown()
        del kv
        torch.cuda.empty_cache()
    return out


def round_trip(rounds: int, seed: int) -> dict:
    """Random jobs through the default configuration on a 32-layer Llama-8B-shaped cache, byte-checked."""
    rng = random.Random(seed)
    blocks, out = 512, {}
    for layout in LAYOUTS:
        kv = make_kv(layout, 0, 32, blocks, torch.bfloat16, (16, 8, 128))
        dim = 1 if layout == "layer_compact" else 0  # the block dim of each layer's view

        def gather(ids: list[int], kv=kv, dim=dim) -> list[torch.Tensor]:
            index = torch.tensor(ids, device="cuda")
            return [t.index_select(dim, index).movedim(dim, 0).reshape(len(ids), -1).view(torch.int16)
                    for t in kv.values()]

        worker = make_worker(kv, blocks, blocks, "default")
        jobs, checked, wrong = Jobs(worker), 0, 0
        try:
            for _ in range(rounds):
                n = rng.randint(1, 64)
                gpu, targets = rng.sample(range(1, blocks), n), rng.sample(range(1, blocks), n)
                cpu = rng.sample(range(1, blocks), n)
                before = gather(gpu)
                jobs.store_step(gpu, cpu)
                for t in kv.values():  # clobber every block: each bf16 changes sign (randn has no zeros)
                    t.neg_()
                jobs.load_step(targets, cpu)
                after = gather(targets)
                bad = torch.zeros(n, dtype=torch.bool, device="cuda")
                for a, b in zip(after, before, strict=True):
                    bad |= (a != b).any(dim=1)
                checked += n
                wrong += int(bad.sum())
            out[layout] = {"rounds": rounds, "blocks_checked": checked, "blocks_wrong": wrong,
                           **describe_backend(worker)}
        finally:
            worker.shutdown()
        del kv
        torch.cuda.empty_cache()
    return out


def dma_pieces(batch_bytes: int, reps: int, rng: random.Random) -> dict:
    """One batched DMA call of scattered pieces, on one stream and split over two, against copy_."""
    from worker_side.backends.cuda.runtime import TorchCudaRuntime

    rt = TorchCudaRuntime()
    pool_bytes = POOL_FACTOR * batch_bytes
    host = torch.empty(pool_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, device="cuda")
    streams = [rt.create_stream(low_priority=False) for _ in range(2)]
    d2h, h2d = contiguous_copy(batch_bytes, reps)
    out: dict = {"d2h_copy_gbps": round(batch_bytes / d2h / 1e9, 2), "h2d_copy_gbps": round(batch_bytes / h2d / 1e9, 2)}
    for piece in (64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20):
        n = batch_bytes // piece
        slots = pool_bytes // piece
        hs = np.array(rng.sample(range(slots), n), np.int64) * piece + host.data_ptr()
        ds = np.array(rng.sample(range(slots), n), np.int64) * piece + dev.data_ptr()
        sizes = np.full(n, piece, np.int64)
        row = {}
        for name, split in (("one_stream", 1), ("two_streams", 2)):
            for kind, (dst, src) in (("d2h", (hs, ds)), ("h2d", (ds, hs))):
                def run(dst=dst, src=src, split=split, n=n, sizes=sizes) -> None:
                    for i in range(split):
                        sl = slice(i * n // split, (i + 1) * n // split)
                        rt.memcpy_batch(dst[sl], src[sl], sizes[sl], streams[i])
                s = best_gpu_seconds(reps, run)
                row[f"{kind}_{name}_vs_copy"] = round((d2h if kind == "d2h" else h2d) / s, 3)
        out[f"{piece >> 10}KiB"] = row
    return out


def section(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def summarize(sweep: dict) -> dict:
    """The smallest default-vs-copy ratio over sizes, layouts and directions, scattered ids (and runs)."""
    out = {}
    for pattern in ("scattered", "runs"):
        ratios = []
        for name, row in sweep.items():
            for layout in LAYOUTS:
                r = row.get(layout, {}).get("default", {}).get(pattern)
                if r:
                    ratios += [(r["store_vs_copy"], f"{name} {layout} store"), (r["load_vs_copy"], f"{name} {layout} load")]
        if ratios:
            out[f"min_default_vs_copy_{pattern}"] = min(ratios)
    return out


def bench_cuda(batch_bytes: int, reps: int, seed: int) -> dict:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    result: dict = {"backend": "cuda", "device": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
                    "date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
                    "torch_cuda": torch.version.cuda, "batch_mib": batch_bytes >> 20, "reps": reps}
    result["dma_pieces"] = section(lambda: dma_pieces(batch_bytes, reps, rng))
    sweep = {}
    for name, segment in SEGMENTS.items():
        sweep[name] = section(lambda segment=segment: sweep_size(segment, batch_bytes, reps, rng))
    result["sweep"] = sweep
    result["summary"] = summarize(sweep)
    result["forward_slowdown"] = section(lambda: forward_slowdown(batch_bytes, reps, rng))
    result["submit_us"] = section(lambda: submit_cost(9, rng))
    result["round_trip"] = section(lambda: round_trip(40, seed))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
