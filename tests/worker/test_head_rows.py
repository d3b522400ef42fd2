"""Per-head parts of a block (worker_side/tiers/head_rows.py): the same bytes whatever the TP.

A "model" of 4 KV heads over 2 layers is laid out as a TP 1 rank holds it and as the two ranks of TP 2
hold it (heads 0-1 and 2-3), in the fake engine's layout and in vLLM's per-layer views. Head g's part read
from the TP 1 pool equals head g's part read from the TP 2 rank holding it, and parts written into an
empty pool rebuild exactly the rank's block bytes.
"""

from __future__ import annotations

import pytest
import torch

from worker_side.block_layout import tensor_block_view
from worker_side.errors import LayoutError
from worker_side.host_pool import HostPool
from worker_side.tiers.head_rows import HeadRows
from worker_side.tiers.host_rows import HostRows

BLOCKS, TOKENS, HEADS, DIM, LAYERS = 5, 4, 4, 3, 2


def fake_engine_layer(kv: torch.Tensor, heads: slice) -> tuple[torch.Tensor, dict]:
    """(2, blocks, tokens, heads, dim), K/V first: the fake engine's (and FlashAttention's) layout."""
    return kv[:, :, :, heads].contiguous(), {"layout": "kv_first", "head_dim": 3}


def lbhnc_layer(kv: torch.Tensor, heads: slice) -> tuple[torch.Tensor, dict]:
    """vLLM's CPU view [B, H, N, 2*dim], dense: heads outermost inside a block."""
    t = torch.cat([kv[0], kv[1]], dim=-1)[:, :, heads].permute(0, 2, 1, 3).contiguous()
    return t, {"layout": "LBHNC"}


def lbnhc_layer(kv: torch.Tensor, heads: slice) -> tuple[torch.Tensor, dict]:
    """vLLM's LBNHC: logical [B, H, N, C] over memory [B, N, H, C]: tokens outside heads inside a block."""
    t = torch.cat([kv[0], kv[1]], dim=-1)[:, :, heads].contiguous()  # memory order [B, N, H, C]
    return t.permute(0, 2, 1, 3), {"layout": "LBNHC"}


def pool_of(model: list[torch.Tensor], make, heads: slice) -> HostPool:
    """A host pool holding every block of this rank's share (`heads`) of the model's layers."""
    views = []
    for i, kv in enumerate(model):
        tensor, hints = make(kv, heads)
        views.append(tensor_block_view(f"layer{i}", tensor, BLOCKS, hints["layout"], hints.get("head_dim")))
    pool = HostPool(views, BLOCKS + 1, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))
    rows = HostRows(pool)
    for b in range(BLOCKS):
        rows.write(b + 1, memoryview(torch.cat([v.block_tensor(b) for v in views]).numpy()))
    return pool


@pytest.mark.parametrize("make", [fake_engine_layer, lbhnc_layer, lbnhc_layer])
def test_a_heads_part_is_the_same_bytes_at_tp1_and_tp2(make) -> None:
    gen = torch.Generator().manual_seed(7)
    model = [torch.randn(2, BLOCKS, TOKENS, HEADS, DIM, generator=gen, dtype=torch.float32) for _ in range(LAYERS)]
    tp1 = HeadRows(pool_of(model, make, slice(0, 4)), 4)
    tp2 = [HeadRows(pool_of(model, make, slice(2 * r, 2 * r + 2)), 2) for r in range(2)]
    assert tp1.part_bytes == tp2[0].part_bytes == LAYERS * 2 * TOKENS * DIM * 4
    for cpu in range(1, BLOCKS + 1):
        whole = tp1.read_parts(cpu)
        for g in range(HEADS):
            assert whole[g].tobytes() == tp2[g // 2].read_parts(cpu)[g % 2].tobytes()
        assert len({whole[g].tobytes() for g in range(HEADS)}) == HEADS  # distinct heads: a swap would show


@pytest.mark.parametrize("make", [fake_engine_layer, lbhnc_layer, lbnhc_layer])
def test_parts_written_from_another_tp_rebuild_the_ranks_block(make) -> None:
    gen = torch.Generator().manual_seed(8)
    model = [torch.randn(2, BLOCKS, TOKENS, HEADS, DIM, generator=gen, dtype=torch.float32) for _ in range(LAYERS)]
    tp1_pool = pool_of(model, make, slice(0, 4))
    tp1 = HeadRows(tp1_pool, 4)
    for r in range(2):
        want = pool_of(model, make, slice(2 * r, 2 * r + 2))
        got = pool_of([torch.zeros_like(kv) for kv in model], make, slice(2 * r, 2 * r + 2))
        rows = HeadRows(got, 2)
        for cpu in range(1, BLOCKS + 1):
            parts = tp1.read_parts(cpu)
            if cpu % 2:
                rows.write_parts(cpu, [memoryview(parts[2 * r + h]) for h in range(2)])
            else:
                for h in range(2):
                    rows.write_part(cpu, h, memoryview(parts[2 * r + h]))
            assert torch.equal(got[cpu], want[cpu])
    # and TP 2's parts rebuild the TP 1 block
    empty = pool_of([torch.zeros_like(kv) for kv in model], make, slice(0, 4))
    rows = HeadRows(empty, 4)
    for r in range(2):
        rank = HeadRows(pool_of(model, make, slice(2 * r, 2 * r + 2)), 2)
        for h in range(2):
            rows.write_part(3, 2 * r + h, memoryview(rank.read_parts(3)[h]))
    assert torch.equal(empty[3], tp1_pool[3])


def test_one_head_per_rank_is_the_whole_block_in_host_pool_order() -> None:
    model = [torch.arange(2 * BLOCKS * TOKENS * DIM, dtype=torch.float32).view(2, BLOCKS, TOKENS, 1, DIM)]
    pool = pool_of(model, fake_engine_layer, slice(0, 1))
    assert HeadRows(pool, 1).read_parts(2)[0].tobytes() == pool[2].numpy().tobytes()


def test_heads_not_inside_the_blocks_are_refused_with_the_tensor_named() -> None:
    kv = torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM)
    view = tensor_block_view("layer0", kv, BLOCKS, "kv_first")  # no head dim given: unknown
    pool = HostPool([view], BLOCKS + 1, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="layer0.*stored per rank"):
        HeadRows(pool, 4)
    lhbnc = torch.zeros(HEADS, BLOCKS, TOKENS, DIM).permute(1, 0, 2, 3)  # heads outside the blocks
    view = tensor_block_view("layer1", lhbnc, BLOCKS, "LHBNC")
    assert view.num_heads == 0
