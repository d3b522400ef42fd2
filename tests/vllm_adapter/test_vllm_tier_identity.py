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


class MLAAttentionSpec(SimpleNamespace):
    pass


def identity(monkeypatch, seed: str | None = "0", algo: str = "xxhash", model: str = "m", heads: int = 8,
             tp: int = 1, layout: str = "NHD", cache_dtype: str = "auto", replicas: int = 1,
             spec_class: type = FullAttentionSpec, full: bool = False):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    spec = spec_class(block_size=16, num_kv_heads=heads, head_size=128, dtype="bfloat16", page_size_bytes=1024 * heads)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])],
        kv_cache_tensors=[SimpleNamespace(layers=["l0"]), SimpleNamespace(layers=["l1"])], kv_tp_replicas=replicas)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, dtype="bfloat16"),
        cache_config=SimpleNamespace(prefix_caching_hash_algo=algo, cache_dtype=cache_dtype))
    shape = KVCacheShape(block_size=16, bytes_per_block=2048 * heads, num_layers=2, num_gpu_blocks=100,
                         world_size=tp, layout=layout)
    tier_identity = vllm_tier_identity(vllm_config, kv_cache_config, shape)
    return tier_identity if full else key_prefix(tier_identity, "ns")


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


def test_a_model_is_one_identity_at_every_tp_when_blocks_split_by_head(monkeypatch) -> None:
    # 8 KV heads: all on one rank at TP 1, 4 a rank at TP 2, 2 at TP 4; vLLM's layouts keeping heads in blocks
    for layout in ("LBHNC", "LBNHC", "BLHNC"):
        tp1 = identity(monkeypatch, layout=layout, full=True)
        assert tp1.kv_heads == 8
        assert identity(monkeypatch, layout=layout, heads=4, tp=2) == identity(monkeypatch, layout=layout, heads=2,
                                                                               tp=4) == key_prefix(tp1, "ns")
    # 16 heads split over 2 ranks is another model
    assert identity(monkeypatch, layout="LBHNC", heads=8, tp=2) != identity(monkeypatch, layout="LBHNC")
    # fewer KV heads than ranks: vLLM replicates each on TP / heads ranks (kv_tp_replicas)
    assert identity(monkeypatch, layout="LBHNC", heads=1, tp=4, replicas=2, full=True).kv_heads == 2
    # MLA: one latent on every rank, whatever the TP
    mla = [identity(monkeypatch, layout="LBHNC", heads=1, tp=tp, replicas=tp, spec_class=MLAAttentionSpec, full=True)
           for tp in (1, 2)]
    assert mla[0].kv_heads == mla[1].kv_heads == 1 and mla[0] == mla[1]


def test_a_layout_with_heads_outside_the_blocks_stays_per_rank(monkeypatch) -> None:
    for layout in ("LHBNC", None):
        assert identity(monkeypatch, layout=layout, full=True).kv_heads == 0
        assert identity(monkeypatch, layout=layout) != identity(monkeypatch, layout=layout, heads=4, tp=2)
