"""The one INFO line each role of the connector logs at start-up (connector.py), and what it is built from."""

from __future__ import annotations

from typing import Any

from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.sizing import Capacity
from offload_connector.vllm import cpu_cores
from offload_connector.vllm.engine_setup import describe_config_source
from scheduler_side.tiers.registry import TIERS


def startup_line(role: str, extra: Any, config: Any, backend: str, capacity: Capacity, layout: str = "") -> str:
    """The one INFO line each role logs at start-up: where the config came from, what `transfer.backend`
    resolved to, the store and eviction policies, one rank's CPU tier in bytes, blocks and tokens, and the
    KV-cache layout (kv_layout.describe_layout), and the cores the plugin left to the model on vLLM's CPU
    build (cpu_cores.py), if it did."""
    requested = config.transfer.backend
    resolved = f"{requested} -> {backend}" if requested != backend else backend
    tiers = "".join(f"; {TIERS[name].describe(section)}" for name, section in lower_tier_sections(config))
    return (f"OffloadConnector {role}: config from {describe_config_source(extra)}; transfer.backend={resolved}, "
            f"store_policy={config.store_policy}, eviction={config.eviction}; CPU tier {capacity.describe()} "
            f"(block_size={capacity.block_size}){tiers}" + (f"; {layout}" if layout else "")
            + cpu_cores.startup_note())


def backend_in_this_process(requested: str) -> str:
    """What `transfer.backend` resolves to in this process (the workers resolve it the same way)."""
    from worker_side import BackendError, resolve_backend_name

    try:
        return resolve_backend_name(requested)
    except BackendError:
        return f"{requested} (no CUDA device in this process)"
