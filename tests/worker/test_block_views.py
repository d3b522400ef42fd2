"""`tensor_block_view`: which dim of a KV tensor is the block dim, where each block's chunks lie, and the
tensors it refuses (ambiguous, overlapping, empty), each error naming the tensor."""

from __future__ import annotations

import pytest
import torch

from worker_side import LayoutError
from worker_side.block_layout import _byte_view, tensor_block_view

NUM_GPU_BLOCKS = 16


@pytest.mark.parametrize("shape, num_gpu_blocks, layout, num_blocks, chunks, chunk_elems", [
    ((12, 4, 8), 12, None, 12, 1, 32),  # block-first, found by its size
    ((2, 5, 8), 2, None, 2, 1, 40),  # two blocks, and no K/V dim of 2 blocks after the first
    ((24, 12), 12, None, 12, 1, 24),  # kernel blocks: 2 rows per block, whatever the other dims hold
    ((2, 24, 8), 12, None, 12, 2, 16),  # K/V-first with kernel blocks
    ((2, 12, 8), 12, "kv_first", 12, 2, 8),  # K/V-first, 3D
])
def test_the_block_dim_is_found_from_the_block_count(shape, num_gpu_blocks, layout, num_blocks, chunks, chunk_elems):
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    view = tensor_block_view("l", torch.zeros(shape), num_gpu_blocks, layout)
    assert (view.num_blocks, view.num_chunks, view.chunk_bytes) == (num_blocks, chunks, chunk_elems * 4)


@pytest.mark.parametrize("shape, num_gpu_blocks, layout, match", [
    ((2, 12), None, "kv_first", "kv_first needs shape"),  # a K/V dim, but nothing inside the blocks
    ((3, 12, 8), None, "kv_first", "kv_first needs shape"),
    ((7, 4), 5, None, "no block dim of size num_gpu_blocks=5"),
    ((2, 4, 8), 1, None, "is ambiguous"),  # both dims are multiples of one block
    ((2, 2, 8), 2, None, "is ambiguous"),  # two blocks, or K/V of two blocks
    ((12, 4), None, 42, "unknown KV cache layout hint 42"),  # neither a name nor an enum member
])
def test_layouts_that_cannot_be_told_apart_are_refused(shape, num_gpu_blocks, layout, match):
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    with pytest.raises(LayoutError, match=match):
        tensor_block_view("l", torch.zeros(shape), num_gpu_blocks, layout)



def test_a_view_keeps_its_name_and_refuses_empty_blocks_naming_the_tensor():
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    assert tensor_block_view("layer.3", torch.zeros(NUM_GPU_BLOCKS, 8)).name == "layer.3"
    with pytest.raises(LayoutError, match="'layer.3': need a non-empty"):
        tensor_block_view("layer.3", torch.zeros(NUM_GPU_BLOCKS, 0))
    with pytest.raises(LayoutError, match="'layer.4': layout kv_first"):
        tensor_block_view("layer.4", torch.zeros(3, NUM_GPU_BLOCKS, 8), layout="kv_first")


def strided(shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(4096).as_strided(shape, strides)


def test_views_accept_dense_blocks_whatever_the_strides_of_size_1_dims():
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    assert tensor_block_view("x", torch.zeros(NUM_GPU_BLOCKS, 8).unsqueeze(1)).chunk_bytes == 32
    one = tensor_block_view("x", strided((1, 8), (4, 1)))  # one block: its stride is never used
    assert (one.num_blocks, one.chunk_bytes, one.chunk_offsets.tolist()) == (1, 32, [0])


def test_views_place_every_chunk_of_several_outer_dims():
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    view = tensor_block_view("x", strided((NUM_GPU_BLOCKS, 2, 2, 8), (8, 128, 256, 1)), layout="block_first")
    assert view.chunk_offsets.tolist() == [0, 512, 1024, 1536] and view.chunk_bytes == 32
    kv = tensor_block_view("x", strided((2, NUM_GPU_BLOCKS, 8), (128, 8, 1)), layout="kv_first")
    assert kv.chunk_offsets.tolist() == [0, 512]


@pytest.mark.parametrize(("shape", "strides", "layout"), [
    ((2, 8), (4, 1), None),  # two blocks sharing bytes
    ((NUM_GPU_BLOCKS, 2, 4), (4, 4, 1), None),  # a dim stepping by the block stride
    ((2, NUM_GPU_BLOCKS, 8), (120, 8, 1), "kv_first"),  # V starts inside K's last block
    ((NUM_GPU_BLOCKS, 2, 2, 8), (8, 128, 200, 1), "block_first"),  # the second outer dim inside the first
])
def test_views_refuse_tensors_whose_blocks_share_bytes(shape, strides, layout):
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    with pytest.raises(LayoutError, match="overlap"):
        tensor_block_view("x", strided(shape, strides), layout=layout)


def test_a_byte_view_stays_on_the_tensors_device():
    """Found by mutation testing of worker_side/block_layout.py (docs/mutation.md)."""
    view = _byte_view(torch.empty(4, 8, device="meta"))
    assert view.device.type == "meta" and view.dtype == torch.uint8 and view.shape == (128,)
