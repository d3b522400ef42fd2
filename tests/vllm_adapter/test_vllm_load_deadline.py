"""A load given up on at its deadline, in vLLM's real Scheduler (both modes): the request recomputes, and
the blocks the late copy may still touch stay out of vLLM's free queue until that copy is over.

The fake worker here plays a rank whose copies stall: it reports each load as our worker does at
`transfer.load_timeout_s` (its requests in `finished_recving`, every block in `invalid_block_ids`, the
event in `expired_load_events`), and reports the copy over only when the test says so.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_sim_helpers import BS, MODES, Sim, tokens  # noqa: E402

from offload_connector.metadata import WorkerReport, encode  # noqa: E402
from offload_connector.vllm.messages import OffloadWorkerMetadata  # noqa: E402
from scheduler_side.completions import Completions  # noqa: E402

NUM_GPU_BLOCKS = 10  # 9 usable: room for B's recompute beside the 3 quarantined blocks
FILL = (NUM_GPU_BLOCKS - 2) * BS  # a prompt that, with its output token, needs every usable block


class StallingSim(Sim):
    """Loads never run in time: each is given up on in its own step; `end_copies()` ends them."""

    def __init__(self, **kw: object) -> None:
        super().__init__(failure_policy="recompute", **kw)
        self.given_up: list[int] = []  # load events given up on, copies not yet over
        self._ended: list[int] = []  # to report in the next batch

    def end_copies(self) -> None:
        self._ended, self.given_up = self._ended + self.given_up, []

    def run_workers(self, out):  # type: ignore[override]
        meta = out.kv_connector_metadata.transfer
        report = WorkerReport(completed_store_events=[] if meta.store_event is None else [meta.store_event],
                              ended_load_events=self._ended)
        self._ended = []
        if meta.load_event is not None:
            self.given_up.append(meta.load_event)
            report.expired_load_events = [meta.load_event]
            report.finished_load_reqs = sorted(meta.load_event_reqs)
            report.failed_load_reqs = sorted(meta.load_event_reqs)
            report.failed_load_gpu_blocks = list(meta.load_gpu_blocks)
        return KVConnectorOutput(finished_recving=set(report.finished_load_reqs) or None,
                                 invalid_block_ids=set(report.failed_load_gpu_blocks),
                                 kv_connector_worker_meta=OffloadWorkerMetadata(reports=[encode(report)]))


def run_until_no_requests(sim: StallingSim, max_steps: int = 100) -> None:
    """Step until every request finished (`run_until_idle` would also wait for the stalled copies: the
    connector keeps the engine stepping until they end, to hear of it)."""
    for _ in range(max_steps):
        if not sim.sched.has_unfinished_requests() and not sim.sched.requests:
            return
        sim.step()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def cpu_hit_given_up(sim: StallingSim) -> list[int]:
    """A's prefix is stored and evicted from the GPU; B hits it on the CPU; B's load is given up on.
    Returns B's load's GPU blocks."""
    prefix = tokens(20, 48)
    sim.add("A", prefix + tokens(21, 16))
    sim.run_until_idle()
    sim.add("C", tokens(22, FILL))  # needs every GPU block: A's leave the GPU cache
    sim.run_until_idle()
    sim.add("B", prefix + tokens(23, 16), max_tokens=3)
    sim.step()
    assert sim.loads[-1] == ["B"]
    return list(sim.last_meta.transfer.load_gpu_blocks)


@pytest.mark.parametrize("mode", MODES)
def test_a_given_up_load_recomputes_and_its_blocks_wait_for_the_copy(mode: str) -> None:
    sim = StallingSim(mode=mode, num_gpu_blocks=NUM_GPU_BLOCKS)
    blocks = cpu_hit_given_up(sim)
    offload = sim.connector.offload
    # 1. B is not left waiting: it recomputes its whole prompt and finishes.
    run_until_no_requests(sim)
    assert sim.sched.has_requests()  # the connector keeps the engine stepping to hear of the copy's end
    assert "B" not in sim.sched.requests and sim.first_scheduled["B"] == 64
    assert offload.stats.num_load_timeouts == 1 and offload.stats.num_failed_load_blocks == 3
    # 2. The copy may still write B's 3 blocks: vLLM cannot hand them out, though B is done.
    pool = sim.sched.kv_cache_manager.block_pool
    assert offload.num_blocks_in_quarantine == 3
    assert all(pool.blocks[i].ref_cnt == 1 for i in blocks)
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1 - 3
    # 3. A request that needs every block waits for them (the engine is not wedged: a transfer of ours is
    #    in flight), and runs once the copy is over.
    sim.add("D", tokens(24, FILL))
    for _ in range(3):
        assert "D" not in sim.step()
    assert offload.num_inflight_transfers > 0
    sim.end_copies()
    sim.run_until_idle()
    assert "D" in sim.first_scheduled and offload.num_blocks_in_quarantine == 0
    sim.assert_no_leaks()


@pytest.mark.parametrize("mode", MODES)
def test_abort_after_the_deadline_keeps_the_blocks_until_the_copy_ends(mode: str) -> None:
    sim = StallingSim(mode=mode, num_gpu_blocks=NUM_GPU_BLOCKS)
    blocks = cpu_hit_given_up(sim)
    sim.step()
    sim.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    run_until_no_requests(sim)
    pool = sim.sched.kv_cache_manager.block_pool
    assert all(pool.blocks[i].ref_cnt == 1 for i in blocks) and sim.connector.offload.num_blocks_in_quarantine == 3
    sim.end_copies()
    sim.step()
    sim.run_until_idle()
    sim.assert_no_leaks()


def test_without_the_quarantine_vllm_hands_the_blocks_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug (blocks released when the load is given up on): the test above would fail."""
    monkeypatch.setattr(Completions, "_quarantine", lambda self, job, expired: self._release_load(job))
    sim = StallingSim(mode="sync", num_gpu_blocks=NUM_GPU_BLOCKS)
    blocks = cpu_hit_given_up(sim)
    run_until_no_requests(sim)
    pool = sim.sched.kv_cache_manager.block_pool
    assert any(pool.blocks[i].ref_cnt == 0 for i in blocks)
