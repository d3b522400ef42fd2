"""A model's KV-cache shape from its configuration, before any engine exists: what one CPU block costs.

`ModelKV` holds what sizes a vLLM KV-cache block of a decoder model: attention layers, KV heads (total,
before tensor parallelism), head sizes, the KV dtype and, for hybrid models, each layer's sliding window.
`bytes_per_block(block_size, tp, hybrid_manager)` follows vLLM's own rules:

- page of one layer = block_size x KV heads per rank x (head_size + head_size_v) x dtype bytes, where KV
  heads per rank = max(1, heads // tp) (vLLM replicates heads when TP exceeds them);
- MLA (DeepSeek-style `kv_lora_rank`): one latent per token, replicated on every rank: head_size =
  kv_lora_rank + qk_rope_head_dim, head_size_v = 0, one head;
- a CPU block holds one GPU block id's pages of every *layer slot*: all attention layers with one KV-cache
  group (a uniform model, or vLLM's hybrid KV cache manager off), else the size of vLLM's groups: the
  layer count of the rarest attention kind, or of the commonest when that is under 1.5x the rarest
  (vLLM's `_get_kv_cache_groups_uniform_page_size`).

Built from a Hugging Face `config.json` (`from_hf_config`, for `offload-connector check`) or from vLLM's
`ModelConfig` (`offload_connector.vllm.early_check.model_kv_of`, for the start-up check). Either way it is the model's config, not
vLLM's KV spec: backends that pad pages (fp8 MLA kernels) or raise the block size make real blocks larger,
never smaller, so a tier refused as too small here is too small under vLLM too; the connector re-checks
with vLLM's exact spec at start-up. Imports nothing from the project.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
# Every name of a KV dtype: vLLM's --dtype and --kv-cache-dtype choices, torch's names as config.json writes
# them, and the usual short forms; each maps to its DTYPE_BYTES name.
DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_inc": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}
DTYPES_ALLOWED = ", ".join(f"{name} ({', '.join(n for n, c in DTYPE_NAMES.items() if c == name and n != name)})"
                           for name in DTYPE_BYTES)


def dtype_name(name: Any) -> str | None:
    """The DTYPE_BYTES name of a dtype as vLLM, torch or config.json write it ("half", "torch.bfloat16",
    "fp8_e5m2"), or None for one that sizes no KV cache we know."""
    return DTYPE_NAMES.get(str(name).removeprefix("torch.").lower())


class ModelConfigError(ValueError):
    """A model config that does not say what sizes its KV cache: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str, where: str = "") -> None:
        self.key = key
        super().__init__(f"model config key '{key}': got {value!r}; allowed: {allowed}"
                         + (f" (in {where})" if where else ""))


class ModelOptionError(ModelConfigError):
    """A bad `offload-connector check` option about the model (`--model-config`, `--dtype`): names the flag,
    the value, what went wrong and what is allowed."""

    def __init__(self, flag: str, value: Any, allowed: str, problem: str = "") -> None:
        self.key = flag
        ValueError.__init__(self, f"{flag}: got {value!r}{f' ({problem})' if problem else ''}; allowed: {allowed}")


@dataclass(frozen=True, slots=True)
class ModelKV:
    name: str  # model_type or architecture, for messages
    num_layers: int  # attention layers (layers with a KV cache)
    num_kv_heads: int  # total, before tensor parallelism (1 for MLA)
    head_size: int
    head_size_v: int  # == head_size; 0 for MLA (one latent, no separate V)
    dtype: str
    mla: bool = False
    # Per attention layer: its sliding window in tokens, or None for full attention. Empty: all full.
    windows: tuple[int | None, ...] = ()

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_heads_per_rank(self, tp: int) -> int:
        return 1 if self.mla else max(1, self.num_kv_heads // tp)

    def page_bytes(self, block_size: int, tp: int = 1) -> int:
        """One layer's bytes of one block on one rank (vLLM's `page_size_bytes`, unpadded)."""
        return block_size * self.kv_heads_per_rank(tp) * (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def is_hybrid(self) -> bool:
        """Full-attention and sliding-window layers (or several windows): several KV-cache groups in vLLM."""
        return len(set(self.windows)) > 1

    def layer_slots(self, hybrid_manager: bool) -> int:
        """Layers whose pages one CPU block holds (see the module docstring)."""
        if not hybrid_manager or not self.is_hybrid:
            return self.num_layers
        counts = Counter(self.windows).values()
        fewest, most = min(counts), max(counts)
        return most if most < fewest * 1.5 else fewest

    def bytes_per_block(self, block_size: int, tp: int = 1, hybrid_manager: bool = False) -> int:
        return self.page_bytes(block_size, tp) * self.layer_slots(hybrid_manager)

    def describe(self, block_size: int, tp: int = 1, hybrid_manager: bool = False) -> str:
        """E.g. "llama: 32 layers x 8 KV heads (8 per rank) x head size 128 x bfloat16, block_size 16"."""
        heads = (f"MLA latent {self.head_size}" if self.mla else
                 f"{self.num_kv_heads} KV heads ({self.kv_heads_per_rank(tp)} per rank) x head size {self.head_size}")
        slots = self.layer_slots(hybrid_manager)
        layers = (f"{slots} of {self.num_layers} layers per block (vLLM's hybrid KV cache manager groups)"
                  if slots != self.num_layers else f"{self.num_layers} layers")
        return f"{self.name}: {layers} x {heads} x {self.dtype}, block_size {block_size}"


def _first(data: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        if data.get(name) is not None:
            return name, data[name]
    return None


def _positive_int(data: Mapping[str, Any], names: tuple[str, ...], where: str, required: bool = True) -> int | None:
    found = _first(data, names)
    if found is None:
        if required:
            raise ModelConfigError(names[0], None, "a positive int", where)
        return None
    key, value = found
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(key, value, "a positive int", where)
    return value


def from_hf_config(data: Mapping[str, Any], where: str = "config.json", dtype: str | None = None) -> ModelKV:
    """The KV shape of a Hugging Face `config.json` (a multimodal model's `text_config` when it has one),
    read the way vLLM reads it. `dtype` overrides the file's `torch_dtype` (vLLM's --dtype or
    --kv-cache-dtype). Raises `ModelConfigError` naming the key."""
    if not isinstance(data, Mapping):
        raise ModelConfigError("<root>", type(data).__name__, "a JSON object (a model's config.json)", where)
    text = data.get("text_config")
    cfg: Mapping[str, Any] = text if isinstance(text, Mapping) else data
    name = str(cfg.get("model_type") or data.get("model_type") or (data.get("architectures") or ["model"])[0])
    state = _state_layers(cfg)
    if state is not None:  # vLLM pads state pages to the attention page and may raise the block size
        raise ModelConfigError(state[0], state[1], "a model without Mamba/SSM layers here: a Mamba hybrid's "
                               "CPU blocks are sized from vLLM's KV spec when the connector starts (its start-up "
                               "line gives bytes, blocks and tokens)", where)
    num_layers = _positive_int(cfg, ("num_hidden_layers", "n_layer", "num_layers"), where)
    heads = _positive_int(cfg, ("num_attention_heads", "n_head"), where)
    mla = cfg.get("kv_lora_rank") is not None
    if mla:
        kv_lora_rank = _positive_int(cfg, ("kv_lora_rank",), where)
        rope = _positive_int(cfg, ("qk_rope_head_dim",), where, required=False) or 0
        head_size, head_size_v, kv_heads = kv_lora_rank + rope, 0, 1
    else:
        kv_heads = _positive_int(cfg, ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num"),
                                 where, required=False) or heads
        head_size = _positive_int(cfg, ("head_dim", "hidden_size_per_head"), where, required=False)
        if head_size is None:
            hidden = _positive_int(cfg, ("hidden_size", "n_embd"), where)
            head_size = hidden // heads
        head_size_v = head_size
    if dtype is not None and str(dtype).lower() != "auto":  # --dtype: checked by the caller (`check_dtype`)
        kv_dtype = check_dtype(dtype)
    else:
        found = _first(cfg, ("torch_dtype", "dtype")) or _first(data, ("torch_dtype", "dtype"))
        if found is None:
            raise ModelConfigError("torch_dtype", None, f"one of {DTYPES_ALLOWED} (or pass --dtype)", where)
        kv_dtype = dtype_name(found[1])
        if kv_dtype is None:
            raise ModelConfigError(found[0], found[1], f"{DTYPES_ALLOWED} (or pass --dtype)", where)
    return ModelKV(name, num_layers, kv_heads, head_size, head_size_v, kv_dtype, mla,
                   _windows(cfg, num_layers, where))


def check_dtype(dtype: str) -> str:
    """`offload-connector check --dtype`'s value as a DTYPE_BYTES name, or `ModelOptionError` naming the flag."""
    name = dtype_name(dtype)
    if name is None:
        raise ModelOptionError("--dtype", dtype, f"auto (the config's torch_dtype), {DTYPES_ALLOWED}")
    return name


STATE_LAYER_KINDS = ("mamba", "linear_attention", "ssm")


def _state_layers(cfg: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(key, value) saying the model has Mamba/SSM layers (NemotronH's `hybrid_override_pattern` with "M",
    a `layers_block_type` or `layer_types` naming mamba or linear-attention layers, a `ssm_state_size`),
    or None."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:
        return "hybrid_override_pattern", pattern
    for key in ("layers_block_type", "layer_types"):
        kinds = cfg.get(key)
        if isinstance(kinds, list | tuple) and any(isinstance(k, str) and k.startswith(STATE_LAYER_KINDS)
                                                   for k in kinds):
            return key, kinds
    if cfg.get("ssm_state_size") is not None:
        return "ssm_state_size", cfg["ssm_state_size"]
    return None


def _windows(cfg: Mapping[str, Any], num_layers: int, where: str) -> tuple[int | None, ...]:
    """Each layer's sliding window from `layer_types` ("sliding_attention" / "full_attention") and
    `sliding_window`; without `layer_types` every layer has the same window (or none)."""
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelConfigError("sliding_window", window, "a positive int or null", where)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        return (window,) * num_layers if window is not None else ()
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelConfigError("layer_types", layer_types, f"a list of {num_layers} layer types", where)
    out: list[int | None] = []
    for kind in layer_types:
        if kind == "sliding_attention":
            if window is None:
                raise ModelConfigError("sliding_window", None, "a positive int with sliding layer_types", where)
            out.append(window)
        elif kind in ("full_attention", "attention"):
            out.append(None)
        else:  # chunked local attention and other kinds the connector refuses under vLLM
            raise ModelConfigError("layer_types", kind, "full_attention and sliding_attention layers "
                                   "(the KV-cache kinds OffloadConnector holds)", where)
    return tuple(out)


def read_hf_config(path: str) -> dict[str, Any]:
    """A model's `config.json` as vLLM sees it: the file's keys, completed by `transformers` (when it is
    installed, as it is with vLLM) with what its config class derives, e.g. Gemma 2's `layer_types`.
    Raises `ModelConfigError` for a missing or malformed file."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ModelOptionError("--model-config", path, "the path of a model's config.json (Hugging Face format)",
                               exc.strerror or str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelOptionError("--model-config", path, "a model's config.json (a JSON object)",
                               f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError("<root>", type(data).__name__, "a JSON object (a model's config.json)", path)
    return {**_derived_by_transformers(data), **data}


def _derived_by_transformers(data: Mapping[str, Any]) -> dict[str, Any]:
    """The config class's full dict for `data` (empty without transformers or for a type it does not know)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return {}
    fields = dict(data)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        return {}
    try:
        return AutoConfig.for_model(model_type, **fields).to_dict()
    except Exception:  # noqa: BLE001 - an unknown or custom model type: the file's keys alone
        return {}
