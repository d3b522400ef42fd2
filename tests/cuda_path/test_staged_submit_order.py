"""What a staged job does on the host before its first copy reaches the device (issue 39: host time).

On the simulated device every runtime call is logged in order. A staged store records one fence on the
compute stream and makes its kernel stream wait for it, then launches its first gather, and only then plans
its DMA segments; its copy stream waits for no compute fence (its DMAs follow the gathers, which
test_staged_path.py shows necessary). A staged load waits for the step fence once, on its copy stream, and
records nothing on the compute stream. Bytes are checked by a round trip after the logged jobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from cudasim_helpers import make_kv, round_trip, sim_worker

from offload_connector.metadata import TransferMetadata
from worker_side import OffloadWorker
from worker_side.backends.cuda import staging
from worker_side.backends.cuda.staging import NUM_SLOTS
from worker_side.testing.cuda_sim import SimCudaRuntime

pytestmark = pytest.mark.cudasim

COPIES = ("launch_staged_copy", "memcpy_batch", "memcpy", "launch_block_copy")
LOGGED = ("compute_stream", "record_event", "wait_event", *COPIES)


@contextmanager
def call_log(rt: SimCudaRuntime, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """(call, stream name) of the runtime calls made inside the block, and ("plan_dma", "") where the staged
    path planned a job's DMA segments."""
    log: list[tuple[str, str]] = []
    compute = rt.compute_stream()

    def logged(name: str):
        inner = getattr(rt, name)

        def call(*args, **kwargs):
            stream = next((a for a in args if hasattr(a, "queue")), None)
            log.append((name, "compute" if stream is compute else getattr(stream, "name", "")))
            return inner(*args, **kwargs)
        return call

    plan_dma = staging.plan_dma

    def planned(*args, **kwargs):
        log.append(("plan_dma", ""))
        return plan_dma(*args, **kwargs)

    with monkeypatch.context() as m:
        for name in LOGGED:
            m.setattr(rt, name, logged(name))
        m.setattr(staging, "plan_dma", planned)
        yield log


def staged(num_blocks: int = 12, slot_blocks: int = 2) -> tuple[SimCudaRuntime, dict, OffloadWorker]:
    rt = SimCudaRuntime(schedule="random", seed=3)
    kv = make_kv(rt, "kv_first", num_layers=2)
    bytes_per_block = 2 * 2 * kv["l0"][0, 0].numel() * kv["l0"].element_size()  # layers x K/V x one block
    w = sim_worker(rt, kv, num_blocks, kernel_max_segment_bytes=0,
                   staging_bytes=2 * NUM_SLOTS * slot_blocks * bytes_per_block)
    if w.backend.paths.staged is None or w.backend.paths.staged.plan.slot_blocks != slot_blocks:
        raise RuntimeError(f"test set-up: staging off or not {slot_blocks} blocks a slot")
    return rt, kv, w


def before_first_copy(log: list[tuple[str, str]]) -> list[tuple[str, str]]:
    first = next(i for i, (name, _) in enumerate(log) if name in COPIES)
    return log[:first + 1]


def test_a_staged_store_fences_once_and_gathers_before_planning_its_dma(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, kv, w = staged()
    kernel_stream = w.backend.paths.staged.rings["store"].stream.name
    w.begin_step()
    with call_log(rt, monkeypatch) as log:  # 5 blocks: 3 chunks, the first slots never used before
        w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3, 9, 5], store_cpu_blocks=[30, 31, 32, 7, 12]))
    assert before_first_copy(log) == [("compute_stream", ""), ("record_event", "compute"),
                                      ("wait_event", kernel_stream), ("launch_staged_copy", kernel_stream)]
    assert log.index(("plan_dma", "")) > log.index(("launch_staged_copy", kernel_stream))
    assert [c for c in log if c[1] == "compute"] == [("record_event", "compute")]  # one fence for the job
    w.wait_all()
    w.get_finished()
    round_trip(rt, w, kv, gpu=[1, 2, 3], cpu=[4, 5, 6], targets=[7, 8, 10])
    w.shutdown()


def test_a_staged_load_waits_for_the_step_fence_once_before_its_first_dma(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, kv, w = staged()
    w.begin_step()
    w.start_store(TransferMetadata(store_event=1, store_gpu_blocks=[1, 2, 3], store_cpu_blocks=[4, 5, 6]))
    w.wait_all()
    w.get_finished()
    copy_stream = w.backend._streams["load"].name
    w.begin_step()
    with call_log(rt, monkeypatch) as log:
        w.start_load(TransferMetadata(load_event=2, load_gpu_blocks=[7, 8, 10], load_cpu_blocks=[4, 5, 6],
                                      load_event_reqs=["r"]))
    first = before_first_copy(log)
    assert first[-1] == ("memcpy_batch", copy_stream) and first[0] == ("plan_dma", "")
    assert [c for c in log if c[1] == "compute"] == []  # the step fence was recorded at begin_step
    step_fence_waits = [c for c in first if c == ("wait_event", copy_stream)]
    assert len(step_fence_waits) == 1
    w.wait_all()
    assert w.get_finished().finished_load_reqs == ["r"] and rt.faults == []
    w.shutdown()
