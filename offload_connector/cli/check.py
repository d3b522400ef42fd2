"""`offload-connector check CONFIG`: validate a config and say what it gives per rank for a model.

`check_config(...)` loads the config (`load_config`: every key, type and value), and with a model's
`config.json` sizes one rank's CPU tier the way the vLLM adapter will (`model_kv.py`, `sizing.py`): bytes,
usable blocks, tokens, and whether the ranks on this host fit in its MemAvailable, as vLLM's start-up check
judges it. Returns a plain dict (the `--json` object); raises `ConfigError` / `ModelConfigError` naming the
key, as the CLI prints in one `error:` line. Imports no vLLM and no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offload_connector.config import ConfigError, OffloadConfig, load_config, locate, read_config_file
from offload_connector.model_kv import ModelKV, ModelOptionError, check_dtype, from_hf_config, read_hf_config
from offload_connector.sizing import capacity, check_host_memory, format_bytes, mem_available_bytes
from offload_connector.vllm.engine_setup import keeps_hybrid_manager

VLLM_DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE (GPU backends may raise it)


def check_config(path: str, model_config: str | None = None, tp: int = 1, block_size: int | None = None,
                 dtype: str | None = None, host_memory: bool = True) -> dict[str, Any]:
    if dtype is not None and dtype.lower() != "auto":  # auto: the config's torch_dtype, as in vLLM
        check_dtype(dtype)  # the flag's error before the model's: it names --dtype
        if model_config is None:
            raise ModelOptionError("--dtype", dtype, "with --model-config only",
                                   "it is the KV dtype of the model --model-config names")
    kv = from_hf_config(read_hf_config(model_config), where=model_config, dtype=dtype) if model_config else None
    # An unset store_policy resolves as the connector resolves it for this model (eager for a hybrid one).
    config = load_config(path, num_kv_groups=2 if kv is not None and kv.is_hybrid else 1)
    try:
        return _sized(path, config, kv, tp, block_size, host_memory)
    except ConfigError as err:  # a size the model or this host refuses: where it was set, or the default
        raise locate(err, [(str(Path(path).resolve()), read_config_file(path))]) from None


def _sized(path: str, config: OffloadConfig, kv: ModelKV | None, tp: int, block_size: int | None,
           host_memory: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "valid": True, "config": path, "store_policy": config.store_policy, "eviction": config.eviction,
        "transfer_backend": config.transfer.backend, "remote": config.remote is not None,
        "disk": config.disk.path if config.disk is not None else None,
        "cpu_bytes": int(config.cpu_bytes), "num_cpu_blocks": config.num_cpu_blocks, "tp": tp,
    }
    if kv is None:
        return out
    block_size = block_size or VLLM_DEFAULT_BLOCK_SIZE
    hybrid_manager = keeps_hybrid_manager(config)
    bytes_per_block = kv.bytes_per_block(block_size, tp, hybrid_manager)
    # MLA's latent is the same on every rank: under vLLM's default single-node TP the ranks share one pool.
    shared_by = tp if kv.mla and tp > 1 and config.remote is None else 1
    cap = capacity(config, bytes_per_block, block_size, tp, shared_by)
    out.update(block_size=block_size, model=kv.describe(block_size, tp, hybrid_manager), shared_by=shared_by,
               per_rank={"bytes": cap.bytes_per_rank, "blocks": cap.usable_blocks, "tokens": cap.tokens,
                         "bytes_per_block": bytes_per_block})
    if host_memory:
        available = mem_available_bytes()
        check_host_memory(config, cap, tp, available)  # one node runs every rank (vLLM's default)
        out["host"] = {"mem_available": available, "needed": cap.bytes_per_rank * cap.pools}
    return out


def format_check(result: dict[str, Any]) -> str:
    lines = [f"{result['config']}: valid",
             f"  policies     store_policy {result['store_policy']}, eviction {result['eviction']}, "
             f"transfer.backend {result['transfer_backend']}, remote tier {'on' if result['remote'] else 'off'}, "
             f"disk tier {result['disk'] or 'off'}"]
    tier = (f"num_cpu_blocks {result['num_cpu_blocks']:,} per rank" if result["num_cpu_blocks"] is not None
            else f"cpu_bytes {format_bytes(result['cpu_bytes'])} for the whole engine")
    if "per_rank" not in result:
        lines.append(f"  CPU tier     {tier}; pass --model-config config.json for blocks and tokens per rank")
        return "\n".join(lines)
    rank = result["per_rank"]
    ranks = f" / TP {result['tp']}" if result["tp"] > 1 and result.get("shared_by", 1) == 1 else \
        (f", one pool shared by the {result['tp']} ranks: MLA's latent is the same on each" if result["tp"] > 1 else "")
    lines += [f"  model        {result['model']}",
              f"  per rank     {format_bytes(rank['bytes'])} = {rank['blocks']:,} blocks of "
              f"{format_bytes(rank['bytes_per_block'])} = {rank['tokens']:,} tokens ({tier}{ranks})"]
    host = result.get("host")
    if host is not None and host["mem_available"] is not None:
        lines.append(f"  this host    {format_bytes(host['needed'])} for {result['tp']} rank(s), MemAvailable "
                     f"{format_bytes(host['mem_available'])}")
    return "\n".join(lines)
