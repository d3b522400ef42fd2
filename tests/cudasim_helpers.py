"""Running the fake engine through the CUDA backend on the simulated device (worker_side.cuda_sim)."""

from __future__ import annotations

from dataclasses import dataclass

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import random_workload, run_workload, small_config
from worker_side.cuda_backend import CudaBackend
from worker_side.cuda_sim import SCHEDULES, SimCompute, SimCudaRuntime


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
                ring_entries=64 if seed % 4 == 1 else 1 << 16)  # a small ring wraps: argument reuse is exercised


def run_on_sim(seed: int, schedule: str, num_gpu_blocks: int, num_cpu_blocks: int, store_policy: str = "eager",
               eviction: str = "lru", kernel_max_segment_bytes: int = 64, wait_for_loads: bool = False,
               burst: int = 3, num_streams: int = 2, num_requests: int = 24, abort_fraction: float = 0.15,
               tp_size: int = 1, ring_entries: int = 1 << 16, **sim_options) -> SimRun:
    """One seeded random workload through the fake engine, one simulated GPU per tensor-parallel rank."""
    rt = SimCudaRuntime(num_devices=tp_size, schedule=schedule, seed=seed, burst=burst, **sim_options)
    backends = [CudaBackend(num_streams=num_streams, runtime=rt, kernel_max_segment_bytes=kernel_max_segment_bytes,
                            ring_entries=ring_entries) for _ in range(tp_size)]
    computes = [SimCompute(rt, device) for device in range(tp_size)]
    cfg = small_config(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, store_policy=store_policy,
                       eviction=eviction)
    wl = random_workload(seed, num_requests=num_requests, abort_fraction=abort_fraction)
    with FakeEngine(cfg, backend=backends if tp_size > 1 else backends[0], wait_for_loads=wait_for_loads,
                    compute=computes if tp_size > 1 else computes[0], tp_size=tp_size) as engine:
        aborted = run_workload(engine, wl)
    return SimRun(engine, rt, aborted)
