"""The lower tiers' identity under vLLM (offload_connector/vllm/tier_identity.py), from stand-in config objects:
what must match for two instances to share keys, and the set-up that could never share (refused)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offload_connector.remote.format import key_prefix
from offload_connector.vllm.engine_setup import KVCacheShape
from offload_connector.vllm.errors import UnsupportedSetupError
from offload_connector.vllm.tier_identity import vllm_tier_identity


class FullAttentionSpec(SimpleNamespace):
    pass


def identity(monkeypatch, seed: str | None = "0", algo: str = "xxhash", model: str = "m", heads: int = 8,
             tp: int = 1, layout: str = "NHD", cache_dtype: str = "auto"):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=128, dtype="bfloat16", page_size_bytes=1024)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])],
        kv_cache_tensors=[SimpleNamespace(layers=["l0"]), SimpleNamespace(layers=["l1"])])
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, dtype="bfloat16"),
        cache_config=SimpleNamespace(prefix_caching_hash_algo=algo, cache_dtype=cache_dtype))
    shape = KVCacheShape(block_size=16, bytes_per_block=2048, num_layers=2, num_gpu_blocks=100, world_size=tp,
                         layout=layout)
    return key_prefix(vllm_tier_identity(vllm_config, kv_cache_config, shape), "ns")


def test_equal_setups_share_keys_and_any_difference_separates_them(monkeypatch) -> None:
    base = identity(monkeypatch)
    assert identity(monkeypatch) == base
    others = [identity(monkeypatch, seed="1"), identity(monkeypatch, algo="sha256"), identity(monkeypatch, model="m2"),
              identity(monkeypatch, heads=4), identity(monkeypatch, tp=2), identity(monkeypatch, layout="HND"),
              identity(monkeypatch, cache_dtype="fp8")]
    assert len({base, *others}) == 1 + len(others)


def test_random_hash_seed_is_refused_naming_the_fix(monkeypatch) -> None:
    with pytest.raises(UnsupportedSetupError, match="PYTHONHASHSEED"):
        identity(monkeypatch, seed=None, algo="xxhash")
    assert identity(monkeypatch, seed=None, algo="sha256")  # vLLM's fixed default seed: shareable
