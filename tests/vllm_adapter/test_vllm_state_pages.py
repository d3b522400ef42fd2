"""`state_page_view`: a Mamba layer's KV entry (vLLM 0.32's int8 view of the state bytes, or the state tensors)
as whole pages over the raw KV buffer, the same bytes as the attention layer overlaying the slot. No vLLM:
a raw buffer laid out the way vLLM 0.32's `allocate_kv_cache` lays one out (layer-outer, pages of 256 B)."""

from __future__ import annotations

import pytest
import torch

from offload_connector.vllm.state_pages import state_page_view
from worker_side.block_layout import tensor_block_view
from worker_side.errors import LayoutError

NUM_BLOCKS, PAGE = 6, 256  # bytes per page: the attention page (2 x 4 tokens x 8 float32), the state padded to it


def raw_buffer(num_pages: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.arange(num_pages * PAGE, dtype=torch.int32).to(torch.int8)


def views(buf: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The attention layer's view, the Mamba layer's state tensors (conv (3, 5) then SSM (2, 4) float32
    from the page's start) and vLLM 0.32's int8 view of those 92 state bytes, all over `buf`."""
    f32 = buf.view(torch.float32)
    attention = f32.as_strided((NUM_BLOCKS, 2, 4, 8), (PAGE // 4, 32, 8, 1))
    conv = f32.as_strided((NUM_BLOCKS, 3, 5), (PAGE // 4, 5, 1))
    ssm = f32.as_strided((NUM_BLOCKS, 2, 4), (PAGE // 4, 4, 1), 15)
    state_bytes = buf.as_strided((NUM_BLOCKS, 1, 1, 92), (PAGE, 92, 92, 1))
    return attention, [conv, ssm], state_bytes


@pytest.mark.parametrize("form", ["state tensors", "vLLM 0.32's int8 view"])
def test_a_state_entry_becomes_its_whole_pages_the_attention_views_bytes(form: str) -> None:
    buf = raw_buffer()
    attention, states, state_bytes = views(buf)
    pages = state_page_view("model.layers.0.mixer", states if form == "state tensors" else state_bytes,
                            NUM_BLOCKS, PAGE)
    assert pages.shape == (NUM_BLOCKS, 1, 1, PAGE) and pages.dtype == torch.uint8
    for b in range(NUM_BLOCKS):
        assert torch.equal(pages[b].flatten().view(torch.int8), buf[b * PAGE:(b + 1) * PAGE])
    # The worker keys a view by (base, block stride, block bytes): the same as the attention layer's, so the
    # slot's bytes are copied once, and under every vLLM layout hint (a 4D view).
    ours, theirs = tensor_block_view("m", pages, NUM_BLOCKS, "LBHNC"), tensor_block_view("a", attention, NUM_BLOCKS)
    assert (ours.base_ptr, ours.block_stride, ours.block_bytes) == (theirs.base_ptr, theirs.block_stride,
                                                                    theirs.block_bytes)


def test_a_second_layer_slot_starts_at_its_own_pages() -> None:
    buf = torch.zeros(2 * NUM_BLOCKS * PAGE, dtype=torch.int8)
    second = buf.as_strided((NUM_BLOCKS, 1, 1, 92), (PAGE, 92, 92, 1), NUM_BLOCKS * PAGE)
    pages = state_page_view("model.layers.2.mixer", second, NUM_BLOCKS, PAGE)
    assert pages.data_ptr() == buf.data_ptr() + NUM_BLOCKS * PAGE


def test_states_that_do_not_fit_one_page_per_block_are_refused_naming_the_layer() -> None:
    buf = raw_buffer(NUM_BLOCKS + 1)  # a spare page: a state overrunning its page stays inside the buffer
    f32 = buf.view(torch.float32)
    _, (conv, _), _ = views(buf)
    cases = [
        ([conv, f32.as_strided((NUM_BLOCKS, 2, 30), (PAGE // 4, 30, 1), 15)], "inside one page"),  # 300 B
        ([f32.as_strided((NUM_BLOCKS, 3, 5), (PAGE // 4, 5, 1), 1)], "starting at a multiple"),
        ([conv, f32.as_strided((NUM_BLOCKS, 2, 4), (PAGE // 8, 4, 1), 15)], "different block strides"),
        ([conv.transpose(0, 1)], "block dim first"),
        ([conv, torch.zeros(NUM_BLOCKS, 2, 4)], "views of one KV buffer"),
        ("conv", "a tensor or a list/tuple"),
    ]
    for entry, match in cases:
        with pytest.raises(LayoutError, match=r"Mamba layer 'model\.layers\.0\.mixer'.*" + match):
            state_page_view("model.layers.0.mixer", entry, NUM_BLOCKS, PAGE)
    short = raw_buffer()[:(NUM_BLOCKS - 1) * PAGE + 92].clone()  # the last page cut after its state bytes
    with pytest.raises(LayoutError, match="overrun its KV buffer"):
        state_page_view("model.layers.0.mixer", short.as_strided((NUM_BLOCKS, 1, 1, 92), (PAGE, 92, 92, 1)),
                        NUM_BLOCKS, PAGE)
