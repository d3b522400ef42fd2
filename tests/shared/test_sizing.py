"""What a config buys and whether the host holds it (`sizing.py`), and a model's KV shape from its config
(`model_kv.py`): the figures `offload-connector check` prints and vLLM's start-up check judges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_connector.config import ConfigError, load_config
from offload_connector.model_kv import ModelConfigError, from_hf_config, read_hf_config
from offload_connector.sizing import (
    Capacity,
    capacity,
    check_host_memory,
    check_shared_memory,
    format_bytes,
    num_cpu_blocks,
)

TESTS = Path(__file__).resolve().parents[1]
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "hidden_size": 7168, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (32768, "32 KiB"), (1536, "1.50 KiB"),
    (8 * 2**30, "8 GiB"), (8 * 10**9, "7.45 GiB"), (10 * 2**40, "10 TiB"),
])
def test_format_bytes_uses_the_largest_unit(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_capacity_counts_usable_blocks_bytes_and_tokens() -> None:
    cap = capacity(load_config({"cpu_bytes": "1GiB"}), 32768, block_size=32)
    assert (cap.num_cpu_blocks, cap.usable_blocks, cap.tokens) == (32768, 32767, 32767 * 32)
    assert cap.bytes_per_rank == 2**30
    assert cap.describe() == "1 GiB per rank = 32,767 blocks of 32 KiB = 1,048,544 tokens"
    two = capacity(load_config({"cpu_bytes": "2GiB"}), 32768, block_size=32, world_size=2)
    assert two.num_cpu_blocks == 32768 and "per rank x 2 ranks" in two.describe()


def test_a_bare_small_cpu_bytes_suggests_gib() -> None:
    """`cpu_bytes: 8` is 8 bytes: refused, and the message asks whether 8GiB was meant."""
    with pytest.raises(ConfigError) as err:
        num_cpu_blocks(load_config({"cpu_bytes": 8}), 32768)
    assert err.value.key == "cpu_bytes" and err.value.value == 8
    assert "did you mean 8GiB?" in str(err.value) and ">= 64 KiB" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a unit was given: no guess
        num_cpu_blocks(load_config({"cpu_bytes": "32KiB"}), 32768)
    assert "did you mean" not in str(err.value) and "fewer than 2 blocks" in str(err.value)


def test_a_tier_above_memavailable_is_refused_in_human_units() -> None:
    config = load_config({"cpu_bytes": "10TiB"})
    cap = capacity(config, 32768, 32)
    with pytest.raises(ConfigError) as err:
        check_host_memory(config, cap, ranks_on_host=1, available=22 * 2**30)
    message = str(err.value)
    assert err.value.key == "cpu_bytes" and "got '10TiB'" in message and "<= 22 GiB" in message  # as written
    assert "MemAvailable" in message and "MiB" not in message  # no per-block size in odd units
    check_host_memory(config, cap, ranks_on_host=1, available=None)  # the kernel does not say: no check
    check_host_memory(config, cap, ranks_on_host=1, available=cap.bytes_per_rank)  # exactly fits


def test_the_ranks_on_one_host_share_its_memory() -> None:
    """cpu_bytes is for the whole engine: 2 ranks of 8 GiB each on a 12 GiB host do not fit."""
    config = load_config({"cpu_bytes": "16GiB"})
    cap = capacity(config, 2**20, 16, world_size=2)
    check_host_memory(config, cap, ranks_on_host=1, available=12 * 2**30)  # one rank per node
    with pytest.raises(ConfigError, match=r"<= 12 GiB here: this host's MemAvailable is 12 GiB \(6 GiB per rank\)"):
        check_host_memory(config, cap, ranks_on_host=2, available=12 * 2**30)


def test_num_cpu_blocks_above_memavailable_names_num_cpu_blocks() -> None:
    config = load_config({"num_cpu_blocks": 10**6})
    with pytest.raises(ConfigError) as err:
        check_host_memory(config, Capacity(10**6, 2**20, 16, 1), ranks_on_host=1, available=2**30)
    assert err.value.key == "num_cpu_blocks" and "<= 1,024 blocks of 1 MiB" in str(err.value)


def test_a_pool_shared_by_every_rank_holds_what_one_rank_holds_at_tp_1() -> None:
    """MLA under TP: the ranks map one pool, so cpu_bytes is not divided among them; the host holds it once."""
    config = load_config({"cpu_bytes": "64MiB"})
    one, shared = capacity(config, 73728, 16), capacity(config, 73728, 16, world_size=2, shared_by=2)
    assert one.num_cpu_blocks == shared.num_cpu_blocks == 910
    assert capacity(config, 73728, 16, world_size=2).num_cpu_blocks == 455  # a copy per rank: half
    assert shared.describe().startswith("63.98 MiB shared by 2 ranks (replicated KV stored once) = 909 blocks")
    check_host_memory(config, shared, ranks_on_host=2, available=shared.bytes_per_rank)  # one pool on the host
    with pytest.raises(ValueError, match="multiple of shared_by"):
        num_cpu_blocks(config, 73728, world_size=3, shared_by=2)


def test_a_shared_pool_larger_than_dev_shm_is_refused_naming_cpu_bytes() -> None:
    config = load_config({"cpu_bytes": "1GiB"})
    shared = capacity(config, 2**20, 16, world_size=2, shared_by=2)
    with pytest.raises(ConfigError) as err:
        check_shared_memory(config, shared, free=64 * 2**20)
    message = str(err.value)
    assert err.value.key == "cpu_bytes" and "got '1GiB'" in message and "a pool <= 64 MiB here (64 blocks" in message
    assert "--shm-size" in message and "/dev/shm, which has 64 MiB free" in message
    check_shared_memory(config, shared, free=None)  # no /dev/shm to judge: nothing checked
    check_shared_memory(config, capacity(config, 2**20, 16, world_size=2), free=0)  # no shared pool


# ---- a model's KV shape from its config.json ------------------------------------------------------------
def test_llama_blocks_match_the_documented_example() -> None:
    """docs: Llama-3-8B, bf16, block_size 16: 64 KiB per layer, 2 MiB per block; TP=2 halves it."""
    kv = from_hf_config(LLAMA3_8B)
    assert (kv.num_layers, kv.num_kv_heads, kv.head_size, kv.dtype) == (32, 8, 128, "bfloat16")
    assert kv.page_bytes(16) == 64 * 2**10 and kv.bytes_per_block(16) == 2 * 2**20
    assert kv.bytes_per_block(16, tp=2) == 2**20
    assert kv.bytes_per_block(16, tp=16) == 2**20 // 4  # 8 heads over 16 ranks: one replicated head each


def test_mla_stores_one_latent_per_token_on_every_rank() -> None:
    kv = from_hf_config(DEEPSEEK_V3)
    assert kv.mla and kv.head_size == 576 and kv.head_size_v == 0
    assert kv.bytes_per_block(64) == 64 * 576 * 2 * 61 == kv.bytes_per_block(64, tp=8)


@pytest.mark.parametrize(("kinds", "slots"), [
    (["sliding_attention", "full_attention"] * 2, 2),  # Gemma 2: alternating, groups of 2
    (["sliding_attention"] * 5 + ["full_attention"], 1),  # Gemma 3's 5:1: groups of the rarest kind
    (["sliding_attention"] * 12 + ["full_attention"] * 13, 13),  # gpt-oss-like: under 1.5x, the commonest
])
def test_hybrid_models_fill_a_block_with_one_groups_layers(kinds: list[str], slots: int) -> None:
    """With vLLM's hybrid KV cache manager on, a block id owns one page per layer slot (vLLM's group size);
    off, every layer is full attention in one group."""
    kv = from_hf_config({**LLAMA3_8B, "num_hidden_layers": len(kinds), "layer_types": kinds, "sliding_window": 512})
    assert kv.is_hybrid and kv.layer_slots(hybrid_manager=True) == slots
    assert kv.bytes_per_block(16, hybrid_manager=True) == kv.page_bytes(16) * slots
    assert kv.bytes_per_block(16, hybrid_manager=False) == kv.page_bytes(16) * len(kinds)


def test_the_test_models_configs_read_as_vllm_reads_them() -> None:
    """transformers fills in Gemma 2's alternating layer_types, as it does for vLLM."""
    pytest.importorskip("transformers")
    llama = from_hf_config(read_hf_config(str(TESTS / "tiny_llama" / "config.json")))
    assert llama.bytes_per_block(32) == 32768 and not llama.is_hybrid
    gemma = from_hf_config(read_hf_config(str(TESTS / "tiny_gemma2" / "config.json")))
    assert gemma.windows == (64, None, 64, None)
    assert (gemma.bytes_per_block(32, hybrid_manager=True), gemma.bytes_per_block(32)) == (32768, 65536)


@pytest.mark.parametrize(("data", "key"), [
    ({**LLAMA3_8B, "num_hidden_layers": None}, "num_hidden_layers"),
    ({**LLAMA3_8B, "num_key_value_heads": 0}, "num_key_value_heads"),
    ({**LLAMA3_8B, "torch_dtype": "int4"}, "torch_dtype"),
    ({**LLAMA3_8B, "num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}, "layer_types"),
    ({**LLAMA3_8B, "num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types"),
    ([1, 2], "<root>"),
])
def test_a_model_config_that_does_not_size_its_kv_names_the_key(data, key: str) -> None:
    with pytest.raises(ModelConfigError) as err:
        from_hf_config(data)
    assert err.value.key == key and f"'{key}'" in str(err.value)


def test_a_mamba_hybrid_config_says_the_connector_sizes_it_at_start_up() -> None:
    """vLLM pads a Mamba hybrid's state pages to the attention page and may raise the block size for
    them: `check` does not guess, it names the key that makes the model a Mamba hybrid."""
    pytest.importorskip("transformers")
    with pytest.raises(ModelConfigError, match="Mamba/SSM layers here: a Mamba hybrid's CPU blocks are sized from "
                                               "vLLM's KV spec when the connector starts") as err:
        from_hf_config(read_hf_config(str(TESTS / "tiny_nemotronh" / "config.json")))
    assert err.value.key == "hybrid_override_pattern"
    for data, key in (({**LLAMA3_8B, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
                       "layer_types"),
                      ({**LLAMA3_8B, "layers_block_type": ["mamba", "attention"]}, "layers_block_type")):
        with pytest.raises(ModelConfigError, match="Mamba/SSM") as err:
            from_hf_config(data)
        assert err.value.key == key


def test_reading_a_model_config_names_the_file(tmp_path) -> None:
    with pytest.raises(ModelConfigError, match="--model-config"):
        read_hf_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "config.json"
    bad.write_text("{nope")
    with pytest.raises(ModelConfigError, match=r"--model-config: got .*config\.json' \(not JSON: .*; allowed: a model's config\.json"):
        read_hf_config(str(bad))
    bad.write_text(json.dumps(LLAMA3_8B))
    assert read_hf_config(str(bad))["num_key_value_heads"] == 8
