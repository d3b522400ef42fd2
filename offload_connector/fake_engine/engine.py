"""The fake engine: one object wiring the scheduler, the fake model and (optionally) the connector.

Step order, mirroring vLLM v1 (SPEC §4-§5):
1. `EngineScheduler.schedule()` (GPU prefix lookup, connector lookup, allocation, `update_state_after_alloc`),
   then `OffloadScheduler.build_connector_meta` (scheduler side);
2. worker side around the forward: `start_load(meta)`, fake-model forward (verify reads, write K/V),
   `start_store(meta)`, `get_finished()`;
3. back on the scheduler side: the forward's results, then `update_connector_output(report)`.
With `connector=False` the same engine runs without any offloading (the reference for equal outputs).

`drain()` runs empty connector steps until every transfer is done and applied; `check()` then counts blocks still
referenced (leaks) and runs every pool's `check_integrity()`. The engine owns the worker and shuts it down
in `close()`; use it as a context manager.
"""

from __future__ import annotations

import msgspec

from offload_connector.config import OffloadConfig
from offload_connector.fake_engine.gpu_cache import GpuCache
from offload_connector.fake_engine.model import FakeModel
from offload_connector.fake_engine.request import EngineRequest, RequestStatus
from offload_connector.fake_engine.scheduler import EngineScheduler
from offload_connector.fake_engine.stats import EngineStats
from scheduler_side import OffloadScheduler
from worker_side import OffloadWorker, TransferBackend

MAX_IDLE_STEPS = 100_000  # steps in a row with nothing computed before we call it a stall (our bug)


class EngineStallError(RuntimeError):
    """The engine has unfinished requests but cannot make progress: a scheduling or ref-count bug."""


class FakeEngine:
    def __init__(self, config: OffloadConfig, connector: bool = True, backend: TransferBackend | None = None,
                 wait_for_loads: bool = True, sync_stores: bool = False) -> None:
        eng = config.engine
        if eng.num_cpu_blocks is not None and config.num_cpu_blocks is None:
            config = msgspec.structs.replace(config, num_cpu_blocks=eng.num_cpu_blocks)
        self.config = config
        self.block_size = eng.block_size
        self.stats = EngineStats()
        self.model = FakeModel(eng)
        self.gpu = GpuCache(eng.num_gpu_blocks, eng.block_size)
        self.wait_for_loads = wait_for_loads
        # sync_stores: each step's stores complete before the next step is scheduled (deterministic
        # replays; on a GPU a step's stores finish well within the next step). Default: reported when done.
        self.sync_stores = sync_stores
        self.worker: OffloadWorker | None = None
        self.connector: OffloadScheduler | None = None
        if connector:
            self.worker = OffloadWorker(config, backend=backend)
            self.worker.register_kv_caches(self.model.kv_caches, num_gpu_blocks=eng.num_gpu_blocks)
            self.connector = OffloadScheduler(
                config, eng.block_size, self.worker.num_cpu_blocks, self.gpu.view,
                max_blocks_per_step=None, num_gpu_blocks=eng.num_gpu_blocks)
        self.gpu.pool.on_evict = self._on_gpu_evict
        self.scheduler = EngineScheduler(eng, self.gpu, self.connector, self.stats, self.model.release)
        self.outputs: dict[str, list[int]] = {}  # finished request id -> generated tokens
        self._idle_steps = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> EngineRequest:
        req = EngineRequest(request_id, list(prompt_token_ids), max_tokens, self.block_size,
                            hash_algo=self.config.hash_algo)
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
        if self.connector is not None and self.worker is not None:
            meta = self.connector.build_connector_meta(out.step_requests)
            self.worker.start_load(meta)
        try:
            sampled = self.model.forward(out.chunks)
        finally:
            self.stats.integrity_errors = self.model.num_integrity_errors
            self.stats.verified_tokens = self.model.num_verified_tokens
        if meta is not None and self.worker is not None:
            self.worker.start_store(meta)
        finished = self.scheduler.update_from_output(out, sampled)
        for req in finished:
            self.outputs[req.request_id] = list(req.output_token_ids)
        self._poll_worker(self.wait_for_loads)
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

    def _on_gpu_evict(self, key: bytes, evicted: bool) -> None:
        """An allocation took a cached GPU block: count it, and whether the CPU tier had its content."""
        if not evicted:
            return
        self.stats.gpu_evictions += 1
        if self.connector is not None and not self.connector.is_saved(key):
            self.stats.gpu_evictions_unsaved += 1

    def _poll_worker(self, wait_for_loads: bool) -> None:
        if self.worker is None or self.connector is None:
            return
        if self.sync_stores:
            self.worker.wait_all()
        report = self.worker.get_finished(wait_for_loads=wait_for_loads)
        self.connector.update_connector_output(report)
        self.scheduler.update_from_connector(report)
        self.stats.bytes_stored += report.bytes_stored
        self.stats.bytes_loaded += report.bytes_loaded

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
        if self.worker is None or self.connector is None:
            return
        for _ in range(1000):
            if self.worker.num_in_flight == 0 and self.connector.is_idle():
                break
            meta = self.connector.build_connector_meta([])
            self.worker.start_load(meta)
            self.worker.start_store(meta)
            self.worker.wait_all()
            self._poll_worker(wait_for_loads=False)
        else:
            raise EngineStallError("transfers still in flight after 1000 drain rounds (our bug)")

    def check(self) -> int:
        """Drain, count blocks still referenced beyond live requests (leaks), check every pool's invariants."""
        self.drain()
        live_gpu = sum(len(r.gpu_block_ids) for r in self.scheduler.requests.values())
        self.gpu.pool.check_integrity()
        self.stats.leaked_gpu_blocks = self.gpu.pool.num_held_blocks() - live_gpu
        if self.connector is not None:
            self.connector.check_integrity()
            held = self.connector.cpu_pool.num_held_blocks()
            self.stats.leaked_cpu_blocks = held if self.connector.is_idle() else 0
        self.stats.leaked_blocks = self.stats.leaked_gpu_blocks + self.stats.leaked_cpu_blocks
        return self.stats.leaked_blocks

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_status(self, request_id: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(request_id)
        return req.status if req is not None else None
