"""The CUDA backend on a real GPU (`pytest -m gpu`; skipped without one), and its refusal without one.

On a GPU: bit-exact round trips for every dtype and the layouts vLLM hands us, and race tests that queue a
long kernel (`torch.cuda._sleep`) on the compute stream ahead of each fence, so a missing fence shows up as
wrong bytes, not as a timing. The same fences are proven without a GPU in test_cudasim.py.
"""

from __future__ import annotations

import pytest
import torch

from offload_connector import load_config
from offload_connector.metadata import TransferMetadata
from worker_side import BackendError, OffloadWorker

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SLEEP_CYCLES = 2_000_000_000  # about a second on a 2 GHz GPU: far longer than any copy below


def test_cuda_backend_refused_without_a_device():
    from worker_side.cuda_backend import CudaBackend

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendError, match="allowed here"):
        CudaBackend()
    with pytest.raises(BackendError):
        OffloadWorker(load_config({"transfer": {"backend": "cuda"}}))


def cuda_worker(kv: dict[str, torch.Tensor], **kw) -> OffloadWorker:
    w = OffloadWorker(load_config({"num_cpu_blocks": 16, "transfer": {"backend": "cuda"}}))
    w.register_kv_caches(kv, **kw)
    assert w.backend.name == "cuda" and w.backend.pinned
    return w


def one_layer_worker() -> tuple[torch.Tensor, OffloadWorker]:
    kv = torch.zeros(32, 2, 16, 8, 64, dtype=torch.float16, device="cuda")
    return kv, cuda_worker({"l0": kv}, num_gpu_blocks=32)


def store(w: OffloadWorker, event: int, gpu: list[int], cpu: list[int]) -> None:
    w.begin_step()
    w.start_store(TransferMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=cpu))


def load(w: OffloadWorker, event: int, gpu: list[int], cpu: list[int]) -> None:
    w.begin_step()
    w.start_load(TransferMetadata(load_event=event, load_gpu_blocks=gpu, load_cpu_blocks=cpu,
                                  load_event_reqs=["r"]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["block_first", "kv_first"])
@pytest.mark.parametrize("kernel_max_segment_bytes", [0, 1 << 20])
def test_round_trip_bit_exact(dtype, layout, kernel_max_segment_bytes):
    shape = (32, 2, 16, 8, 64) if layout == "block_first" else (2, 32, 16, 8, 64)
    raw = torch.randint(0, 256, (4, torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()),
                        dtype=torch.uint8, device="cuda")
    kv = {f"l{i}": raw[i].view(dtype).view(shape) for i in range(4)}
    w = cuda_worker(kv, num_gpu_blocks=32)
    w.backend.kernel_max_segment_bytes = kernel_max_segment_bytes
    gpu, cpu, targets = [3, 4, 5, 17, 9], [1, 2, 3, 11, 7], [20, 21, 22, 30, 2]
    views = w._views
    before = [torch.cat([v.block_tensor(b) for v in views]) for b in gpu]
    store(w, 1, gpu, cpu)
    w.wait_all()
    assert w.get_finished().completed_store_events == [1]
    for b, c in zip(before, cpu, strict=True):
        assert torch.equal(w.host_pool[c], b.cpu())
    load(w, 2, targets, cpu)
    w.wait_all()
    assert w.get_finished().finished_load_reqs == ["r"]
    for b, t in zip(before, targets, strict=True):
        assert torch.equal(torch.cat([v.block_tensor(t) for v in views]), b)
    w.shutdown()


@pytest.mark.gpu
@needs_cuda
def test_store_waits_for_the_compute_that_wrote_its_blocks():
    kv, w = one_layer_worker()
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward", still running when the store is issued
    kv[3:6] = 7  # written after the sleep, on the compute stream
    store(w, 1, [3, 4, 5], [1, 2, 3])
    w.wait_all()
    assert all(bool((w.host_pool[c].view(torch.float16) == 7).all()) for c in (1, 2, 3))
    w.shutdown()


@pytest.mark.gpu
@needs_cuda
def test_load_waits_for_earlier_readers_but_overlaps_this_steps_forward():
    kv, w = one_layer_worker()
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
    w.shutdown()
