"""A Mamba/SSM layer's KV-cache entry as one tensor of whole pages, so the worker copies it like any layer.

vLLM (0.32, align mode) registers a Mamba layer's state as a view into the same raw KV buffer as the
attention layers: block `b` of the layer owns one page of `page_bytes` (vLLM pads the state page to the
attention page), the states packed from the page's start. vLLM 0.32 passes an int8 view of the state
bytes (`(num_blocks, 1, 1, 10112)` with a block stride of the padded page); other versions and model
runners pass the state tensors themselves (e.g. the conv state `(num_blocks, 3, 160)` and the SSM state
`(num_blocks, 4, 32, 16)`). `state_page_view` returns, for either, a uint8 view `(num_blocks, 1, 1,
page_bytes)` over exactly those pages (the 4D shape every vLLM layout hint accepts), so the page of a
block is copied whole, padding included, and the layer slot that an attention layer of another group
overlays (the same bytes) is recognised as one by the worker and copied once.

Raises `LayoutError` naming the layer when the states do not fit that picture (a block dim that is not
first, different block strides, a state outside its page, a page not aligned to the buffer): the bytes
of a block are never guessed. Reads tensor metadata only; allocates no tensor memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker_side.errors import LayoutError


def state_page_view(name: str, entry: torch.Tensor | Sequence[torch.Tensor], num_gpu_blocks: int,
                    page_bytes: int) -> torch.Tensor:
    """The pages of layer `name` (vLLM's entry: a view of its state bytes, or its state tensors) as one
    uint8 tensor, see the module docstring."""
    states = [entry] if isinstance(entry, torch.Tensor) else list(entry)
    if not states or not all(isinstance(t, torch.Tensor) for t in states):
        raise LayoutError(f"Mamba layer {name!r}: KV-cache entry of type {type(entry).__name__}; allowed: a "
                          "tensor or a list/tuple of state tensors")
    storage = states[0].untyped_storage()
    base = storage.data_ptr()
    strides, starts, ends = set(), [], []
    for t in states:
        if t.untyped_storage().data_ptr() != base or t.dim() < 2 or t.shape[0] != num_gpu_blocks:
            raise LayoutError(f"Mamba layer {name!r}: state of shape {tuple(t.shape)}; allowed: views of one KV "
                              f"buffer with the block dim first ({num_gpu_blocks} blocks)")
        elem = t.element_size()
        strides.add(t.stride(0) * elem)
        extent = sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:], strict=True)) * elem + elem
        starts.append(t.data_ptr() - base)
        ends.append(t.data_ptr() - base + extent)
    if len(strides) != 1:
        raise LayoutError(f"Mamba layer {name!r}: its states have different block strides {sorted(strides)} bytes")
    block_stride, start = strides.pop(), min(starts)
    if start % page_bytes or max(ends) - start > page_bytes or block_stride < page_bytes:
        raise LayoutError(f"Mamba layer {name!r}: states at bytes [{start}, {max(ends)}) of a block with stride "
                          f"{block_stride}; allowed: inside one page of {page_bytes} bytes starting at a multiple "
                          "of the page size")
    if start + (num_gpu_blocks - 1) * block_stride + page_bytes > storage.nbytes():
        raise LayoutError(f"Mamba layer {name!r}: {num_gpu_blocks} pages of {page_bytes} bytes from byte {start} "
                          f"overrun its KV buffer of {storage.nbytes()} bytes")
    flat = torch.empty(0, dtype=torch.uint8, device=states[0].device).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat.as_strided((num_gpu_blocks, 1, 1, page_bytes), (block_stride, page_bytes, page_bytes, 1), start)
