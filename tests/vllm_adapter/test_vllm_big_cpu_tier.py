"""`vllm.LLM` with a CPU tier far larger than the working set: lazy keeps every prefix, as eager does.

The tiny config-only LLaMA (dummy weights), 16 GPU blocks of 32 tokens, `cpu_bytes: 1GiB` (32,767 CPU
blocks of 32 KiB). Three prefixes of 192 tokens (6 blocks), each used three times, with a one-off prompt
of 192 tokens after every request, one request at a time: every prefix leaves vLLM's GPU cache between
its uses and must come back from the CPU tier. The tier never fills, so it must evict nothing, and lazy
must hit (the connector's `num_hit_tokens`) at least what eager hits: every reused prefix token.
With `cpu_bytes: 1MiB` (31 CPU blocks, twice the GPU's) the tier fills: there lazy, which keeps mostly what
the GPU does not, hits more than eager, whose tier repeats the GPU's blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_vllm_e2e import close  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from offload_connector.vllm.compat import in_process_connector  # noqa: E402

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_llama")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
PREFIX_TOKENS = 192


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11 + (i * i) % 7) % 800 for i in range(n)]


PREFIXES = [tokens(s, PREFIX_TOKENS) for s in (1, 2, 3)]
PROMPTS: list[tuple[bool, list[int]]] = []  # (a reuse of a prefix?, prompt)
for rnd in range(3):
    for p, prefix in enumerate(PREFIXES):
        PROMPTS.append((rnd > 0, prefix + tokens(100 + 10 * rnd + p, 16)))  # the prefix, its own tail
        PROMPTS.append((False, tokens(200 + 10 * rnd + p, PREFIX_TOKENS)))  # a one-off prompt


def run(store_policy: str, cpu_bytes: str = "1GiB") -> dict:
    kv = KVTransferConfig(
        kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
        kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": cpu_bytes, "store_policy": store_policy})
    llm = LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32, enforce_eager=True,
              max_model_len=256, num_gpu_blocks_override=16, max_num_seqs=4, max_num_batched_tokens=256, seed=0,
              dtype="float32", kv_transfer_config=kv)
    try:
        offload = in_process_connector(llm).offload
        outputs, cached, wanted = [], 0, 0
        for reused, prompt in PROMPTS:
            before = offload.stats.num_hit_tokens
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            outputs.append(list(out.outputs[0].token_ids))
            if reused:
                cached += out.num_cached_tokens
                wanted += PREFIX_TOKENS
            elif offload.stats.num_hit_tokens != before:
                raise AssertionError("a prompt seen for the first time hit the CPU tier")
        return {"outputs": outputs, "cached": cached, "wanted": wanted, "stats": offload.stats.snapshot(),
                "num_cpu_blocks": offload.cpu_pool.num_blocks}
    finally:
        close(llm)


@pytest.fixture(scope="module")
def runs() -> dict:
    return {(policy, size): run(policy, size) for policy in ("eager", "lazy") for size in ("1GiB", "1MiB")}


def test_the_tier_is_far_larger_than_the_working_set(runs: dict) -> None:
    assert runs[("lazy", "1GiB")]["num_cpu_blocks"] == 32768  # 1 GiB / 32 KiB (block 0 is the null block)
    assert runs[("lazy", "1MiB")]["num_cpu_blocks"] == 32


def test_lazy_evicts_nothing_and_hits_at_least_what_eager_hits(runs: dict) -> None:
    eager, lazy = runs[("eager", "1GiB")], runs[("lazy", "1GiB")]
    assert eager["stats"]["num_cpu_evictions"] == 0 and lazy["stats"]["num_cpu_evictions"] == 0
    assert eager["stats"]["num_hit_tokens"] == eager["wanted"] == 6 * PREFIX_TOKENS  # every reuse, from the CPU
    assert lazy["stats"]["num_hit_tokens"] >= eager["stats"]["num_hit_tokens"]
    assert lazy["cached"] >= eager["cached"] == eager["wanted"]  # vLLM's count: GPU and CPU hits
    assert lazy["outputs"] == eager["outputs"]


def test_with_a_tier_that_fills_lazy_hits_more_than_eager(runs: dict) -> None:
    eager, lazy = runs[("eager", "1MiB")], runs[("lazy", "1MiB")]
    assert lazy["stats"]["num_cpu_evictions"] > 0 and eager["stats"]["num_cpu_evictions"] > 0  # the tier filled
    assert lazy["cached"] > eager["cached"]
    assert lazy["outputs"] == eager["outputs"] == runs[("eager", "1GiB")]["outputs"]
