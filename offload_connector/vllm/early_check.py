"""What the vLLM plugin checks before the engine starts (plugin.py calls these around vLLM's
`EngineArgs.create_engine_config`), so that a mistake costs a second and one line, not an engine start-up:

- `check_engine_args(engine_args)`, before vLLM builds its config: vLLM's own CPU offload flags
  (`kv_offloading_size`, `kv_offloading_backend`) beside our connector are refused (vLLM would silently
  replace our connector by its own), and our config is parsed when our connector is selected directly
  (a `MultiConnector`'s children are parsed once vLLM's config exists).
- `check_capacity(vllm_config, config)`, once vLLM's config exists (model, block size, dtype, TP): the CPU
  tier must hold at least 2 blocks per rank of this model's KV cache (`model_kv_of`, from the model's
  config) and the pools of the ranks on this host must fit in its MemAvailable.

Every refusal is one `ConfigError` or `UnsupportedSetupError` naming the key, the value and what is
allowed. Imports vLLM only inside functions; allocates nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from offload_connector.config import OffloadConfig
from offload_connector.model_kv import DTYPE_BYTES, ModelConfigError, ModelKV, dtype_name
from offload_connector.sizing import capacity, check_host_memory, check_shared_memory, shm_free_bytes
from offload_connector.vllm.compat import hybrid_manager_on, is_mamba_hybrid, registered_module_path, uses_mla
from offload_connector.vllm.engine_setup import ranks_sharing_a_pool, resolve_config
from offload_connector.vllm.errors import UnsupportedSetupError

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "OffloadConnector"
MODULE_PATH = "offload_connector.vllm_connector"


def selects_ours(kv_connector: Any, module_path: Any) -> bool:
    """Whether a (kv_connector, kv_connector_module_path) pair names our connector: the module path, or the
    short name while vLLM's registry maps it to our module (the plugin registered it)."""
    if module_path:
        return module_path == MODULE_PATH
    return kv_connector == CONNECTOR_NAME and registered_module_path(CONNECTOR_NAME) == MODULE_PATH


def _our_extra_configs(ktc: Any) -> list[tuple[str, Any, bool]]:
    """(how ours is named, its kv_connector_extra_config, selected directly) for our connector selected
    directly or as a child of vLLM's `MultiConnector` (read from the raw `connectors` list)."""
    name, path, extra = ktc.kv_connector, ktc.kv_connector_module_path, ktc.kv_connector_extra_config or {}
    if selects_ours(name, path):
        return [(f"{name!r}" + (f" ({path})" if path else ""), extra, True)]
    children = extra.get("connectors") if name == "MultiConnector" and isinstance(extra, Mapping) else None
    found = []
    for child in children if isinstance(children, list) else ():
        if isinstance(child, Mapping) and selects_ours(child.get("kv_connector"), child.get("kv_connector_module_path")):
            path = child.get("kv_connector_module_path")
            found.append((f"{child.get('kv_connector')!r}" + (f" ({path})" if path else "") + " inside MultiConnector",
                          child.get("kv_connector_extra_config"), False))
    return found


def check_engine_args(engine_args: Any) -> None:
    """Before vLLM builds its config: refuse vLLM's offload flags beside our connector; parse our config
    when our connector is selected directly. Nothing to do when our connector is not selected."""
    ktc = engine_args.kv_transfer_config
    if ktc is None:
        return
    ours = _our_extra_configs(ktc)
    if not ours:
        return
    size, backend = engine_args.kv_offloading_size, engine_args.kv_offloading_backend
    if size is not None or backend not in (None, "native"):
        raise UnsupportedSetupError(
            f"OffloadConnector: vLLM's kv_offloading_size={size!r} (kv_offloading_backend={backend!r}) "
            f"{'would replace' if size is not None else 'asks for another CPU offload beside'} kv_connector "
            f"{ours[0][0]} with vLLM's own {_vllm_offload_connector(backend)}; allowed: one CPU offload: leave "
            "out --kv-offloading-size/--kv-offloading-backend and size this connector's tier with cpu_bytes in "
            f"kv_connector_extra_config (e.g. {{\"cpu_bytes\": \"{size if size is not None else 8:g}GiB\"}}), or "
            "leave out --kv-transfer-config")
    for _, extra, direct in ours:
        if direct:
            resolve_config(extra)


def _vllm_offload_connector(backend: str | None) -> str:
    """The connector vLLM's `_post_init_kv_transfer_config` puts in place for `kv_offloading_backend`."""
    if backend == "lmcache":
        return "LMCacheMPConnector"
    import os

    return "SimpleCPUOffloadConnector" if os.environ.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0") not in ("", "0") \
        else "OffloadingConnector"


def model_kv_of(vllm_config: Any) -> ModelKV:
    """The model's KV shape from vLLM's `ModelConfig` (the way vLLM's attention layers size their specs);
    raises `ModelConfigError` for models whose KV cache it cannot describe (attention-free, Mamba)."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if model.is_attention_free:
        raise ModelConfigError("architectures", model.architectures, "a model with attention layers")
    if is_mamba_hybrid(vllm_config):  # Mamba/SSM layers: vLLM sizes their state pages, not the config
        raise ModelConfigError("architectures", model.architectures, "a model without Mamba/SSM layers (a "
                               "hybrid's CPU tier is sized from vLLM's KV spec when the connector starts)")
    num_layers = int(model.get_num_layers_by_block_type(parallel, "attention"))
    if num_layers < 1:
        raise ModelConfigError("num_hidden_layers", num_layers, "a model with attention layers")
    mla = bool(model.use_mla)
    head_size = int(model.get_head_size())
    dtype = _kv_dtype(cache.cache_dtype, model.dtype)
    text = model.hf_text_config  # the model's own config: which fields it has depends on the model
    windows: tuple[int | None, ...] = ()
    window = getattr(text, "sliding_window", None)
    if window and not model.disable_sliding_window:
        layer_types = getattr(text, "layer_types", None)
        if isinstance(layer_types, list | tuple) and len(layer_types) == num_layers:
            windows = tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (int(window),) * num_layers
    return ModelKV(str(getattr(text, "model_type", None) or model.model), num_layers,
                   1 if mla else int(model.get_total_num_kv_heads()), head_size, 0 if mla else head_size,
                   dtype, mla, windows)


def _kv_dtype(cache_dtype: str, model_dtype: Any) -> str:
    """The KV dtype's DTYPE_BYTES name, or as vLLM names it when it sizes no KV we know (nvfp4, ...)."""
    name = cache_dtype if cache_dtype and cache_dtype != "auto" else str(model_dtype).removeprefix("torch.")
    return dtype_name(name) or str(name)


def ranks_on_host(parallel_config: Any) -> int:
    """Worker ranks this host runs for the engine: its TP x PP ranks over its nodes, times the local DP
    engines (each holds a tier of its own)."""
    world, nodes = int(parallel_config.world_size), int(parallel_config.nnodes)
    return max(1, world // max(1, nodes)) * max(1, int(parallel_config.data_parallel_size_local))


def estimated_bytes_per_block(vllm_config: Any) -> int | None:
    """One rank's bytes per CPU block from the model's config, vLLM's block size, TP and whether its hybrid
    KV cache manager is on; None for a model whose KV shape the config does not give (the connector then
    sizes the tier from vLLM's KV spec alone)."""
    try:
        kv = model_kv_of(vllm_config)
    except (ModelConfigError, AttributeError, KeyError, TypeError, ValueError) as err:
        logger.debug("OffloadConnector: CPU tier not sized before start-up: %s", err)
        return None
    if kv.dtype not in DTYPE_BYTES:
        return None
    return kv.bytes_per_block(int(vllm_config.cache_config.block_size),
                              int(vllm_config.parallel_config.tensor_parallel_size), hybrid_manager_on(vllm_config))


def check_capacity(vllm_config: Any, config: OffloadConfig, available: int | None) -> None:
    """At least 2 blocks per rank and, with `available` (MemAvailable) known, the host's pools fit in it."""
    bytes_per_block = estimated_bytes_per_block(vllm_config)
    if bytes_per_block is None:
        return
    parallel = vllm_config.parallel_config
    # MLA's latent is the same on every TP rank: one pool shared by the ranks, as the connector will size it.
    shared_by = ranks_sharing_a_pool(parallel, int(parallel.tensor_parallel_size) if uses_mla(vllm_config) else 1,
                                     config)
    cap = capacity(config, bytes_per_block, int(vllm_config.cache_config.block_size), int(parallel.world_size),
                   shared_by)
    check_host_memory(config, cap, ranks_on_host(parallel), available)
    check_shared_memory(config, cap, shm_free_bytes())
