"""End to end on a hybrid model with vLLM's hybrid KV cache manager (HMA) on: `vllm.LLM` on a tiny
config-only Gemma-2-style model (`tiny_gemma2`: sliding window of 64 tokens on layers 0 and 2, full
attention on layers 1 and 3; dummy weights; block size 32).

The connector declares `SupportsHMA`, and with `store_policy` unset (lazy for one group) it runs a hybrid
model with eager stores, so vLLM keeps HMA on: two KV-cache groups (sliding window, full
attention) over one shared GPU block pool, and the connector stores and loads per group. Checked: vLLM's
config says HMA is on with both groups and its log has no "Turning off hybrid kv cache manager"; greedy
outputs equal those of the same model without the connector (HMA on and off); a prefix evicted from the
18-block GPU cache comes back from the CPU tier (`num_cached_tokens` > 0 on the re-run), its load holding
the full-attention blocks and only the window's blocks of the sliding-window group; and a corrupted host
pool then changes the output (the equality depends on the loaded bytes). With `store_policy: lazy`
(one group only) our plugin turns HMA off and the model runs with one group, outputs unchanged.
"""

from __future__ import annotations

import gc
import logging
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

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_gemma2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


X, Y = tokens(1, 160), tokens(2, 192)  # 5 and 6 blocks: more than the 64-token window
# Each prompt alone, in order: Y evicts X's blocks from the 18-block GPU cache (the smallest vLLM accepts
# for 256-token requests with HMA on); X + c finds them on the CPU.
# The last, unrelated, evicts X's blocks from the GPU again before the corrupted run.
PROMPTS = [X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16), Y + tokens(14, 16), tokens(3, 208)]
# Run last; with the connector after its host pool is corrupted: X's prefix then loads garbage.
CORRUPTED = X + tokens(15, 16)


class Warnings:
    """Every warning any logger handles while active. vLLM reconfigures logging while it builds an engine
    (`dictConfig` drops handlers added to its loggers), so this wraps `logging.Logger.handle` itself."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._handle = logging.Logger.handle

    def __enter__(self) -> list[str]:
        handle, messages = self._handle, self.messages

        def recording_handle(logger: logging.Logger, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())
            handle(logger, record)

        logging.Logger.handle = recording_handle  # type: ignore[method-assign]
        return messages

    def __exit__(self, *exc: object) -> None:
        logging.Logger.handle = self._handle  # type: ignore[method-assign]


def make_llm(kv_transfer_config: KVTransferConfig | None, hma: bool | None,
             gpu_blocks: int | None = None) -> tuple[LLM, list[str]]:
    """`hma` None lets vLLM decide (on for a connector declaring `SupportsHMA`, unless our plugin turns it
    off for a config that supports one group). Returns the engine and the warnings vLLM logged while
    building it. `gpu_blocks`: 18 with HMA on, 10 off, as small as vLLM accepts for 256-token requests."""
    gpu_blocks = gpu_blocks or (18 if hma is not False else 10)
    with Warnings() as warnings:
        llm = LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32,
                  enforce_eager=True, max_model_len=256, num_gpu_blocks_override=gpu_blocks,
                  max_num_seqs=4, max_num_batched_tokens=256, seed=0, dtype="float32",
                  disable_hybrid_kv_cache_manager=None if hma is None else not hma,
                  kv_transfer_config=kv_transfer_config)
    return llm, warnings


def run(llm_and_warnings: tuple[LLM, list[str]]) -> dict:
    llm, warnings = llm_and_warnings
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    loads: list[tuple[int, int]] = []  # per load: (GPU block ids of the full-attention group, of the window group)
    if connector is not None:
        offload = connector.offload
        update = offload.update_state_after_alloc

        def recording_update(request, gpu_block_ids, num_external_tokens):
            update(request, gpu_block_ids, num_external_tokens)
            job = offload.transfers.requests[request.request_id].load
            if job is not None and offload.hybrid is not None:  # one list per group
                window, full = (set(ids) for ids in gpu_block_ids)
                loads.append((len(full & set(job.gpu_block_ids)), len(window & set(job.gpu_block_ids))))

        offload.update_state_after_alloc = recording_update
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "hma": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups],
        "warnings": warnings,
    }
    if connector is not None:
        result["store_policy"] = connector.config.store_policy
        result["stats"] = connector.offload.stats.snapshot()
        result["idle"] = connector.offload.is_idle() and connector.offload.cpu_pool.num_held_blocks() == 0
        result["loads"] = list(loads)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
        result["worker_bytes_per_block"] = worker.bytes_per_block
        result["scheduler_bytes_per_block"] = connector.shape.bytes_per_block
        from offload_connector.vllm.early_check import estimated_bytes_per_block

        result["early_bytes_per_block"] = estimated_bytes_per_block(llm.llm_engine.vllm_config)
        worker.host_pool.buffer.fill_(0x47)  # float32 ~ 4.7e4 everywhere
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
    lazy = KVTransferConfig(
        kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
        kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB", "store_policy": "lazy"})
    return {"connector": run(make_llm(kv_transfer, None)), "plain_on": run(make_llm(None, True)),
            "plain_off": run(make_llm(None, False)), "lazy": run(make_llm(lazy, None, gpu_blocks=10))}


def test_hma_stays_on_with_the_connector(runs: dict) -> None:
    groups = ["SlidingWindowSpec", "FullAttentionSpec"]
    assert (runs["connector"]["hma"], runs["connector"]["groups"]) == (True, groups)
    assert runs["connector"]["store_policy"] == "eager"  # unset: eager for a hybrid model
    assert (runs["plain_on"]["hma"], runs["plain_on"]["groups"]) == (True, groups)
    assert (runs["plain_off"]["hma"], runs["plain_off"]["groups"]) == (False, ["FullAttentionSpec"])
    assert not any("Turning off hybrid kv cache manager" in m for m in runs["connector"]["warnings"])
    # The handler does catch vLLM's warnings (the check above is not vacuous): the base class logs one.
    assert any("Initializing KVConnectorBase_V1" in m for m in runs["connector"]["warnings"])
    assert runs["connector"]["scheduler_bytes_per_block"] == runs["connector"]["worker_bytes_per_block"]


def test_the_start_up_check_sizes_blocks_as_the_connector_does(runs: dict) -> None:
    """The plugin's check before the engine starts reads the block size from the model's config: with HMA on
    a block holds one group's 2 layers (32 KiB), with it off (lazy) all 4 (64 KiB), as vLLM's KV spec says."""
    for name, expected in (("connector", 32768), ("lazy", 65536)):
        run = runs[name]
        assert run["early_bytes_per_block"] == run["scheduler_bytes_per_block"] == run["worker_bytes_per_block"] \
            == expected


def test_greedy_outputs_match_without_connector(runs: dict) -> None:
    assert runs["connector"]["outputs"] == runs["plain_on"]["outputs"] == runs["plain_off"]["outputs"]
    assert all(len(out) == GREEDY.max_tokens for out in runs["connector"]["outputs"])


def test_evicted_prefixes_come_back_from_the_cpu_tier(runs: dict) -> None:
    stats = runs["connector"]["stats"]
    assert stats["num_failed_load_blocks"] == 0
    # X + c re-uses X's 5 blocks: without the connector the 18-block GPU cache lost them.
    assert runs["connector"]["cached"][2] == 160 and runs["plain_on"]["cached"][2] == 0
    assert stats["num_hit_tokens"] >= 160
    # Its load: 5 full-attention blocks, and of the window group only blocks 3 and 4 ((160 - 63) // 32 = 3).
    assert runs["connector"]["loads"][0] == (5, 2)
    assert stats["num_loaded_blocks"] == sum(f + w for f, w in runs["connector"]["loads"])
    assert runs["connector"]["idle"]


def test_outputs_depend_on_the_loaded_bytes(runs: dict) -> None:
    """The equality above is not vacuous: loading X's prefix from a corrupted host pool changes the output."""
    assert runs["connector"]["corrupted_loaded"] > 0
    assert runs["plain_off"]["corrupted"] == runs["plain_on"]["corrupted"]
    assert runs["connector"]["corrupted"] != runs["plain_on"]["corrupted"]


def test_a_one_group_config_runs_with_hma_off(runs: dict) -> None:
    """`store_policy: lazy` works per single group: our plugin turns vLLM's HMA off (left unset by the user)
    instead of the engine refusing the hybrid model at start-up; outputs unchanged, prefixes come back."""
    lazy = runs["lazy"]
    assert (lazy["hma"], lazy["groups"], lazy["store_policy"]) == (False, ["FullAttentionSpec"], "lazy")
    assert lazy["outputs"] == runs["plain_on"]["outputs"]
    assert lazy["cached"][2] == 160 and lazy["stats"]["num_hit_tokens"] >= 160
    assert lazy["stats"]["num_failed_load_blocks"] == 0
    assert lazy["corrupted_loaded"] > 0 and lazy["corrupted"] != runs["plain_on"]["corrupted"]
