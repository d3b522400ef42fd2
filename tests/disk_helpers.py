"""Helpers for the disk tier's tests: a real host pool, the tier's I/O on it, and record files."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
import torch

from offload_connector.disk.config import DiskConfig
from offload_connector.disk.directory import open_private_dir
from offload_connector.disk.format import Verifier, rank_dir_name, rank_fingerprint, record_name
from offload_connector.tier_identity import TierIdentity
from worker_side.block_layout import tensor_block_view
from worker_side.host_pool import HostPool
from worker_side.tiers.disk.io import DiskWorkerIO
from worker_side.tiers.disk.records import PoolSegments

IDENTITY = TierIdentity(model="test/model", dtype="float16", kv_cache_dtype="float16", block_size=16,
                          hash_algo="xxh3_128", layout="two layers, kv first")
OTHER_MODEL = TierIdentity(model="test/other-model", dtype="float16", kv_cache_dtype="float16", block_size=16,
                             hash_algo="xxh3_128", layout="two layers, kv first")


def make_pool(num_blocks: int = 16, block_size: int = 16, heads: int = 2, head_dim: int = 8) -> HostPool:
    """Two layers of K/V-first fp16 tensors: four planes per block."""
    views = [tensor_block_view(f"layer.{i}", torch.zeros(2, num_blocks, block_size, heads, head_dim,
                                                          dtype=torch.float16), num_gpu_blocks=num_blocks) for i in range(2)]
    return HostPool(views, num_blocks, available=None)


def fill(pool: HostPool, cpu_block_id: int, seed: int) -> bytes:
    """Write distinct bytes into one block's rows; returns them (HostPool order)."""
    rows = PoolSegments.from_pool(pool)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows.bytes_per_block,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    pos = 0
    for seg in rows.segments(cpu_block_id):
        seg[:] = data[pos:pos + len(seg)]
        pos += len(seg)
    return data


def block(pool: HostPool, cpu_block_id: int) -> bytes:
    return pool[cpu_block_id].numpy().tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(16, "big") + (0).to_bytes(4, "big")


def disk_config(path, **kw) -> DiskConfig:  # noqa: ANN001
    kw.setdefault("breaker_backoff_ms", 60000)
    kw.setdefault("breaker_max_backoff_ms", 60000)
    return DiskConfig(path=str(path), bytes=kw.pop("bytes", 1 << 30), max_inflight_bytes=kw.pop("max_inflight_bytes", 1 << 26),
                      **kw)


def make_io(path, pool: HostPool, identity: TierIdentity = IDENTITY, rank: int = 0, world_size: int = 1,
            auth_key: bytes | None = None, **kw) -> DiskWorkerIO:  # noqa: ANN001
    cfg = disk_config(path, **kw)
    root = open_private_dir(cfg.path)
    return DiskWorkerIO(cfg, root, rank_fingerprint(identity, rank, world_size), PoolSegments.from_pool(pool), auth_key)


def record_path(io: DiskWorkerIO, cache_key: bytes) -> str:
    return os.path.join(io.dir, record_name(cache_key))


def rank_dir(root, identity: TierIdentity = IDENTITY, rank: int = 0, world_size: int = 1) -> str:  # noqa: ANN001
    return os.path.join(str(root), rank_dir_name(rank_fingerprint(identity, rank, world_size)))


def verifier(identity: TierIdentity = IDENTITY, rank: int = 0, world_size: int = 1,
             auth_key: bytes | None = None) -> Verifier:
    return Verifier(rank_fingerprint(identity, rank, world_size), auth_key)


def run(io: DiskWorkerIO, kind: str, event: int, cpu_ids: list[int], keys: list[bytes], **kw):  # noqa: ANN201
    """Submit one job and wait for its result."""
    (io.submit_read if kind == "read" else io.submit_write)(event, cpu_ids, keys, **kw)
    if not io.wait_idle(30):
        raise TimeoutError(f"disk {kind} job {event} did not finish")
    results = io.poll()
    if len(results) != 1 or results[0].event_id != event:
        raise AssertionError(f"expected one result for event {event}, got {results}")
    return results[0]


@contextlib.contextmanager
def mounted(*args: str):
    """Run `mount args...`; skip the test when this process may not mount (root with CAP_SYS_ADMIN)."""
    target = args[-1]
    if os.geteuid() != 0 or subprocess.run(["mount", *args], capture_output=True).returncode != 0:
        pytest.skip("mounting needs root with CAP_SYS_ADMIN")
    try:
        yield
    finally:
        subprocess.run(["umount", target], check=True)
