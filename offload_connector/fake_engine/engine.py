"""The fake engine: one object wiring the scheduler, the fake model and (optionally) the connector.

Step order, mirroring vLLM v1 (SPEC §4-§5):
1. `EngineScheduler.schedule()` (GPU prefix lookup, connector lookup, allocation, `update_state_after_alloc`),
   then `OffloadScheduler.build_connector_meta` (scheduler side);
2. worker side around the forward, in vLLM 0.32's order: `begin_step()` (bind_connector_metadata), the
   fake-model forward launched on the compute queue (verify reads, write K/V), `start_load(meta)` (async
   loads start after the forward launch), `start_store(meta)` (wait_for_save), `get_finished()`;
3. back on the scheduler side: the forward's results, then `update_connector_output(report)`.
With `connector=False` the same engine runs without any offloading (the reference for equal outputs).
With `tp_size` > 1 each tensor-parallel rank has its own model (KV shard), compute queue, backend and
worker (`compute` and `backend` then take one per rank): by default each rank holds `engine.num_kv_heads`
heads of its own (values salted by the rank); with `shard_heads` the model has `engine.num_kv_heads` heads
and rank r holds its even share of them, or one replicated head with fewer heads than ranks (values by
head: a TP 2 engine's rank 1 holds exactly the upper heads of a TP 1 engine's blocks, so a lower tier
shares blocks between them, per head). The connector counts each event once every rank reported it, and a
load lets its request resume once every rank finished it (vLLM's aggregation).
`compute` is where the forward runs: at once on the host (default), or on a simulated GPU's compute stream
(`worker_side.testing.sim_compute.SimCompute`, with a `CudaBackend` over the same simulator), where the engine never
waits for the forward, as with vLLM's async scheduling: transfers are ordered by their fences alone.

`drain()` runs empty connector steps until every transfer is done and applied (and the lower tiers'
queued writes are sent); `check()` then counts blocks still
referenced (leaks) and runs every pool's `check_integrity()` (the fake models' expected-K/V arenas included),
and raises `StoreReadOverlapError` if any worker was sent a store into host blocks a load in flight still
read (`OffloadWorker.num_stores_held_for_loads`: the worker ran it after that load, so no K/V went wrong,
but the scheduler broke its stores-and-reads invariant). `check_each_step` runs the connector's
`check_integrity()` and that overlap check after every step as well (O(CPU blocks) a step: tests, replays
with `--check-each-step`).
The engine owns the worker and shuts it down in `close()`; use it as a context manager.
Memory stays flat however many requests run (the connector emits no KV events here, done requests give
everything back), except for two records of one entry per request, each kept unless turned off:
`outputs` (every finished request's tokens; `keep_outputs`) and `stats.samples` (one `HitSample` per
admitted request, for plots; `keep_samples`).
"""

from __future__ import annotations

import msgspec

from offload_connector.config import OffloadConfig
from offload_connector.fake_engine.gpu_cache import GpuCache
from offload_connector.fake_engine.model import ComputeQueue, FakeModel, IntegrityError
from offload_connector.fake_engine.request import EngineRequest, RequestStatus
from offload_connector.fake_engine.scheduler import EngineScheduler
from offload_connector.fake_engine.stats import EngineStats
from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.metadata import WorkerReport
from offload_connector.tier_identity import TierIdentity, rank_heads
from scheduler_side import OffloadScheduler
from worker_side import OffloadWorker, TransferBackend

MAX_IDLE_STEPS = 100_000  # steps in a row with nothing computed before we call it a stall (our bug)


class EngineStallError(RuntimeError):
    """The engine has unfinished requests but cannot make progress: a scheduling or ref-count bug."""


class StoreReadOverlapError(IntegrityError):
    """A store was sent into host blocks that a load in flight still read: wrong K/V but for the worker,
    which ran the store after that load (the scheduler's bug)."""


def _per_rank(value: object, tp_size: int, what: str) -> list:
    values = list(value) if isinstance(value, list | tuple) else [value] * tp_size
    if len(values) != tp_size or (tp_size > 1 and value is not None and not isinstance(value, list | tuple)):
        raise ValueError(f"FakeEngine: with tp_size={tp_size} pass `{what}` as a list of {tp_size} (one per rank)")
    return values


def tier_identity(config: OffloadConfig, tp_size: int = 1, shard_heads: bool = False) -> TierIdentity | None:
    """The fake model's identity for the lower tiers' keys (None without one): engines with equal `engine:`
    sections and hash algorithm share blocks, as their K/V are the same function of the tokens. A model
    whose heads are the same at any TP (TP 1, or `shard_heads`) is stored per head (`kv_heads`): such
    engines share blocks whatever their TP; ranks salted apart are stored per rank."""
    if not lower_tier_sections(config):
        return None
    eng = config.engine
    per_head = tp_size == 1 or shard_heads
    return TierIdentity(model="offload-connector/fake-model", dtype=eng.dtype, kv_cache_dtype=eng.dtype,
                        block_size=eng.block_size, hash_algo=config.hash_algo,
                        layout=f"{eng.num_layers}x(2,{eng.block_size},{eng.num_kv_heads},{eng.head_dim}) kv_first",
                        kv_heads=eng.num_kv_heads if per_head else 0)


def _rank_heads(config: OffloadConfig, tp_size: int, shard_heads: bool) -> list[tuple[int, int] | None]:
    """Per rank: (first head, head count) of a head-sharded model (vLLM's split: fewer heads than ranks
    replicates each, as MLA's latent is on every rank), or None (heads of its own)."""
    heads = config.engine.num_kv_heads
    if not shard_heads:
        return [None] * tp_size
    if heads % tp_size and tp_size % heads:
        raise ValueError(f"FakeEngine: shard_heads needs engine.num_kv_heads ({heads}) and tp_size ({tp_size}) "
                         "to divide one another")
    return [(first, last - first) for first, last in (rank_heads(heads, r, tp_size) for r in range(tp_size))]


class FakeEngine:
    def __init__(self, config: OffloadConfig, connector: bool = True,
                 backend: TransferBackend | list[TransferBackend] | None = None, wait_for_loads: bool = True,
                 sync_stores: bool = False, compute: ComputeQueue | list[ComputeQueue] | None = None,
                 tp_size: int = 1, keep_outputs: bool = True, keep_samples: bool = True,
                 shard_heads: bool = False, check_each_step: bool = False) -> None:
        eng = config.engine
        if eng.num_cpu_blocks is not None and config.num_cpu_blocks is None:
            config = msgspec.structs.replace(config, num_cpu_blocks=eng.num_cpu_blocks)
        self.config = config
        self.block_size = eng.block_size
        self.stats = EngineStats()
        computes, backends = _per_rank(compute, tp_size, "compute"), _per_rank(backend, tp_size, "backend")
        self.models = [FakeModel(eng, compute=c, rank=r, heads=h)
                       for r, (c, h) in enumerate(zip(computes, _rank_heads(config, tp_size, shard_heads), strict=True))]
        identity = tier_identity(config, tp_size, shard_heads)
        self.model = self.models[0]
        self.gpu = GpuCache(eng.num_gpu_blocks, eng.block_size, self.model.groups)  # 2 groups: hybrid mode
        self.wait_for_loads = wait_for_loads
        # sync_stores: each step's stores complete before the next step is scheduled (deterministic
        # replays; on a GPU a step's stores finish well within the next step). Default: reported when done.
        self.sync_stores = sync_stores
        self.workers: list[OffloadWorker] = []
        self.worker: OffloadWorker | None = None  # rank 0's
        self.connector: OffloadScheduler | None = None
        if connector:
            for rank, (model, rank_backend) in enumerate(zip(self.models, backends, strict=True)):
                worker = OffloadWorker(config, world_size=tp_size, rank=rank, backend=rank_backend,
                                       tier_identity=identity)
                self.workers.append(worker)
                # (2, blocks, block_size, heads, head_dim): say so, 2 blocks would be ambiguous
                worker.register_kv_caches(model.kv_caches, num_gpu_blocks=eng.num_gpu_blocks,
                                          layout="kv_first", head_dim=3)
            self.worker = self.workers[0]
            self.connector = OffloadScheduler(
                config, eng.block_size, self.worker.num_cpu_blocks, self.gpu.view, tp_size,
                max_blocks_per_step=None, num_gpu_blocks=eng.num_gpu_blocks,
                emit_kv_events=False,  # nobody here takes them: kept, they grew with every request
                tier_identity=identity, groups=self.model.groups)
        self._load_reports: dict[str, int] = {}  # request id -> ranks that finished its load so far
        self.gpu.pool.on_evict = self._on_gpu_evict
        self.scheduler = EngineScheduler(eng, self.gpu, self.connector, self.stats, self._release,
                                         keep_samples=keep_samples)
        if self.gpu.hybrid:
            self.stats.group_gpu_hit_blocks = [0] * len(self.gpu.groups)
            self.stats.group_loaded_blocks = [0] * len(self.gpu.groups)
        self.keep_outputs = keep_outputs
        self.outputs: dict[str, list[int]] = {}  # finished request id -> generated tokens (if keep_outputs)
        self._idle_steps = 0
        self.check_each_step = check_each_step

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                    kv_transfer_params: dict | None = None) -> EngineRequest:
        req = EngineRequest(request_id, list(prompt_token_ids), max_tokens, self.block_size,
                            hash_algo=self.config.hash_algo, kv_transfer_params=kv_transfer_params)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[EngineRequest]:
        """Run one engine step; returns the requests that finished in it."""
        self.stats.steps += 1
        out = self.scheduler.schedule()
        meta = None
        if self.connector is not None:
            meta = self.connector.build_connector_meta(out.step_requests)
        sampled: dict[str, int] = {}
        try:
            for rank, model in enumerate(self.models):
                if meta is not None:
                    self.workers[rank].begin_step()
                sampled = model.forward(out.chunks)  # every rank samples the same tokens
                if meta is not None:
                    self.workers[rank].start_load(meta)
                    self.workers[rank].start_store(meta)
        finally:
            self._update_model_stats()
        finished = self.scheduler.update_from_output(out, sampled)
        if self.keep_outputs:
            for req in finished:
                self.outputs[req.request_id] = list(req.output_token_ids)
        self._poll_worker(self.wait_for_loads)
        if self.check_each_step and self.connector is not None:
            self.connector.check_integrity()
            self._check_store_reads()
        if out.chunks:
            self._idle_steps = 0
        else:
            self.stats.idle_steps += 1
            self._idle_steps += 1
            if self._idle_steps > MAX_IDLE_STEPS:
                raise EngineStallError(
                    f"{self._idle_steps} steps without progress; {len(self.scheduler.waiting)} waiting, "
                    f"{len(self.scheduler.running)} running, {self.gpu.pool.num_free_blocks} free GPU blocks")
        return finished

    def _release(self, req: EngineRequest) -> None:
        """The request is done (finished or aborted): every rank's model drops what it kept for it."""
        for model in self.models:
            model.release(req)

    def _on_gpu_evict(self, key: bytes, evicted: bool) -> None:
        """An allocation took a cached GPU block: count it, and whether the CPU tier had its content."""
        if not evicted:
            return
        self.stats.gpu_evictions += 1
        if self.connector is not None and not self.connector.is_saved(key):
            self.stats.gpu_evictions_unsaved += 1

    def _check_store_reads(self) -> None:
        """Raise `StoreReadOverlapError` if a worker was sent a store into host blocks a load in flight read."""
        held = [w.num_stores_held_for_loads for w in self.workers]
        if any(held):
            raise StoreReadOverlapError(f"stores sent into host blocks that a load in flight still read, per rank: "
                                        f"{held} (the workers ran them after those loads; a scheduler bug)")

    def _update_model_stats(self) -> None:
        self.stats.integrity_errors = sum(m.num_integrity_errors for m in self.models)
        self.stats.verified_tokens = sum(m.num_verified_tokens for m in self.models)

    def _poll_worker(self, wait_for_loads: bool) -> None:
        if not self.workers or self.connector is None:
            return
        if self.sync_stores:
            for worker in self.workers:
                worker.wait_all()
        reports = [worker.get_finished(wait_for_loads=wait_for_loads) for worker in self.workers]
        self.connector.update_connector_output(reports)
        self.scheduler.update_from_connector(self._all_ranks(reports))
        for report in reports:
            self.stats.bytes_stored += report.bytes_stored
            self.stats.bytes_loaded += report.bytes_loaded

    def _all_ranks(self, reports: list[WorkerReport]) -> WorkerReport:
        """What the engine learns: loads every rank finished (vLLM's finished_recving), any rank's failures."""
        if len(reports) == 1:
            return reports[0]
        merged = WorkerReport()
        for report in reports:
            merged.failed_load_gpu_blocks.extend(report.failed_load_gpu_blocks)
            for req_id in report.finished_load_reqs:
                n = self._load_reports.get(req_id, 0) + 1
                if n == len(reports):
                    self._load_reports.pop(req_id, None)
                    merged.finished_load_reqs.append(req_id)
                else:
                    self._load_reports[req_id] = n
        return merged

    def run(self, max_steps: int | None = None) -> None:
        """Step until every request is finished or aborted (or `max_steps` steps)."""
        n = 0
        while self.has_unfinished() and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    # ------------------------------------------------------------------ end of run
    def drain(self) -> None:
        """Finish every transfer: keep handing the connector empty steps (it may hold blocks for its next
        store event) and waiting for the worker, until both are idle."""
        if not self.workers or self.connector is None:
            return
        for _ in range(1000):
            if all(w.num_in_flight == 0 for w in self.workers) and self.connector.is_idle():
                break
            meta = self.connector.build_connector_meta([])
            for worker in self.workers:
                worker.start_load(meta)
                worker.start_store(meta)
                worker.wait_all()
            self._poll_worker(wait_for_loads=False)
        else:
            raise EngineStallError("transfers still in flight after 1000 drain rounds (our bug)")
        for worker in self.workers:
            worker.wait_all()  # the lower tiers' writes queued by the last completions reach them
        if any(worker.tier_ios for worker in self.workers):
            self._poll_worker(wait_for_loads=False)  # ... and the connector hears of them (their KV events)

    def check(self) -> int:
        """Drain, count blocks still referenced beyond live requests (leaks), check every pool's invariants."""
        self.drain()
        for model in self.models:
            model.compute.synchronize()  # the last forwards' checks (raises their IntegrityError)
        self._update_model_stats()
        live_gpu = sum(self.gpu.num_held(r) for r in self.scheduler.requests.values())
        self.gpu.pool.check_integrity()
        for model in self.models:
            model.check_integrity(self.scheduler.requests.values())
        self.stats.leaked_gpu_blocks = self.gpu.pool.num_held_blocks() - live_gpu
        if self.connector is not None:
            self.connector.check_integrity()
            self._check_store_reads()
            held = self.connector.cpu_pool.num_held_blocks()
            self.stats.leaked_cpu_blocks = held if self.connector.is_idle() else 0
        self.stats.leaked_blocks = self.stats.leaked_gpu_blocks + self.stats.leaked_cpu_blocks
        return self.stats.leaked_blocks

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.connector is not None:
            self.connector.close()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_status(self, request_id: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(request_id)
        return req.status if req is not None else None
