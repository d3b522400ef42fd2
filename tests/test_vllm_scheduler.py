"""OffloadConnector inside vLLM's real `Scheduler`, stepped with fake model-runner outputs.

The fake "worker" completes each step's transfers the way our worker role reports them: loads as
`finished_recving` for vLLM and in the rank's `OffloadWorkerMetadata` report for us (optionally held back
to model a slow load), stores in that report. No model runs; the tiny config-only model dir only feeds vLLM's config.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from offload_connector.metadata import WorkerReport, encode  # noqa: E402
from offload_connector.vllm_connector import OffloadConnector, OffloadWorkerMetadata  # noqa: E402

MODEL_DIR = str(Path(__file__).parent / "tiny_llama")
BS = 16
EOS = 2
TOKEN = 7  # every fake sampled token

init_none_hash(sha256)


class Sim:
    """vLLM's Scheduler + our connector; `step()` plays the model runner and our worker role."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int = 32, max_num_batched_tokens: int = 64,
                 max_num_seqs: int = 4, kv_events: bool = False, failure_policy: str = "fail",
                 **extra: object) -> None:
        model_config = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float32", seed=0)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024,
            enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
        cache_config = CacheConfig(block_size=BS, enable_prefix_caching=True)
        cache_config.kv_cache_layout = "LBNHC"
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks, **extra},
            kv_load_failure_policy=failure_policy)
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config, kv_transfer_config=kv_transfer,
                                 device_config=DeviceConfig("cpu"),
                                 kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events,
                                                                 publisher="null"))
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32))])
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                               structured_output_manager=StructuredOutputManager(vllm_config), block_size=BS)
        self.connector: OffloadConnector = self.sched.connector  # type: ignore[assignment]
        self.step_no = 0
        self.hold_loads = False
        self._held: set[str] = set()
        self.scheduled: list[dict[str, int]] = []  # per step: req_id -> scheduled tokens
        self.loads: list[list[str]] = []  # per step: requests whose load was issued
        self.preempted: set[str] = set()
        self.stats = OffloadConnector.build_kv_connector_stats()  # what vLLM's stats logger receives
        self.kv_events: list = []  # what vLLM's scheduler publishes from take_events()
        take_events = self.connector.take_events

        def recording_take_events():
            events = list(take_events())
            self.kv_events.extend(events)
            return events

        self.connector.take_events = recording_take_events  # type: ignore[method-assign]

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        req = Request(req_id, tokens, params, None, block_hasher=get_request_block_hasher(BS, sha256))
        self.sched.add_request(req)
        return req

    def step(self) -> dict[str, int]:
        out = self.sched.schedule()
        self.step_no += 1
        meta = out.kv_connector_metadata.transfer
        self.preempted |= set(out.preempted_req_ids or ())
        self.scheduled.append(dict(out.num_scheduled_tokens))
        self.loads.append(list(meta.load_event_reqs))
        kv_output = self.run_workers(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.sched.requests[req_id]
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=kv_output)
        for eco in self.sched.update_from_output(out, runner_out).values():
            data = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            if data:
                self.stats.aggregate(OffloadConnector.build_kv_connector_stats(data))
        return dict(out.num_scheduled_tokens)

    def run_workers(self, out) -> KVConnectorOutput:
        """Our worker role, faked: loads issued in start_load_kv finish within the step (unless held);
        stores issued after the forward complete too."""
        meta = out.kv_connector_metadata.transfer
        self._held |= set(meta.load_event_reqs)
        finished_recving: set[str] = set()
        if not self.hold_loads:
            finished_recving, self._held = self._held, set()
        report = WorkerReport(completed_store_events=[] if meta.store_event is None else [meta.store_event],
                              finished_load_reqs=sorted(finished_recving))  # as the real rank: both channels
        return KVConnectorOutput(finished_recving=finished_recving or None,
                                 kv_connector_worker_meta=OffloadWorkerMetadata(reports=[encode(report)]))

    def run_until_idle(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError(f"scheduler still busy after {max_steps} steps")

    def assert_no_leaks(self) -> None:
        pool = self.sched.kv_cache_manager.block_pool
        assert not self.sched.requests
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        offload = self.connector.offload
        assert offload is not None and offload.is_idle()
        offload.check_integrity()
        assert offload.cpu_pool.num_held_blocks() == 0


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


@pytest.mark.parametrize(("policy", "eviction"), [("eager", "lru"), ("lazy", "lru"), ("lazy", "arc")])
def test_cpu_hit_loads_then_computes_only_uncached_tokens(policy: str, eviction: str) -> None:
    # 5 usable GPU blocks: one 64-token request fills them
    sim = Sim(num_gpu_blocks=6, store_policy=policy, eviction=eviction)
    prefix = tokens(1, 48)
    # 1. A runs; its full blocks are stored to the CPU tier (eager: as they are computed; lazy: when it
    #    finishes, since the nearly full GPU pool would evict them at the next allocation).
    sim.add("A", prefix + tokens(2, 16))
    sim.run_until_idle()
    assert sim.connector.offload.stats.num_stored_blocks >= 4
    # 2. C, with unrelated tokens, needs every GPU block: A's cached blocks are evicted from the GPU.
    sim.add("C", tokens(3, 64))
    sim.run_until_idle()
    # 3. B shares A's first 3 blocks: no GPU hit, a CPU hit of 48 tokens; it waits for its load.
    sim.add("B", prefix + tokens(4, 16))
    admitted = sim.step_no + 1
    assert sim.step() == {}
    assert sim.loads[-1] == ["B"]
    assert sim.sched.requests["B"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # 4. The load was reported in the admission step: B computes in the very next step, only the
    #    16 tokens that were not on the CPU.
    first = sim.step()
    assert first == {"B": 16}
    assert sim.step_no - admitted == 1  # steps from admission to first compute
    assert sim.connector.offload.stats.num_hit_tokens == 48
    assert sim.connector.offload.stats.num_loaded_blocks == 3
    # 5. Everything finishes and nothing stays referenced.
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_gpu_hit_is_not_loaded_again() -> None:
    sim = Sim(num_gpu_blocks=32)
    prefix = tokens(5, 48)
    sim.add("A", prefix + tokens(6, 16))
    sim.run_until_idle()
    # 1. A's blocks are still cached on the GPU: B takes them from there, nothing is loaded.
    sim.add("B", prefix + tokens(7, 16))
    assert sim.step() == {"B": 16}
    assert all(not loads for loads in sim.loads)
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_preemption_and_resume() -> None:
    sim = Sim(num_gpu_blocks=7, max_num_batched_tokens=128)  # 6 usable blocks; two requests want 8
    sim.add("P1", tokens(8, 40), max_tokens=30)
    sim.add("P2", tokens(9, 40), max_tokens=30)
    sim.run_until_idle(max_steps=400)
    # 1. The GPU pool ran out during decode: vLLM preempted a request, which resumed and finished.
    assert sim.preempted
    # 2. Both requests produced all their tokens; no block is left referenced.
    sim.assert_no_leaks()
    assert sim.connector.offload.stats.num_stored_blocks > 0


def test_abort_while_waiting_for_load() -> None:
    sim = Sim(num_gpu_blocks=6)
    prefix = tokens(10, 48)
    sim.add("A", prefix + tokens(11, 16))
    sim.run_until_idle()
    sim.add("C", tokens(12, 64))
    sim.run_until_idle()
    # 1. B gets a CPU hit; its load is slow (not reported yet).
    sim.hold_loads = True
    sim.add("B", prefix + tokens(13, 16))
    sim.step()
    assert sim.loads[-1] == ["B"]
    load_gpu_blocks = sim.connector.offload._requests["B"].load.gpu_block_ids
    # 2. The client aborts B while its load is in flight: the target GPU blocks stay referenced.
    sim.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    sim.step()
    pool = sim.sched.kv_cache_manager.block_pool
    assert all(pool.blocks[i].ref_cnt > 0 for i in load_gpu_blocks)
    # 3. The load completes; vLLM and the connector release everything.
    sim.hold_loads = False
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_cpu_pool_full_skips_stores_without_failing() -> None:
    sim = Sim(num_gpu_blocks=32, num_cpu_blocks=3)  # room for 2 blocks only
    sim.add("A", tokens(14, 96))
    sim.run_until_idle()
    stats = sim.connector.offload.stats
    assert stats.num_stored_blocks + stats.num_store_skipped_blocks >= 6
    sim.assert_no_leaks()


def test_stats_and_kv_events_reach_vllm() -> None:
    sim = Sim(num_gpu_blocks=6, kv_events=True)
    prefix = tokens(15, 48)
    a = sim.add("A", prefix + tokens(16, 16))
    sim.run_until_idle()
    sim.add("C", tokens(17, 64))
    sim.run_until_idle()
    sim.add("B", prefix + tokens(18, 16))
    sim.run_until_idle()
    # 1. The per-step deltas vLLM collected add up to the scheduler side's running counters.
    counters = sim.connector.offload.stats
    summary = sim.stats.reduce()
    assert summary["num_stored_blocks"] == counters.num_stored_blocks > 0
    assert summary["num_loaded_blocks"] == counters.num_loaded_blocks == 3
    assert summary["num_hit_tokens"] == 48
    assert 0 < summary["cpu_hit_rate"] <= 1
    assert summary["cpu_blocks_total"] == 31
    # 2. Stored blocks were published as BlockStored events with medium CPU.
    stored = [e for e in sim.kv_events if type(e).__name__ == "BlockStored"]
    assert len(stored) == counters.num_stored_blocks
    assert all(e.medium == "CPU" and e.block_size == BS for e in stored)
    # Same hash form as vLLM's own GPU events, so a router can match the tiers.
    assert {maybe_convert_block_hash(h) for h in a.block_hashes} <= {e.block_hashes[0] for e in stored}
    sim.assert_no_leaks()


def test_cpu_eviction_publishes_block_removed() -> None:
    sim = Sim(num_gpu_blocks=32, num_cpu_blocks=4, kv_events=True)  # 3 usable CPU blocks
    sim.add("A", tokens(19, 64))
    sim.run_until_idle()
    sim.add("B", tokens(20, 64))
    sim.run_until_idle()
    removed = [e for e in sim.kv_events if type(e).__name__ == "BlockRemoved"]
    assert removed and all(e.medium == "CPU" for e in removed)
    assert sim.stats.reduce()["num_cpu_evictions"] == len(removed)
    sim.assert_no_leaks()


def test_stats_reach_vllm_every_n_steps_and_when_quiet() -> None:
    """The tracker reports deltas every `every` steps (sums unchanged) and at once on `flush`."""
    from offload_connector.vllm_stats import COUNTERS, StatsTracker

    tracker, total = StatsTracker(every=4), [0] * len(COUNTERS)
    assert COUNTERS[0] == "num_lookups"
    gauges = dict  # no gauges: only the counters matter here

    def values() -> tuple[int, ...]:
        return tuple(total)

    reports = []
    for _ in range(10):
        total[0] += 1
        reports.append(tracker.take(values, gauges))
    assert [r is not None for r in reports] == [False, False, False, True] * 2 + [False, False]
    assert sum(r.counters["num_lookups"] for r in reports if r) == 8  # two steps not reported yet
    total[0] += 1
    flushed = tracker.take(values, gauges, flush=True)
    assert flushed is not None and flushed.counters["num_lookups"] == 3  # the rest, at once
    assert tracker.take(values, gauges, flush=True) is None  # nothing changed since
    with pytest.raises(ValueError, match="every"):
        StatsTracker(every=0)
