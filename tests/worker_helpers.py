"""Small `OffloadWorker` stories' building blocks: a CPU worker (bare, or over a random KV cache), random
bytes, one-job metadata, polling."""

from __future__ import annotations

import time

import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker

NUM_GPU_BLOCKS = 64


def cpu_worker(num_cpu_blocks: int = 16, backend=None) -> OffloadWorker:
    """A CPU-backend worker with nothing registered yet."""
    return OffloadWorker(load_config({"num_cpu_blocks": num_cpu_blocks, "transfer": {"backend": "cpu"}}),
                         backend=backend)


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def make_worker(num_cpu_blocks: int = 32, backend=None) -> tuple[OffloadWorker, dict[str, torch.Tensor]]:
    w = OffloadWorker(load_config({"num_cpu_blocks": num_cpu_blocks, "transfer": {"backend": "cpu"}}),
                      backend=backend)
    g = torch.Generator().manual_seed(0)
    kv = {f"l{i}": torch.randn(NUM_GPU_BLOCKS, 2, 16, 8, generator=g).half() for i in range(2)}
    w.register_kv_caches(kv)
    return w, kv


def store(event: int, gpu: list[int], cpu: list[int]) -> TransferMetadata:
    return TransferMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=cpu)


def load(event: int, gpu: list[int], cpu: list[int], reqs: list[str]) -> TransferMetadata:
    return TransferMetadata(load_event=event, load_gpu_blocks=gpu, load_cpu_blocks=cpu, load_event_reqs=reqs)


def block_bytes(kv: dict[str, torch.Tensor], gpu_block_id: int) -> torch.Tensor:
    return torch.cat([t[gpu_block_id].reshape(-1).view(torch.uint8) for t in kv.values()])


def next_report(w: OffloadWorker):
    """Poll until something finished (held jobs make wait_all refuse to block forever)."""
    for _ in range(100_000):
        report = w.get_finished(wait_for_loads=False)
        if not report.is_empty:
            return report
        time.sleep(0.0005)
    raise TimeoutError("no job finished")
