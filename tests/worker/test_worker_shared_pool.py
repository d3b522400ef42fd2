"""One host pool for ranks whose KV is byte-identical (MLA's latent under TP): worker_side/shared_pool.py.

Two `OffloadWorker`s, ranks 0 and 1, register their KV caches at once (two threads, a barrier between
them as vLLM's TP group gives), each with identical KV as MLA ranks hold. Story: 1. both map one file,
whose name is gone once both mapped it; 2. a store on both ranks: rank 0 copies, rank 1 reports at once;
3. a load on both ranks brings every rank the stored bytes; the pool holds as many blocks as one rank's
`cpu_bytes` buys at TP 1.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from worker_helpers import block_bytes, load, store

from offload_connector import load_config
from worker_side import OffloadWorker
from worker_side.errors import HostPoolError
from worker_side.shared_pool import SharedPoolSpec


def identical_kv() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"l{i}": torch.randn(64, 16, 576, generator=g) for i in range(2)}  # MLA-like: one latent per token


def two_ranks(path: str, cpu_bytes: str = "4MiB") -> tuple[list[OffloadWorker], list[dict[str, torch.Tensor]]]:
    barrier = threading.Barrier(2)
    config = load_config({"cpu_bytes": cpu_bytes, "transfer": {"backend": "cpu"}})
    workers = [OffloadWorker(config, world_size=2, rank=r,
                             shared_pool=SharedPoolSpec(path, r, 2, lambda: barrier.wait(timeout=30)))
               for r in range(2)]
    kvs = [identical_kv() for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: workers[r].register_kv_caches(kvs[r], num_gpu_blocks=64), range(2)))
    return workers, kvs


def test_rank_0_stores_once_and_every_rank_loads_the_bytes(tmp_path) -> None:
    path = str(tmp_path / "pool")
    workers, kvs = two_ranks(path)
    # 1. one mapping, its name gone; the whole cpu_bytes in it: 4 MiB / 72 KiB blocks = 56, as at TP 1
    assert not os.path.exists(path)
    assert workers[0].host_pool.buffer.data_ptr() != workers[1].host_pool.buffer.data_ptr()  # two mappings
    assert [w.num_cpu_blocks for w in workers] == [(4 << 20) // (2 * 16 * 576 * 4)] * 2 == [56, 56]
    # 2. the store: rank 0 copies GPU blocks 3, 4 into CPU blocks 1, 2; rank 1 copies nothing
    for w in workers:
        w.start_store(store(0, [3, 4], [1, 2]))
    for w in workers:
        w.wait_all()
    reports = [w.get_finished() for w in workers]
    assert [r.completed_store_events for r in reports] == [[0], [0]]
    assert [r.bytes_stored for r in reports] == [2 * workers[0].bytes_per_block, 0]
    assert workers[1].host_pool[1].equal(block_bytes(kvs[0], 3))  # rank 1 sees rank 0's copy
    # 3. the load into GPU blocks 10, 11 on both ranks
    for w in workers:
        w.start_load(load(1, [10, 11], [1, 2], ["r"]))
    for w, kv in zip(workers, kvs, strict=True):
        assert w.get_finished().finished_load_reqs == ["r"]
        assert block_bytes(kv, 10).equal(block_bytes(kv, 3)) and block_bytes(kv, 11).equal(block_bytes(kv, 4))
        w.shutdown()


def test_a_file_already_there_is_refused(tmp_path) -> None:
    path = tmp_path / "pool"
    path.write_bytes(b"someone else's")
    spec = SharedPoolSpec(str(path), 0, 2, lambda: None)
    with pytest.raises(HostPoolError, match="could not create the shared host pool"):
        spec.allocate(4096)
    assert path.read_bytes() == b"someone else's"


def test_a_spec_needs_two_ranks_and_a_rank_among_them() -> None:
    with pytest.raises(ValueError, match="need 2\\+ ranks"):
        SharedPoolSpec("/nonexistent", 2, 2, lambda: None)
