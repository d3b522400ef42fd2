"""End to end on a hybrid model: `vllm.LLM` on a tiny config-only Gemma-2-style model (`tiny_gemma2`: sliding
window of 64 tokens on layers 0 and 2, full attention on layers 1 and 3; dummy weights).

What this pins is today's support, HMA off: the connector does not declare vLLM's `SupportsHMA`, so vLLM
turns its hybrid KV cache manager off and keeps one full-attention group holding every layer (the
sliding-window layers still attend only within their window). Checked: vLLM's config says HMA is off and
there is one group; greedy outputs equal those of the same model without the connector (HMA off, and HMA
on: the cache layout does not change the numbers); prefixes evicted from the 10-block GPU cache come back
from the CPU tier (`num_cached_tokens` > 0 on the re-run, blocks loaded), and a corrupted host pool then
changes the output (the equality depends on the loaded bytes). Per-group offload with HMA on is
issue 13's remaining work (docs/vllm.md, "Hybrid models").
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

MODEL_DIR = str(Path(__file__).parent / "tiny_gemma2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


X, Y = tokens(1, 160), tokens(2, 192)  # 5 and 6 blocks: more than the 64-token window
# Each prompt alone, in order: Y evicts X's blocks from the 10-block GPU cache; X + c finds them on the CPU.
PROMPTS = [X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16), Y + tokens(14, 16)]
# Run last; with the connector after its host pool is corrupted: X's prefix then loads garbage.
CORRUPTED = X + tokens(15, 16)


def make_llm(kv_transfer_config: KVTransferConfig | None, hma: bool | None) -> LLM:
    """`hma` None lets vLLM decide (off with a connector lacking `SupportsHMA`, on otherwise)."""
    return LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32,
               enforce_eager=True, max_model_len=256, num_gpu_blocks_override=None if hma else 10,
               max_num_seqs=4, max_num_batched_tokens=256, seed=0, dtype="float32",
               disable_hybrid_kv_cache_manager=None if hma is None else not hma,
               kv_transfer_config=kv_transfer_config)


def run(llm: LLM) -> dict:
    core = llm.llm_engine.engine_core.engine_core
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "hma": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups],
    }
    connector = core.scheduler.connector
    if connector is not None:
        result["stats"] = connector.offload.stats.snapshot()
        result["idle"] = connector.offload.is_idle() and connector.offload.cpu_pool.num_held_blocks() == 0
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().worker.host_pool.buffer.fill_(0x47)  # float32 ~ 4.7e4 everywhere
    loaded = connector.offload.stats.num_loaded_blocks if connector is not None else 0
    result["corrupted"] = list(llm.generate([{"prompt_token_ids": CORRUPTED}], GREEDY,
                                            use_tqdm=False)[0].outputs[0].token_ids)
    if connector is not None:
        result["corrupted_loaded"] = connector.offload.stats.num_loaded_blocks - loaded
    from vllm.distributed import cleanup_dist_env_and_memory

    core.shutdown()
    del llm, core
    gc.collect()
    cleanup_dist_env_and_memory()
    return result


@pytest.fixture(scope="module")
def runs() -> dict:
    kv_transfer = KVTransferConfig(
        kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
        kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB"})
    return {"connector": run(make_llm(kv_transfer, None)), "plain_off": run(make_llm(None, False)),
            "plain_on": run(make_llm(None, True))}


def test_vllm_turns_hma_off_for_the_connector(runs: dict) -> None:
    assert (runs["connector"]["hma"], runs["connector"]["groups"]) == (False, ["FullAttentionSpec"])
    assert (runs["plain_on"]["hma"], runs["plain_on"]["groups"]) == (True, ["SlidingWindowSpec",
                                                                             "FullAttentionSpec"])


def test_greedy_outputs_match_without_connector(runs: dict) -> None:
    assert runs["connector"]["outputs"] == runs["plain_off"]["outputs"] == runs["plain_on"]["outputs"]
    assert all(len(out) == GREEDY.max_tokens for out in runs["connector"]["outputs"])


def test_evicted_prefixes_come_back_from_the_cpu_tier(runs: dict) -> None:
    stats = runs["connector"]["stats"]
    assert stats["num_loaded_blocks"] > 0 and stats["num_failed_load_blocks"] == 0
    assert stats["num_hit_tokens"] == 32 * stats["num_loaded_blocks"]
    # X + c and Y + d re-use their 5- and 6-block prefixes: without the connector, the GPU cache lost them.
    assert runs["connector"]["cached"][2:] == [160, 192]
    assert runs["plain_off"]["cached"][2] < 160
    assert runs["connector"]["idle"]


def test_outputs_depend_on_the_loaded_bytes(runs: dict) -> None:
    """The equality above is not vacuous: loading X's prefix from a corrupted host pool changes the output."""
    assert runs["connector"]["corrupted_loaded"] > 0
    assert runs["plain_off"]["corrupted"] == runs["plain_on"]["corrupted"]
    assert runs["connector"]["corrupted"] != runs["plain_off"]["corrupted"]
