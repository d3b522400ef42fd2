"""Typed configuration: the one place user input is validated.

`load_config(path_or_dict)` is the only entry point. It accepts a YAML file path, a YAML string's parsed
dict, or `None` (the embedded default). Every invalid input raises `ConfigError` (config_errors.py)
*before* anything is allocated, naming the key, the bad value and what is allowed, and, read from a file,
the file. After loading, `cpu_bytes` is always an int (a `Size`, sizes.py: it remembers how it was written).

Invariants of a loaded `OffloadConfig`:
- every int field is within its documented range (see docs/configuration.md);
- `cpu_bytes` > 0 (bytes); `num_cpu_blocks`, when set, is >= 2 (block 0 is the reserved null block);
- unknown keys never survive (msgspec `forbid_unknown_fields`).

This module imports only the project's config leaves (errors, sizes, schema, the tiers' sections), no torch.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from offload_connector.config_errors import ConfigError
from offload_connector.config_errors import locate as locate_key
from offload_connector.config_schema import describe, lookup, resolve_field, struct_in
from offload_connector.disk.config import DiskConfig, validate_disk
from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.remote.config import RemoteConfig, check_remote
from offload_connector.sizes import parse_size

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class TransferConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    backend: Literal["auto", "cuda", "cpu"] = "auto"
    num_streams: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2  # threads or streams: a bound, not a wish
    # A load not done this many seconds after it was issued is reported failed (its request recomputes);
    # its blocks stay quarantined until the copy ends (worker.py, completions.py). None: wait forever.
    load_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = 30.0
    # CUDA only (worker_side/backends/cuda/kernel_policy.py). The staged path: GPU memory for the staging
    # rings of both directions (a gather/scatter in device memory, then DMA of whole host blocks); 0: off.
    staging_bytes: int | str = 64 << 20
    staging_max_sms: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16  # the staged kernel's grid, thread blocks
    # The direct kernel (the SMs read and write host memory; it slows the forward): which copies it may take
    # instead of DMA. `calibrate` times every available path on the device at start-up, at this model's job
    # shapes, and keeps per direction what measured faster.
    kernel_directions: tuple[str, ...] = ()  # each 'load' or 'store', at most once; () = never
    # The KV-cache layout the vLLM adapter asks vLLM for: `auto` asks for a block-outermost layout (BLHNC, or
    # BLNHC where the attention backend lists only that), so each block is one range across layers; `vllm`
    # keeps vLLM's choice; BLHNC / BLNHC ask for that one. vLLM keeps its own where a backend refuses it.
    kv_layout: Literal["auto", "vllm", "BLHNC", "BLNHC"] = "auto"
    kernel_max_segment_bytes: int | str = 28 << 10  # size; the job's segments average at most this; 0: never
    kernel_min_segments: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 16
    kernel_max_sms: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 12  # the kernel's grid: this many thread blocks
    calibrate: bool = True


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Shape and size of the fake engine (replay, tests). Ignored under vLLM, which brings its own."""

    num_gpu_blocks: Annotated[int, msgspec.Meta(ge=2)] = 1024
    block_size: PositiveInt = 16
    num_layers: PositiveInt = 2
    num_kv_heads: PositiveInt = 2
    head_dim: PositiveInt = 8
    dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    max_num_batched_tokens: PositiveInt = 4096
    max_num_seqs: PositiveInt = 64
    # The fake engine's CPU tier when the top-level `num_cpu_blocks` is unset (instead of `cpu_bytes`,
    # which would buy millions of the fake model's tiny blocks). None: size it from `cpu_bytes`.
    num_cpu_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    # Hybrid mode (a model like Gemma 2 under vLLM's hybrid KV cache manager): odd layers attend only to the
    # last `sliding_window` tokens and form a second KV-cache group. Needs num_layers >= 2, store_policy
    # eager and no lower tier. None: every layer is full attention (one group).
    sliding_window: PositiveInt | None = None


class OffloadConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    cpu_bytes: int | str = "8GiB"
    num_cpu_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    # Unset: lazy, the recommended setting; eager with several KV-cache groups (`load_config`'s
    # `num_kv_groups`, or the fake engine's `engine.sliding_window`), which keeps vLLM's hybrid KV cache
    # manager on. Set explicitly, it is used as given.
    store_policy: Literal["eager", "lazy"] = "lazy"
    lazy_lookahead_blocks: NonNegativeInt | None = None
    max_store_wait_steps: NonNegativeInt = 8
    eviction: Literal["lru", "arc"] = "lru"
    branch_filter: bool = False  # drop superseded branches from the CPU tier (scheduler_side/admission/filter.py)
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    hash_algo: Literal["xxh3_128", "sha256"] = "xxh3_128"
    metrics: bool = True
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    remote: RemoteConfig | None = None  # a shared tier under the CPU tier (remote/config.py); None: off
    disk: DiskConfig | None = None  # a local directory under the CPU tier (disk/config.py); None: off


_AT_RE = re.compile(r" - at `\$(.*)`$")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]*)`")


def _translate(err: msgspec.ValidationError, data: Mapping[str, Any]) -> ConfigError:
    text = str(err)
    m = _AT_RE.search(text)
    path = [p for p in (m.group(1) if m else "").split(".") if p]
    unknown = _UNKNOWN_RE.search(text)
    if unknown:
        return _unknown_key(path, unknown.group(1), lookup(data, path + [unknown.group(1)]))
    _, annotation = resolve_field(OffloadConfig, path)
    key = ".".join(path) or "<root>"
    value = lookup(data, path)
    guess = ""
    if typing.get_origin(annotation) is Literal and isinstance(value, str):
        allowed = {str(a).lower(): str(a) for a in typing.get_args(annotation)}
        close = difflib.get_close_matches(value.lower(), list(allowed), n=1, cutoff=0.6)
        guess = repr(allowed[close[0]]) if close else ""
    return ConfigError(key, value, describe(annotation), _AT_RE.sub("", text), guess=guess)


# Keys of vLLM's own CPU offload (its --kv-offloading-* flags and OffloadingConnector's extra config) that
# users bring over, and what this connector takes instead.
VLLM_OPTION_KEYS = {
    "kv_offloading_size": 'cpu_bytes, a size such as "8GiB" (vLLM\'s --kv-offloading-size is a number of GiB)',
    "kv_offloading_backend": "no such key: OffloadConnector is the CPU offload (leave vLLM's --kv-offloading-backend out)",
    "eviction_policy": "eviction: 'lru' | 'arc'",
    "store_threshold": "store_policy: 'lazy' | 'eager'",
    "block_size": "no such key: a CPU block is one vLLM block (vLLM's --block-size)",
    "spec_name": "no such key: it picks a spec of vLLM's own OffloadingConnector",
    "spec_module_path": "no such key: it picks a spec of vLLM's own OffloadingConnector",
}
FAKE_ENGINE_KEYS = ("hash_algo", "engine")  # read by the fake engine (replay, tests) only; ignored under vLLM


def _unknown_key(path: list[str], name: str, value: Any) -> ConfigError:
    """An unknown key: vLLM's name for one of ours, a near miss of a known key, or the keys known there."""
    owner = struct_in(resolve_field(OffloadConfig, path)[1]) if path else OffloadConfig
    key = ".".join(path + [name])
    top = owner is OffloadConfig
    vllm_name = name.replace("-", "_")
    if top and vllm_name in VLLM_OPTION_KEYS:
        gib = vllm_name == "kv_offloading_size" and isinstance(value, int | float) and not isinstance(value, bool)
        return ConfigError(key, value, VLLM_OPTION_KEYS[vllm_name],
                           f"{name} is an option of vLLM's own CPU offload, not of OffloadConnector",
                           guess=f"cpu_bytes: {value:g}GiB" if gib and value > 0 else "")
    fields = list(owner.__struct_fields__)
    known = [f for f in fields if not (top and f in FAKE_ENGINE_KEYS)]
    allowed = f"known keys here: {', '.join(known)}"
    if top:
        allowed += (f"; for the fake engine only (ignored under vLLM): {', '.join(FAKE_ENGINE_KEYS)}; "
                    + ", ".join(f"{a} (alias of {k})" for a, k in ALIASES.items()))
    close = difflib.get_close_matches(name, fields + (list(ALIASES) if top else []), n=1, cutoff=0.6)
    return ConfigError(key, value, allowed, "unknown key", guess=repr(close[0]) if close else "")


def _size_or_off(key: str, value: int | str, off: str) -> int:
    """A size key where 0 turns something off: the bytes, or ConfigError naming 0 among the allowed values."""
    if value in (0, "0"):
        return 0
    try:
        return int(parse_size(key, value))
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.value, f"{exc.allowed}, or 0 ({off})", exc.detail, guess=exc.guess) from None


def _validate(cfg: OffloadConfig) -> OffloadConfig:
    cfg.cpu_bytes = parse_size("cpu_bytes", cfg.cpu_bytes)
    t = cfg.transfer
    if not set(t.kernel_directions) <= {"load", "store"} or len(set(t.kernel_directions)) != len(t.kernel_directions):
        raise ConfigError("transfer.kernel_directions", list(t.kernel_directions),
                          "a list of distinct directions out of 'load', 'store', or [] (DMA only)")
    t.kernel_max_segment_bytes = _size_or_off("transfer.kernel_max_segment_bytes", t.kernel_max_segment_bytes,
                                              "kernel off")
    t.staging_bytes = _size_or_off("transfer.staging_bytes", t.staging_bytes, "staged copies off")
    if cfg.engine.sliding_window is not None:  # the fake engine's hybrid mode (two KV-cache groups)
        if cfg.engine.num_layers < 2:
            raise ConfigError("engine.num_layers", cfg.engine.num_layers, ">= 2 with engine.sliding_window",
                              "odd layers form the sliding-window group")
        if cfg.store_policy != "eager":
            raise ConfigError("store_policy", cfg.store_policy, "eager with engine.sliding_window",
                              "several KV-cache groups")
        for name, _ in lower_tier_sections(cfg):  # each lower tier serves one KV-cache group
            raise ConfigError(name, f"a {name} section", "none with engine.sliding_window",
                              "several KV-cache groups")
    if cfg.remote is not None:
        problem = check_remote(cfg.remote)
        if problem is not None:
            raise ConfigError(*problem)
        cfg.remote.max_inflight_bytes = parse_size("remote.max_inflight_bytes", cfg.remote.max_inflight_bytes)
    if cfg.disk is not None:
        validate_disk(cfg.disk, parse_size, ConfigError)
    return cfg


def default_config_dict() -> dict[str, Any]:
    """The embedded default configuration (offload_connector/default.yaml) as a dict."""
    text = resources.files("offload_connector").joinpath("default.yaml").read_text()
    return yaml.safe_load(text) or {}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML config file (unvalidated: callers merge overrides, then `load_config`)."""
    p = Path(path)
    where = _resolved(p)
    if not p.is_file():
        raise ConfigError("config_file", str(path), "a path to an existing YAML file",
                          f"looked for {where} (relative paths start at the working directory)")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError("config_file", where, "a valid YAML mapping", str(exc)) from exc
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text
        raise ConfigError("config_file", where, "a readable UTF-8 YAML file", str(exc)) from exc
    if data is None:  # an empty file: the defaults
        return {}
    if not isinstance(data, dict):  # `[]`, `false` or `0` used to load as the defaults
        raise ConfigError("<root>", data, "a mapping of config keys", f"in {where}")
    return data


def _resolved(p: Path) -> str:
    """`p` made absolute for messages; as given when it cannot be (a NUL byte, a loop of links)."""
    try:
        return str(p.resolve())
    except (OSError, ValueError, RuntimeError):
        return str(p)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(str(key), "given twice", "each key once per mapping",
                                  f"line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_keys(data: Mapping[Any, Any], path: str = "") -> None:
    """Every key a string: `transfer: {1: cpu}` is refused naming `transfer.1`."""
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if not isinstance(key, str):
            raise ConfigError(where, key, "string keys (config key names)")
        if isinstance(value, Mapping):
            _check_keys(value, where)


def config_source_dict(path_or_dict: str | Path | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The raw mapping behind a config source: a YAML path, a mapping, or None (the embedded default).

    Unvalidated, so callers can merge overrides before `load_config`.
    """
    if path_or_dict is None:
        return default_config_dict()
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if isinstance(path_or_dict, str | Path):
        return read_config_file(path_or_dict)
    raise ConfigError("config", path_or_dict, "a YAML file path, a mapping of config keys, or None")


ALIASES = {"cpu_bytes_to_use": "cpu_bytes"}  # vLLM's own CPU-offload key, for users moving over


def _apply_aliases(data: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for alias, key in ALIASES.items():
        if alias in out:
            if key in out:
                raise ConfigError(alias, out[alias], f"'{key}' or its alias '{alias}' (vLLM's name), not both",
                                  f"'{key}' is set too ({out[key]!r})")
            out[key] = out.pop(alias)
    return out


HYBRID_STORE_POLICY = "eager"  # what an unset store_policy means with several KV-cache groups


def load_config(path_or_dict: str | Path | Mapping[str, Any] | None = None, *, num_kv_groups: int = 1) -> OffloadConfig:
    """Load and validate a config from a YAML path, a mapping, or None (embedded default).

    Keys missing from the input take the documented defaults; an unset `store_policy` is `eager` for a
    model of `num_kv_groups` > 1 KV-cache groups (or the fake engine's `engine.sliding_window`: two), else
    `lazy`. Raises ConfigError on any bad input; read from a file, the error says so (`locate`).
    """
    data: Any = config_source_dict(path_or_dict)
    if not isinstance(path_or_dict, str | Path):
        return _load(data, num_kv_groups)
    try:
        return _load(data, num_kv_groups)
    except ConfigError as err:
        raise locate(err, [(_resolved(Path(path_or_dict)), data)]) from None


def _load(data: Any, num_kv_groups: int) -> OffloadConfig:
    if not isinstance(data, Mapping):
        raise ConfigError("<root>", data, "a mapping of config keys")
    _check_keys(data)
    data = _apply_aliases(data)
    engine = data.get("engine")
    if "store_policy" not in data and (
            num_kv_groups > 1 or isinstance(engine, Mapping) and engine.get("sliding_window") is not None):
        data["store_policy"] = HYBRID_STORE_POLICY
    try:
        cfg = msgspec.convert(data, OffloadConfig, strict=True)
    except msgspec.ValidationError as err:
        raise _translate(err, data) from None
    return _validate(cfg)


def locate(err: ConfigError, sources: Sequence[tuple[str, Mapping[str, Any]]]) -> ConfigError:
    """`config_errors.locate` knowing our key aliases (vLLM's `cpu_bytes_to_use` sets `cpu_bytes`)."""
    return locate_key(err, sources, ALIASES)


def merge_configs(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge two config dicts; `override` wins key by key (used for inline vLLM extra config).

    Aliases are resolved in each source first, so `cpu_bytes_to_use` in `override` replaces `cpu_bytes`
    in `base` (one source setting both is still refused)."""
    return _deep_merge(_apply_aliases(base) if isinstance(base, Mapping) else base,
                       _apply_aliases(override) if isinstance(override, Mapping) else override)


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
