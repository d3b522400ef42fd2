"""The CUDA backend on a real GPU (`pytest -m gpu`; skipped without one), and its refusal without one.

On a GPU: bit-exact round trips for every dtype and the layouts vLLM hands us on each copy path (the
staged path, the direct block-copy kernel, one batched DMA call, one DMA call per segment, and a pool that
could not be pinned),
each asserting which path its jobs took, so a missing cupy or NVRTC fails the kernel case instead of
testing DMA twice; and race tests on the staged, kernel and batched DMA paths that queue a long kernel
(`torch.cuda._sleep`) on the compute stream ahead of each fence, so a missing fence shows up as wrong
bytes, not as a timing. The same fences are proven without a GPU in test_cudasim.py. scripts/gpu_check.sh
runs this file (and its kernel cases under compute-sanitizer).
"""

from __future__ import annotations

import pytest
import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import BackendError, OffloadWorker

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SLEEP_CYCLES = 2_000_000_000  # about a second on a 2 GHz GPU: far longer than any copy below

# Each path forced through the configuration (no calibration: it would pick per device).
PATHS = {
    "staged": {"kernel_directions": [], "staging_bytes": "4MiB"},  # 512 KiB slots: jobs below take several chunks
    "kernel": {"kernel_directions": ["load", "store"], "kernel_max_segment_bytes": "1GiB", "kernel_min_segments": 1,
               "staging_bytes": 0},
    "batch": {"kernel_directions": [], "staging_bytes": 0},
    "per_segment": {"kernel_directions": [], "staging_bytes": 0},
    "pageable": {"kernel_directions": [], "staging_bytes": 0},
}


def test_cuda_backend_refused_without_a_device():
    from worker_side.backends.cuda.backend import CudaBackend

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendError, match="allowed here"):
        CudaBackend()
    with pytest.raises(BackendError):
        OffloadWorker(load_config({"transfer": {"backend": "cuda"}}))


def cuda_worker(kv: dict[str, torch.Tensor], path: str, monkeypatch: pytest.MonkeyPatch | None = None,
                **kw) -> OffloadWorker:
    """A worker whose every job takes `path`; fails (never skips) when that path is not available here."""
    if path == "pageable":  # the memlock limit or RAM refused the pool: every copy is staged
        from worker_side.backends.cuda.api import CudaError
        from worker_side.backends.cuda.runtime import TorchCudaRuntime

        def refuse(self, ptr: int, nbytes: int) -> None:
            raise CudaError(f"cuMemHostRegister({nbytes} bytes) failed: CUDA_ERROR_OUT_OF_MEMORY (test)")

        assert monkeypatch is not None
        monkeypatch.setattr(TorchCudaRuntime, "host_register", refuse)
    transfer = {"backend": "cuda", "calibrate": False, **PATHS[path]}
    w = OffloadWorker(load_config({"num_cpu_blocks": 40, "transfer": transfer}))
    w.register_kv_caches(kv, **kw)
    b = w.backend
    assert b.name == "cuda"
    assert b.pinned == (path != "pageable"), "pinning the host pool failed: check `ulimit -l` and free RAM"
    if path == "kernel":
        assert b.kernel_off_reason is None, f"the block-copy kernel is off here: {b.kernel_off_reason}"
    if path == "staged":
        assert b.staged_off_reason is None, f"the staged path is off here: {b.staged_off_reason}"
    if path == "batch":
        assert b.rt.supports_batch, "cuMemcpyBatchAsync did not resolve (driver before CUDA 12.8?)"
    if path == "per_segment":
        b.rt.supports_batch = False  # what a driver before 12.8 gives
    return w


def assert_paths(w: OffloadWorker, path: str, num_jobs: int) -> None:
    counts = w.backend.num_jobs_by_path
    assert counts[path] == num_jobs and sum(counts.values()) == num_jobs, counts
    assert w.backend.num_failed_submissions == 0


def one_layer_worker(path: str) -> tuple[torch.Tensor, OffloadWorker]:
    kv = torch.zeros(32, 2, 16, 8, 64, dtype=torch.float16, device="cuda")
    return kv, cuda_worker({"l0": kv}, path, num_gpu_blocks=32)


def store(w: OffloadWorker, event: int, gpu: list[int], cpu: list[int]) -> None:
    w.begin_step()
    w.start_store(TransferMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=cpu))


def load(w: OffloadWorker, event: int, gpu: list[int], cpu: list[int]) -> None:
    w.begin_step()
    w.start_load(TransferMetadata(load_event=event, load_gpu_blocks=gpu, load_cpu_blocks=cpu,
                                  load_event_reqs=["r"]))


def block_bytes(w: OffloadWorker, gpu_block: int) -> torch.Tensor:
    return torch.cat([v.block_tensor(gpu_block) for v in w._views])


def layout_kv(layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Four layers of 32 blocks: separate per-layer tensors (block_first, kv_first), or per-layer views of
    one block-outermost allocation (BLHNC: [blocks, layers, heads, tokens, 2 * head], each block one range)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if layout == "BLHNC":
        raw = torch.randint(0, 256, (32 * 4 * 8 * 16 * 128 * itemsize,), dtype=torch.uint8, device="cuda")
        whole = raw.view(dtype).view(32, 4, 8, 16, 128)
        return {f"l{i}": whole[:, i] for i in range(4)}
    shape = (32, 2, 16, 8, 64) if layout == "block_first" else (2, 32, 16, 8, 64)
    raw = torch.randint(0, 256, (4, torch.Size(shape).numel() * itemsize), dtype=torch.uint8, device="cuda")
    return {f"l{i}": raw[i].view(dtype).view(shape) for i in range(4)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["block_first", "kv_first", "BLHNC"])
@pytest.mark.parametrize("path", ["staged", "kernel", "batch", "per_segment", "pageable"])
def test_round_trip_bit_exact(dtype, layout, path, monkeypatch):
    kv = layout_kv(layout, dtype)
    w = cuda_worker(kv, path, monkeypatch, num_gpu_blocks=32, layout=layout if layout == "BLHNC" else None)
    gpu, cpu, targets = [3, 4, 5, 17, 9], [1, 2, 3, 11, 7], [20, 21, 22, 30, 2]
    before = [block_bytes(w, b) for b in gpu]
    store(w, 1, gpu, cpu)
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    for b, c in zip(before, cpu, strict=True):
        assert torch.equal(w.host_pool[c], b.cpu())
    load(w, 2, targets, cpu)
    w.wait_all()
    report = w.get_finished()
    assert report.finished_load_reqs == ["r"] and not report.failed_load_gpu_blocks
    for b, t in zip(before, targets, strict=True):
        assert torch.equal(block_bytes(w, t), b)
    torch.cuda.synchronize()
    assert_paths(w, path, 2)
    w.shutdown()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["staged", "kernel", "batch"])
def test_store_waits_for_the_compute_that_wrote_its_blocks(path):
    kv, w = one_layer_worker(path)
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward", still running when the store is issued
    kv[3:6] = 7  # written after the sleep, on the compute stream
    store(w, 1, [3, 4, 5], [1, 2, 3])
    w.wait_all()
    assert all(bool((w.host_pool[c].view(torch.float16) == 7).all()) for c in (1, 2, 3))
    assert_paths(w, path, 1)
    w.shutdown()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["staged", "kernel", "batch"])
def test_load_waits_for_earlier_readers_but_overlaps_this_steps_forward(path):
    kv, w = one_layer_worker(path)
    kv[3:6] = 5
    store(w, 1, [3, 4, 5], [1, 2, 3])
    w.wait_all()
    w.get_finished()
    # 1. an earlier step's kernel still reads blocks 10..12 (behind a long sleep)
    torch.cuda._sleep(SLEEP_CYCLES)
    snapshot = kv[10:13].clone()
    # 2. this step: the fence is taken before the forward; the forward is another long sleep
    w.begin_step()
    torch.cuda._sleep(SLEEP_CYCLES)
    forward_done = torch.cuda.Event()
    forward_done.record()
    w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=[10, 11, 12], load_cpu_blocks=[1, 2, 3],
                                  load_event_reqs=["r"]))
    w.wait_all()
    assert not forward_done.query(), "the load waited for this step's forward instead of overlapping it"
    torch.cuda.synchronize()
    assert bool((snapshot == 0).all()), "the load overwrote blocks an earlier kernel was still reading"
    assert bool((kv[10:13] == 5).all())
    assert_paths(w, path, 2)
    w.shutdown()


@pytest.mark.gpu
@needs_cuda
def test_calibration_runs_and_leaves_the_kv_cache_as_it_was(caplog):
    raw = torch.randint(0, 256, (2, 200 * 16 * 8 * 64 * 2 * 2), dtype=torch.uint8, device="cuda")
    kv = {f"l{i}": raw[i].view(torch.float16).view(200, 2, 16, 8, 64) for i in range(2)}
    before = raw.clone()
    transfer = {"backend": "cuda", "calibrate": True, "kernel_directions": ["load", "store"]}
    w = OffloadWorker(load_config({"num_cpu_blocks": 200, "transfer": transfer}))
    with caplog.at_level("INFO", logger="worker_side.backends.cuda.backend"):
        w.register_kv_caches(kv, num_gpu_blocks=200)
    torch.cuda.synchronize()
    assert torch.equal(raw, before), "the calibration changed the KV cache"
    b = w.backend
    assert b.kernel_off_reason is None, f"the block-copy kernel is off here: {b.kernel_off_reason}"
    assert b.staged_off_reason is None, f"the staged path is off here: {b.staged_off_reason}"
    kernel = [m for m in b.calibration if hasattr(m, "kernel_wins")]
    staged = [m for m in b.calibration if hasattr(m, "staged_wins")]
    assert kernel and all(m.kernel_s > 0 and m.dma_s > 0 for m in kernel)
    assert staged and all(m.staged_s > 0 and m.direct_s > 0 for m in staged)
    assert any("calibrated on device" in r.getMessage() for r in caplog.records)
    for m in kernel:  # sound: the policy sends no measured shape to the kernel where DMA was faster
        if b.policy.use_kernel(m.kind, m.num_segments, m.avg_segment_bytes * m.num_segments):
            assert m.kernel_wins, m
    for m in staged:  # and stages no measured job that was faster unstaged
        if b.policy.use_staged(m.kind, m.num_blocks):
            assert m.staged_wins, m
    w.shutdown()
