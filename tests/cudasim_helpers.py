"""Running the fake engine through the CUDA backend on the simulated device (worker_side.testing.cuda_sim)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload_connector import load_config
from offload_connector.fake_engine import FakeEngine, IntegrityError
from offload_connector.fake_engine.workload import random_workload, run_workload, small_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker
from worker_side.backends.cuda.backend import CudaBackend
from worker_side.testing.cuda_sim import SCHEDULES, SimCudaRuntime
from worker_side.testing.sim_compute import SimCompute


@dataclass
class SimRun:
    engine: FakeEngine
    rt: SimCudaRuntime
    aborted: set[str]


def sim_case(seed: int) -> dict:
    """A varied case per seed: schedule, pool sizes, store policy, kernel or DMA, waiting or polling."""
    return dict(schedule=SCHEDULES[seed % 4], num_gpu_blocks=14 + seed % 5 * 3, num_cpu_blocks=6 + seed % 7 * 5,
                store_policy="lazy" if seed % 2 else "eager", eviction="arc" if seed % 5 == 0 else "lru",
                kernel_max_segment_bytes=(0, 64, 1 << 20)[seed // 3 % 3], wait_for_loads=seed % 4 == 3,
                burst=1 + seed % 4, num_streams=1 if seed % 11 == 0 else 2,
                ring_entries=64 if seed % 4 == 1 else 1 << 16,  # a small ring wraps: argument reuse is exercised
                # the staged path on a third of the seeds: 1-block slots (many chunks, slots reused within a job)
                # or 16-block slots (8 slots in all; the fake engine's blocks are 256 bytes)
                staging_bytes=(0, 0, 8 * 256, 0, 0, 8 * 16 * 256)[seed % 6])


def run_on_sim(seed: int, schedule: str, num_gpu_blocks: int, num_cpu_blocks: int, store_policy: str = "eager",
               eviction: str = "lru", kernel_max_segment_bytes: int = 64, wait_for_loads: bool = False,
               burst: int = 3, num_streams: int = 2, num_requests: int = 24, abort_fraction: float = 0.15,
               tp_size: int = 1, ring_entries: int = 1 << 16, staging_bytes: int = 0, **sim_options) -> SimRun:
    """One seeded random workload through the fake engine, one simulated GPU per tensor-parallel rank."""
    rt = SimCudaRuntime(num_devices=tp_size, schedule=schedule, seed=seed, burst=burst, **sim_options)
    backends = [CudaBackend(num_streams=num_streams, runtime=rt, kernel_max_segment_bytes=kernel_max_segment_bytes,
                            ring_entries=ring_entries, staging_bytes=staging_bytes) for _ in range(tp_size)]
    computes = [SimCompute(rt, device) for device in range(tp_size)]
    cfg = small_config(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, store_policy=store_policy,
                       eviction=eviction)
    wl = random_workload(seed, num_requests=num_requests, abort_fraction=abort_fraction)
    with FakeEngine(cfg, backend=backends if tp_size > 1 else backends[0], wait_for_loads=wait_for_loads,
                    compute=computes if tp_size > 1 else computes[0], tp_size=tp_size) as engine:
        aborted = run_workload(engine, wl)
    return SimRun(engine, rt, aborted)


def caught(seeds: range, **overrides) -> list[int]:
    out = []
    for seed in seeds:
        try:
            run = run_on_sim(seed, **{**sim_case(seed), **overrides})
            if run.engine.stats.integrity_errors:
                out.append(seed)
        except IntegrityError:
            out.append(seed)
    return out


def slots_swapped_on_sim(seed: int, steps: Callable[[OffloadWorker], None]) -> tuple[bool, int]:
    """On a simulated GPU whose schedule lets copies queue up (`copy_lag`, `seed`): GPU blocks 1, 2 are stored
    into host slots 3, 4, then `steps(w)` loads those slots into GPU blocks 7, 8 and stores other blocks into
    them, in whatever steps it likes. Returns (blocks 7, 8 got 1, 2's bytes, stores the worker held for
    loads)."""
    rt = SimCudaRuntime(schedule="copy_lag", seed=seed)
    w = sim_worker(rt, make_kv(rt, "block_first"), num_gpu_blocks=12)
    views = w._views
    old = [[v.block_tensor(b).clone() for v in views] for b in (1, 2)]
    w.begin_step()
    w.start_store(TransferMetadata(store_event=0, store_gpu_blocks=[1, 2], store_cpu_blocks=[3, 4]))
    w.wait_all()
    w.get_finished()
    steps(w)
    w.wait_all()
    w.get_finished()
    got = [[v.block_tensor(b) for v in views] for b in (7, 8)]
    right = all(torch.equal(a, b) for x, y in zip(got, old, strict=True) for a, b in zip(x, y, strict=True))
    w.shutdown()
    if rt.faults:
        raise AssertionError(f"simulated device faults: {rt.faults}")
    return right, w.num_stores_held_for_loads


def sim_worker(rt: SimCudaRuntime, kv: dict[str, torch.Tensor], num_gpu_blocks: int, layout: str | None = None,
               rank: int = 0, **backend_options) -> OffloadWorker:
    w = OffloadWorker(load_config({"num_cpu_blocks": 40}), world_size=rank + 1, rank=rank,
                      backend=CudaBackend(runtime=rt, **backend_options))
    w.register_kv_caches(kv, num_gpu_blocks=num_gpu_blocks, layout=layout)
    return w


def round_trip(rt: SimCudaRuntime, w: OffloadWorker, kv: dict[str, torch.Tensor], gpu: list[int], cpu: list[int],
               targets: list[int]) -> None:
    """Store gpu -> cpu, clobber, load cpu -> targets; the target blocks must equal the stored ones."""
    views = w._views
    before = [[v.block_tensor(b) for v in views] for b in gpu]
    w.begin_step()
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=gpu, store_cpu_blocks=cpu))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    for t in kv.values():
        t.view(torch.uint8).fill_(0x5A)
    w.begin_step()
    w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=targets, load_cpu_blocks=cpu,
                                  load_event_reqs=["r"]))
    w.wait_all()
    report = w.get_finished()
    assert report.finished_load_reqs == ["r"] and not report.failed_load_gpu_blocks
    for b, t in zip(range(len(gpu)), targets, strict=True):
        assert all(torch.equal(v.block_tensor(t), before[b][i]) for i, v in enumerate(views)), (b, t)
    assert rt.faults == []


def random_fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return t


# (layout hint, logical shape, physical order of a [B, H, N, C] view or None) for 12 GPU blocks
LAYOUTS = {
    "block_first": (None, (12, 2, 4, 2, 8), None),
    "kv_first": (None, (2, 12, 4, 2, 8), None),
    "kernel_blocks": (None, (24, 2, 2, 8), None),  # 2 kernel rows per block
    **{name: (name, (12, 2, 4, 16), order) for name, order in
       {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "LHBNC": (1, 0, 2, 3), "BLHNC": (0, 1, 2, 3),
        "BLNHC": (0, 2, 1, 3), "BHLNC": (1, 0, 2, 3)}.items()},
}


def make_kv(rt: SimCudaRuntime, layout: str, device: int = 0, num_layers: int = 3) -> dict[str, torch.Tensor]:
    _, shape, order = LAYOUTS[layout]
    kv = {}
    for i in range(num_layers):
        if order is None:
            kv[f"l{i}"] = random_fill(rt.alloc_device(shape, torch.float16, device), i)
        else:
            physical = rt.alloc_device(tuple(shape[d] for d in order), torch.float16, device)
            kv[f"l{i}"] = random_fill(physical, i).permute(*[order.index(d) for d in range(4)])
    return kv


# vLLM's KVCacheLayout stride orders over the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
VLLM_STRIDE_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                      "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def vllm_allocation(rt: SimCudaRuntime, layout: str, num_layers: int = 4, num_blocks: int = 12, heads: int = 2,
                    tokens: int = 4, content: int = 16, dtype: torch.dtype = torch.float16,
                    device: int = 0) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of ONE allocation in `layout`'s physical order, as vLLM 0.32 builds them
    (`get_kv_cache_config_from_groups`: a block-outermost layout puts every layer of a block in one range).
    MLA: heads=1, content = the latent's width."""
    order = VLLM_STRIDE_ORDERS[layout]
    logical = (num_layers, num_blocks, heads, tokens, content)
    physical = random_fill(rt.alloc_device(tuple(logical[d] for d in order), dtype, device), 99)
    view = physical.permute(*[order.index(d) for d in range(5)])  # logical [L, B, H, N, C]
    return {f"layers.{i}.attn": view[i] for i in range(num_layers)}
