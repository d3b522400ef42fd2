"""The kernel-or-DMA policy: vLLM's defaults from the configuration, and the start-up calibration.

On the simulated device time follows a cost model (worker_side/testing/sim_timing.py: DMA pays per segment, the
kernel per byte), so the calibration sees the same figures on every run and a test can check that the
policy it picks sends each measured shape down the path that was faster, that it never leaves the KV cache
changed, and that it keeps to the directions the configuration allows.
"""

from __future__ import annotations

import logging

import pytest
import torch
from cudasim_helpers import random_fill

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker
from worker_side.backends.cuda.api import CudaError
from worker_side.backends.cuda.backend import CudaBackend
from worker_side.backends.cuda.kernel_policy import KernelPolicy, KernelRule
from worker_side.testing.cuda_sim import SimCudaRuntime, SimTiming

pytestmark = pytest.mark.cudasim


@pytest.fixture(autouse=True)
def one_dma_call_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the kernel-or-DMA rule against the simulator's cost model with DMA as one batched
    call per job; the product splits long jobs over several calls and two streams (copy_paths.dma), which
    makes the DMA side of the comparison depend on the segment count in steps."""
    monkeypatch.setattr("worker_side.backends.cuda.copy_paths.FIRST_BATCH", 1 << 30)
    monkeypatch.setattr("worker_side.backends.cuda.copy_paths.BATCH_SEGMENTS", 1 << 30)

CHUNK = 4096  # bytes per block per layer: runs of 1..32 blocks are segments of 4..128 KiB


def calibrated(rt: SimCudaRuntime, directions=("load", "store"), calibrate: bool = True,
               **options) -> tuple[OffloadWorker, dict[str, torch.Tensor]]:
    kv = {f"l{i}": random_fill(rt.alloc_device((80, CHUNK // 2), torch.float16), i) for i in range(2)}
    backend = CudaBackend(runtime=rt, kernel_directions=directions, kernel_min_segments=16,
                          kernel_max_segment_bytes=28 << 10, calibrate=calibrate, **options)
    w = OffloadWorker(load_config({"num_cpu_blocks": 100}), backend=backend)
    w.register_kv_caches(kv, num_gpu_blocks=80)
    return w, kv


def test_calibration_picks_the_faster_path_for_every_shape_it_measured() -> None:
    timing = SimTiming()
    rt = SimCudaRuntime(seed=0, timing=timing)
    w, _ = calibrated(rt)
    policy, measured = w.backend.policy, w.backend.calibration
    kinds = {m.kind for m in measured}
    assert kinds == {"load", "store"} and len(measured) > 10
    assert any(m.kernel_wins for m in measured) and not all(m.kernel_wins for m in measured)
    for m in measured:
        assert policy.use_kernel(m.kind, m.num_segments, m.avg_segment_bytes * m.num_segments) == m.kernel_wins, m
    for kind in ("load", "store"):
        rule = policy.rules[kind]
        # measured 4 .. 128 KiB; at 16 KiB the runs make only 16 segments, too few to repay the launch
        assert rule.max_segment_bytes == 8 << 10 < timing.crossover_bytes
        assert rule.min_segments == 8  # 2 layers x 4 scattered blocks: the launch cost is paid back from there
    w.shutdown()


def test_jobs_after_calibration_take_the_path_it_found_faster() -> None:
    rt = SimCudaRuntime(seed=1)
    w, _ = calibrated(rt)
    paths = w.backend.num_jobs_by_path
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=list(range(1, 40, 2)),
                                   store_cpu_blocks=list(range(1, 40, 2))))  # 20 scattered 4 KiB chunks x 2
    assert paths["kernel"] == 1
    w.start_store(TransferMetadata(store_event=2, store_gpu_blocks=list(range(41, 73)),
                                   store_cpu_blocks=list(range(41, 73))))  # one 128 KiB run per layer
    assert paths["batch"] == 1
    w.start_store(TransferMetadata(store_event=3, store_gpu_blocks=[75], store_cpu_blocks=[75]))  # 2 segments
    assert paths["batch"] == 2
    w.wait_all()
    assert sorted(w.get_finished().completed_store_events) == [1, 2, 3]
    w.shutdown()


def test_calibration_leaves_the_kv_cache_as_it_was() -> None:
    rt = SimCudaRuntime(seed=2, schedule="copy_first")
    kv = {f"l{i}": random_fill(rt.alloc_device((80, CHUNK // 2), torch.float16), 10 + i) for i in range(2)}
    before = {name: t.clone() for name, t in kv.items()}
    backend = CudaBackend(runtime=rt, calibrate=True)
    w = OffloadWorker(load_config({"num_cpu_blocks": 100}), backend=backend)
    w.register_kv_caches(kv, num_gpu_blocks=80)
    assert backend.calibration, "the calibration did not run"
    assert all(torch.equal(kv[name].view(torch.int16), before[name].view(torch.int16)) for name in kv)  # bytes
    assert rt.num_queued == 0 and rt.faults == []
    w.shutdown()


def test_a_kernel_slower_everywhere_leaves_dma_only() -> None:
    rt = SimCudaRuntime(seed=3, timing=SimTiming(kernel_bytes_per_s=1e9))
    w, _ = calibrated(rt)
    assert w.backend.policy.rules == {} and w.backend.policy.describe() == "load: DMA; store: DMA"
    w.shutdown()


def test_a_kernel_faster_everywhere_takes_every_size_measured() -> None:
    rt = SimCudaRuntime(seed=4, timing=SimTiming(dma_segment_s=50e-6, kernel_launch_s=1e-6))
    w, _ = calibrated(rt)
    assert w.backend.policy.rules["load"] == KernelRule(128 << 10, 2)  # 32-block runs of 4 KiB; one block x 2 layers
    w.shutdown()


def test_calibration_keeps_to_the_configured_directions() -> None:
    rt = SimCudaRuntime(seed=5)
    w, _ = calibrated(rt, directions=("load",))
    assert set(w.backend.policy.rules) == {"load"} and {m.kind for m in w.backend.calibration} == {"load"}
    w.shutdown()


def test_without_calibration_the_configured_policy_stays() -> None:
    rt = SimCudaRuntime(seed=6)
    w, _ = calibrated(rt, directions=("load",), calibrate=False)
    assert w.backend.policy == KernelPolicy({"load": KernelRule(28 << 10, 16)}) and not w.backend.calibration
    assert rt.calls["elapsed_s"] == 0
    w.shutdown()


def test_a_calibration_that_fails_keeps_the_configured_policy(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    rt = SimCudaRuntime(seed=7)

    def broken(start, end) -> float:
        raise CudaError("cuEventElapsedTime failed: CUDA_ERROR_INVALID_HANDLE (simulated)")

    monkeypatch.setattr(rt, "elapsed_s", broken)
    with caplog.at_level(logging.WARNING, logger="worker_side.backends.cuda.backend"):
        w, kv = calibrated(rt)
    assert w.backend.policy == KernelPolicy.make(("load", "store"), 28 << 10, 16)
    assert any("calibration on device 0 failed" in r.getMessage() for r in caplog.records)
    ring = w.backend.paths.rings["load"]
    assert ring.num_free == ring.capacity  # every launch it made was waited for and given back
    w.shutdown()


def test_sim_timing_events_measure_the_cost_model() -> None:
    timing = SimTiming()
    rt = SimCudaRuntime(seed=8, burst=0, timing=timing)
    src = rt.alloc_device((4, 1024), torch.uint8)
    host = torch.zeros(4 * 1024, dtype=torch.uint8)
    rt.host_register(host.data_ptr(), host.numel())
    stream = rt.create_stream(low_priority=False)
    start, end = rt.create_event(timing=True), rt.create_event(timing=True)
    rt.record_event(start, stream)
    rt.memcpy(host.data_ptr(), src.data_ptr(), 4096, stream)
    rt.record_event(end, stream)
    with pytest.raises(CudaError, match="NOT_READY"):
        rt.elapsed_s(start, end)
    rt.synchronize_event(end)
    assert rt.elapsed_s(start, end) == pytest.approx(timing.dma_seconds(1, 4096))
    with pytest.raises(CudaError, match="without timing"):
        rt.elapsed_s(rt.create_event(), end)
    rt.host_unregister(host.data_ptr())


# ---- the configuration's keys ---------------------------------------------------------------------------
def test_config_defaults_stage_both_ways_and_keep_the_direct_kernel_off() -> None:
    """The direct kernel slows the forward (SMs reading host memory for the whole copy): opt-in only. Its
    bounds, when turned on, are vLLM's H100 figures."""
    t = load_config(None).transfer
    assert (t.kernel_directions, t.kernel_max_segment_bytes, t.kernel_min_segments, t.kernel_max_sms,
            t.calibrate, t.staging_bytes, t.staging_max_sms) == ((), 28 << 10, 16, 12, True, 64 << 20, 16)
    policy = KernelPolicy.make(t.kernel_directions, t.kernel_max_segment_bytes, t.kernel_min_segments,
                               ("load", "store"))
    assert policy.rules == {} and policy.use_staged("load", 1) and policy.use_staged("store", 1)
    policy = KernelPolicy.make(["load"], t.kernel_max_segment_bytes, t.kernel_min_segments)
    assert policy.use_kernel("load", 16, 16 * (28 << 10)) and not policy.use_kernel("load", 15, 15 * 1024)
    assert not policy.use_kernel("load", 64, 64 * (28 << 10) + 1) and not policy.use_kernel("store", 1024, 1024)


@pytest.mark.parametrize(("transfer", "key"), [
    ({"kernel_directions": ["load", "load"]}, "transfer.kernel_directions"),
    ({"kernel_directions": ["upload"]}, "transfer.kernel_directions"),
    ({"kernel_max_segment_bytes": "lots"}, "transfer.kernel_max_segment_bytes"),
    ({"kernel_max_segment_bytes": -1}, "transfer.kernel_max_segment_bytes"),
    ({"kernel_min_segments": 0}, "transfer.kernel_min_segments"),
    ({"kernel_max_sms": 0}, "transfer.kernel_max_sms"),
    ({"calibrate": "sometimes"}, "transfer.calibrate"),
])
def test_bad_kernel_keys_name_the_key(transfer: dict, key: str) -> None:
    from offload_connector.config import ConfigError

    with pytest.raises(ConfigError, match=f"invalid config key '{key}'"):
        load_config({"transfer": transfer})


def test_kernel_keys_accept_sizes_and_off() -> None:
    t = load_config({"transfer": {"kernel_max_segment_bytes": "64KiB", "kernel_directions": []}}).transfer
    assert t.kernel_max_segment_bytes == 64 << 10 and t.kernel_directions == ()
    assert load_config({"transfer": {"kernel_max_segment_bytes": 0}}).transfer.kernel_max_segment_bytes == 0
