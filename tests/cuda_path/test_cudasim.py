"""The CUDA backend on the simulated device: adversarial stream schedules, fences proven by mutation.

Every test here runs the real `CudaBackend` over `worker_side.testing.cuda_sim.SimCudaRuntime`: streams are queues
run in orders the simulator picks (copies first, compute first, random), the fake engine's forward is work
on the simulated compute stream, host registrations and current devices are checked. Passing runs show no
integrity error, leak or fault; the mutation tests show those checks fail when a fence is removed.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from cudasim_helpers import (
    LAYOUTS,
    caught,
    make_kv,
    random_fill,
    round_trip,
    run_on_sim,
    sim_case,
    sim_worker,
)

from offload_connector import load_config
from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import Workload, random_workload, run_workload, small_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker
from worker_side.backends.cuda.backend import CudaBackend
from worker_side.backends.cuda.fences import StepFences
from worker_side.testing.cuda_sim import SCHEDULES, SimCudaRuntime
from worker_side.testing.sim_compute import SimCompute

pytestmark = pytest.mark.cudasim

_reference: dict[int, dict[str, list[int]]] = {}


def reference_outputs(seed: int, num_requests: int = 24) -> dict[str, list[int]]:
    if seed not in _reference:
        with FakeEngine(small_config(num_gpu_blocks=64), connector=False) as engine:
            run_workload(engine, Workload(random_workload(seed, num_requests=num_requests, abort_fraction=0.15).requests))
            _reference[seed] = dict(engine.outputs)
    return _reference[seed]


def assert_clean(run, seed: int) -> None:
    s = run.engine.stats
    assert run.rt.faults == [], run.rt.faults[:3]
    assert s.integrity_errors == 0 and s.leaked_blocks == 0, (s.integrity_errors, s.leaked_blocks)
    assert run.rt.registrations == {}, "shutdown left host memory registered"
    ref = reference_outputs(seed)
    assert len(run.engine.outputs) + len(run.aborted) + s.rejected_requests == len(ref)  # rejected: > GPU pool
    for request_id, tokens in run.engine.outputs.items():
        assert tokens == ref[request_id], f"seed {seed}: request {request_id} diverged"


@pytest.mark.parametrize("chunk", range(8))
def test_replays_under_adversarial_schedules(chunk: int) -> None:
    """240 seeds: every schedule, eager/lazy, LRU/ARC, staged, kernel or DMA, one or two streams, polling or
    waiting."""
    totals = {"cpu_hit_tokens": 0, "kernel": 0, "batch": 0, "staged": 0}
    for seed in range(chunk * 30, chunk * 30 + 30):
        run = run_on_sim(seed, **sim_case(seed))
        assert_clean(run, seed)
        totals["cpu_hit_tokens"] += run.engine.stats.cpu_hit_tokens
        totals["kernel"] += run.rt.calls["launch_block_copy"]
        totals["batch"] += run.rt.calls["memcpy_batch"]
        totals["staged"] += run.rt.calls["launch_staged_copy"]
    assert all(v > 0 for v in totals.values()), totals


@pytest.mark.parametrize("chunk", range(3))
def test_tensor_parallel_replays_two_simulated_gpus(chunk: int) -> None:
    """TP 2: each rank's worker on its own device (checked on every call), rank-salted KV, events per rank."""
    cpu_hit_tokens = 0
    for seed in range(chunk * 20, chunk * 20 + 20):
        run = run_on_sim(seed, tp_size=2, **sim_case(seed))
        assert_clean(run, seed)
        assert {s.device for s in run.rt.streams} == {0, 1}
        cpu_hit_tokens += run.engine.stats.cpu_hit_tokens
    assert cpu_hit_tokens > 0


def fence_removed(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    original = StepFences.order

    def without(self: StepFences, job_kind: str, stream: object) -> None:
        if job_kind != kind:
            original(self, job_kind, stream)

    monkeypatch.setattr(StepFences, "order", without)


@pytest.mark.parametrize("kind", ["store", "load"])
def test_a_removed_fence_is_an_integrity_error(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Mutation check: without the store-after-compute (or load-after-earlier-readers) fence, copies race
    the forward on the simulated device and the fake model reads wrong KV."""
    assert caught(range(40), schedule="copy_first") == []
    fence_removed(monkeypatch, kind)
    assert caught(range(40), schedule="copy_first"), f"no run noticed the missing {kind} fence"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("path", ["kernel", "batch", "per_segment"])
def test_every_layout_round_trips_bit_exact(layout: str, schedule: str, path: str) -> None:
    rt = SimCudaRuntime(schedule=schedule, seed=7, supports_batch=path != "per_segment")
    kv = make_kv(rt, layout)
    w = sim_worker(rt, kv, 12, LAYOUTS[layout][0], kernel_max_segment_bytes=1 << 30 if path == "kernel" else 0)
    round_trip(rt, w, kv, gpu=[1, 2, 3, 9, 5], cpu=[30, 31, 32, 7, 12], targets=[4, 5, 6, 11, 1])
    used = {"kernel": "launch_block_copy", "batch": "memcpy_batch", "per_segment": "memcpy"}[path]
    assert rt.calls[used] > 0
    w.shutdown()
    assert rt.registrations == {}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_at_most_two_copy_calls_per_job(layout: str) -> None:
    """Kernel for small segments plus one batched DMA for the rest: <= 2 calls, whatever the block count."""
    rt = SimCudaRuntime(schedule="random", seed=3)
    kv = make_kv(rt, layout, num_layers=4)
    w = sim_worker(rt, kv, 12, LAYOUTS[layout][0], kernel_max_segment_bytes=256)
    rng = np.random.default_rng(0)
    for event, n in enumerate((1, 5, 11), start=1):
        gpu, cpu = rng.permutation(np.arange(1, 12))[:n].tolist(), rng.permutation(np.arange(1, 40))[:n].tolist()
        before = w.backend.num_copy_calls
        w.start_store(TransferMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=cpu))
        assert 1 <= w.backend.num_copy_calls - before <= 2
    w.wait_all()
    assert rt.faults == []
    w.shutdown()


def test_registration_in_page_aligned_chunks_and_runs_cut_at_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool far larger than one registration may be (64 KiB here, 64 GiB in production): many page-aligned
    registrations, none sharing a page, and runs of blocks that cross one are cut, so nothing straddles."""
    monkeypatch.setattr("worker_side.host_pool.MAX_REGISTRATION_BYTES", 64 << 10)
    rt = SimCudaRuntime(schedule="copy_first", seed=1, max_register_bytes=64 << 10)
    kv = {f"l{i}": random_fill(rt.alloc_device((2, 300, 16, 2, 32), torch.float16), i) for i in range(2)}  # 2 KiB chunks
    w = OffloadWorker(load_config({"num_cpu_blocks": 200}), backend=CudaBackend(runtime=rt, kernel_max_segment_bytes=0))
    w.register_kv_caches(kv, num_gpu_blocks=300)
    assert len(rt.registrations) > 4 and w.host_pool.rows_per_registration == 32
    assert all(ptr % 4096 == 0 for ptr in rt.registrations)
    round_trip(rt, w, kv, gpu=list(range(10, 80)), cpu=list(range(20, 90)), targets=list(range(100, 170)))
    w.shutdown()
    assert rt.registrations == {}


def test_rank1_worker_never_touches_device_0() -> None:
    """A rank's thread may start on device 0 (CUDA's default); the backend makes its device current before
    any call, so no context is created on GPU 0 and every stream, event and registration is device 1's."""
    rt = SimCudaRuntime(num_devices=2, schedule="random", seed=2)
    kv = make_kv(rt, "kv_first", device=1)
    touched: dict[str, set[int]] = {}

    def rank1() -> None:
        w = sim_worker(rt, kv, 12, rank=1)
        round_trip(rt, w, kv, gpu=[1, 2, 3], cpu=[5, 6, 7], targets=[8, 9, 10])
        w.shutdown()
        touched["rank1"] = rt.devices_touched[threading.get_ident()]

    thread = threading.Thread(target=rank1)
    thread.start()
    thread.join()
    assert touched["rank1"] == {1} and rt.faults == [] and rt.registrations == {}


def test_without_setting_the_device_rank1_would_touch_device_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with `_use_device` a no-op, the thread works on device 0."""
    monkeypatch.setattr(CudaBackend, "_use_device", lambda self: None)
    rt = SimCudaRuntime(num_devices=2, seed=2)
    kv = make_kv(rt, "kv_first", device=1)
    def rank1() -> None:
        with contextlib.suppress(Exception):  # registration in device 0's context, streams of the wrong device
            sim_worker(rt, kv, 12, rank=1).shutdown()

    thread = threading.Thread(target=rank1)
    thread.start()
    thread.join()
    assert 0 in set().union(*rt.devices_touched.values())


def test_pinning_failure_falls_back_to_pageable_memory(caplog: pytest.LogCaptureFixture) -> None:
    """cudaHostRegister fails (memlock limit, RAM): one warning, a counter, staged copies; the engine runs."""
    with caplog.at_level("WARNING", logger="worker_side.backends.cuda.backend"):
        run = run_on_sim(5, schedule="copy_first", num_gpu_blocks=16, num_cpu_blocks=30, fail_register=True)
    assert_clean(run, 5)
    backend = run.engine.worker.backend
    assert backend.num_pin_failures == 1 and not backend.pinned
    assert len([r for r in caplog.records if "pinning failed" in r.getMessage()]) == 1
    assert run.rt.calls["memcpy"] > 0 and run.rt.calls["memcpy_batch"] == 0
    assert run.rt.calls["launch_block_copy"] == 0 and run.engine.stats.cpu_hit_tokens > 0


def test_a_small_segment_ring_falls_back_to_dma() -> None:
    """Tables the ring cannot hold go by batched DMA; tables in use are never overwritten."""
    for seed in range(6):
        rt = SimCudaRuntime(schedule=SCHEDULES[seed % 3], seed=seed)
        backend = CudaBackend(runtime=rt, kernel_max_segment_bytes=1 << 20, ring_entries=16)
        cfg = small_config(num_gpu_blocks=16, num_cpu_blocks=30)
        wl = random_workload(seed, num_requests=24)
        with FakeEngine(cfg, backend=backend, compute=SimCompute(rt), wait_for_loads=False) as engine:
            run_workload(engine, wl)
        assert engine.stats.integrity_errors == 0 and engine.stats.leaked_blocks == 0 and rt.faults == []
        assert rt.calls["memcpy_batch"] > 0 and rt.calls["launch_block_copy"] > 0


def test_loads_never_block_the_engine_thread() -> None:
    """get_finished only polls on CUDA: no synchronize call; the load is reported once the sim ran it."""
    rt = SimCudaRuntime(schedule="compute_first", seed=0, burst=0)  # nothing runs unless asked
    kv = make_kv(rt, "kv_first")
    w = sim_worker(rt, kv, 12)
    w.begin_step()
    w.start_load(TransferMetadata(load_event=1, load_gpu_blocks=[1, 2], load_cpu_blocks=[3, 4],
                                  load_event_reqs=["r"]))
    assert w.get_finished().finished_load_reqs == []  # still queued: not waited for
    assert rt.calls["synchronize_event"] == 0 and rt.calls["synchronize_stream"] == 0
    rt.drain()
    assert w.get_finished().finished_load_reqs == ["r"]
    w.shutdown()


def stores_through_a_tiny_ring(rt: SimCudaRuntime) -> OffloadWorker:
    """Three 2-block stores through an 8-entry ring while nothing runs: the third does not fit (job 1's
    block ids are still unread), so it must go by DMA rather than overwrite them."""
    kv = make_kv(rt, "kv_first")
    w = sim_worker(rt, kv, 12, kernel_max_segment_bytes=1 << 20, ring_entries=8)
    for event, ids in enumerate(([1, 2], [3, 4], [5, 6]), start=1):
        w.start_store(TransferMetadata(store_event=event, store_gpu_blocks=ids, store_cpu_blocks=ids))
    rt.drain()
    assert sorted(w.get_finished().completed_store_events) == [1, 2, 3]
    return w


def test_kernel_arguments_stay_intact_until_their_job_ran() -> None:
    rt = SimCudaRuntime(seed=0, burst=0)
    w = stores_through_a_tiny_ring(rt)
    assert rt.calls["launch_block_copy"] == 2 and rt.calls["memcpy_batch"] == 1
    for b in range(1, 7):
        assert torch.equal(w.host_pool[b], torch.cat([v.block_tensor(b) for v in w._views])), b
    w.shutdown()


def test_a_ring_released_at_launch_corrupts_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check for the test above: freeing ring space at launch lets job 3 overwrite job 1's ids."""
    from worker_side.backends.cuda.arg_ring import ArgRing

    write = ArgRing.write

    def write_and_release(self: ArgRing, *arrays: np.ndarray) -> tuple[int, int] | None:
        out = write(self, *arrays)
        if out is not None:
            self.release(out[1])
            return out[0], 0
        return None

    monkeypatch.setattr(ArgRing, "write", write_and_release)
    rt = SimCudaRuntime(seed=0, burst=0)
    w = stores_through_a_tiny_ring(rt)
    views = w._views
    assert not all(torch.equal(w.host_pool[b], torch.cat([v.block_tensor(b) for v in views])) for b in (1, 2))
    w.shutdown()


def test_aborts_in_every_transfer_state_on_the_simulated_gpu() -> None:
    """Aborts while a request holds a pending hit, loads, has a store in flight or is preempted, with the
    copies and the forward queued on simulated streams (copies first, so transfers are still running)."""
    from offload_connector.fake_engine.workload import ABORT_STATES, run_aborting_in_states

    totals = dict.fromkeys(ABORT_STATES, 0)
    for seed in range(8):
        rt = SimCudaRuntime(schedule=("copy_lag", "random")[seed % 2], seed=seed)
        cfg = small_config(num_gpu_blocks=16 + seed % 3 * 4, num_cpu_blocks=24,
                           store_policy="lazy" if seed % 2 else "eager")
        wl = random_workload(seed, num_requests=30)
        with FakeEngine(cfg, backend=CudaBackend(runtime=rt), compute=SimCompute(rt), wait_for_loads=False) as e:
            aborted, hits = run_aborting_in_states(e, wl, seed)
        assert e.stats.integrity_errors == 0 and e.stats.leaked_blocks == 0 and rt.faults == []
        assert rt.registrations == {}
        for state, n in hits.items():
            totals[state] += n
    assert all(n > 0 for n in totals.values()), totals
