"""A deadline on loads (`transfer.load_timeout_s`): a request never waits on a copy forever, and the copy
that outlives its deadline harms nobody.

The worker reports a load not done by its deadline as failed whole (the engine recomputes its blocks) and
names its event; the copy cannot be recalled, so the scheduler keeps its GPU blocks (a reference of ours)
and CPU blocks (the job's) out of every other use until the worker reports that copy over. Stalled copies
here really run late (`FaultyBackend(stall=...)` hands them to the copy threads only at their release),
so a block handed to another request too early is overwritten under it, and the fake model's KV checks
see it: `test_without_the_quarantine_a_late_copy_corrupts_another_request` plants that bug.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from worker_helpers import block_bytes, load, make_worker, next_report, store

from offload_connector import load_config
from offload_connector.config import OffloadConfig
from offload_connector.fake_engine import FakeEngine, RequestStatus
from offload_connector.fake_engine.model import IntegrityError
from offload_connector.fake_engine.workload import small_config
from offload_connector.metadata import TransferMetadata, WorkerReport
from offload_connector.vllm.messages import merge_reports
from scheduler_side.completions import Completions
from worker_side import CpuBackend, OffloadWorker
from worker_side.backends.cuda.backend import CudaBackend
from worker_side.load_reads import LoadReads
from worker_side.testing.cuda_sim import SimCudaRuntime
from worker_side.testing.faults import FaultyBackend
from worker_side.testing.sim_compute import SimCompute

PROMPT = list(range(100, 116))  # 16 tokens = 4 blocks of 4: a CPU hit of 3 (the last token is computed)
TIMEOUT_S = 0.02


def with_timeout(config: OffloadConfig, seconds: float | None = TIMEOUT_S) -> OffloadConfig:
    return msgspec.structs.replace(
        config, transfer=msgspec.structs.replace(config.transfer, load_timeout_s=seconds))


def stall_first_load() -> FaultyBackend:
    return FaultyBackend(CpuBackend(), stall=lambda job: job.kind == "load" and job.event_id == 0)


def test_config_bounds_and_default() -> None:
    assert load_config({}).transfer.load_timeout_s == 30.0
    assert load_config({"transfer": {"load_timeout_s": None}}).transfer.load_timeout_s is None
    for bad in (0, -1, "soon"):
        with pytest.raises(ValueError, match="transfer.load_timeout_s"):
            load_config({"transfer": {"load_timeout_s": bad}})


def test_worker_reports_an_overdue_load_failed_then_its_late_end() -> None:
    faulty = FaultyBackend(CpuBackend(2), stall=lambda job: job.kind == "load")
    w, kv = make_worker(backend=faulty)
    w.load_timeout_s = TIMEOUT_S
    w.start_store(store(0, [1, 2], [3, 4]))
    assert next_report(w).completed_store_events == [0]
    # 1. a load that does not run: the step's wait ends at the deadline, with the load given up on
    w.start_load(load(5, [40, 41], [3, 4], ["a"]))
    started = time.perf_counter()
    report = w.get_finished(wait_for_loads=True)
    assert time.perf_counter() - started >= TIMEOUT_S * 0.9
    assert report.expired_load_events == [5] and report.finished_load_reqs == ["a"]
    assert sorted(report.failed_load_gpu_blocks) == [40, 41] and report.failed_load_reqs == ["a"]
    assert report.bytes_loaded == 0 and w.num_load_timeouts == 1 and w.num_in_flight == 1
    # 2. given up once: never reported again while the copy is stalled
    time.sleep(TIMEOUT_S)
    assert w.get_finished(wait_for_loads=True).is_empty
    # 3. the copy runs late and ends: only its end is reported (not a second completion)
    faulty.release_all()
    late = next_report(w)
    assert late.ended_load_events == [5] and not late.finished_load_reqs and not late.failed_load_gpu_blocks
    assert late.bytes_loaded == 0 and w.num_in_flight == 0
    assert block_bytes(kv, 40).equal(w.host_pool[3])  # it did copy, late
    w.shutdown()


def test_a_load_done_in_time_is_never_given_up() -> None:
    w, _ = make_worker()
    w.load_timeout_s = 1e-9  # every load is past it by the time it is polled ...
    w.start_store(store(0, [1], [3]))
    w.wait_all()
    w.start_load(load(1, [40], [3], ["a"]))
    w.wait_all()
    report = w.get_finished(wait_for_loads=True)  # ... but its result came first
    assert report.finished_load_reqs == ["a"] and not report.expired_load_events and not report.failed_load_gpu_blocks


def test_merged_reports_keep_expiries_and_ends() -> None:
    a = WorkerReport(rank=1, expired_load_events=[3], finished_load_reqs=["r"])
    b = WorkerReport(rank=1, ended_load_events=[3])
    merged = merge_reports(a, b)
    assert merged.expired_load_events == [3] and merged.ended_load_events == [3] and not b.is_empty


def cpu_hit_scenario(engine: FakeEngine) -> None:
    """A's 4 blocks are stored and leave the GPU cache; B (same prompt) is admitted with a CPU hit of 3."""
    engine.add_request("a", PROMPT, 2)
    engine.run()
    engine.drain()
    n = (engine.gpu.num_usable_blocks - 1) * engine.block_size
    engine.add_request("filler", [5000 + i for i in range(n)], 1)
    engine.run()
    engine.drain()
    engine.add_request("b", PROMPT, 2)


def reference_output(prompt: list[int], max_tokens: int = 2) -> list[int]:
    with FakeEngine(small_config(), connector=False) as engine:
        engine.add_request("ref", prompt, max_tokens)
        engine.run()
        return engine.outputs["ref"]


def test_an_overdue_load_is_recomputed_and_its_blocks_quarantined_until_the_copy_ends() -> None:
    backend = stall_first_load()
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=12, num_cpu_blocks=32)), backend=backend) as engine:
        cpu_hit_scenario(engine)
        conn = engine.connector
        assert conn is not None
        # 1. B's load never runs: at its deadline B is told it failed, recomputes and finishes.
        engine.run()
        assert engine.request_status("b") is None and engine.outputs["b"] == reference_output(PROMPT)
        assert conn.stats.num_load_timeouts == 1 and engine.stats.failed_load_blocks == 3
        assert engine.stats.recomputed_tokens == 0  # its 3 blocks were never computed before, only given up on
        # 2. the copy may still run: its 3 GPU blocks and 3 CPU blocks are ours alone
        assert conn.num_blocks_in_quarantine == 3 and conn.stats.num_quarantined_blocks == 3
        assert engine.gpu.pool.num_held_blocks() == 3 and conn.cpu_pool.num_held_blocks() == 3
        assert not conn.is_idle() and conn.num_inflight_transfers == 1
        conn.check_integrity()
        # 3. the copy runs late, then ends: everything goes back, and nothing read is wrong
        backend.release_all()
        engine.drain()
        assert conn.num_blocks_in_quarantine == 0 and engine.gpu.pool.num_held_blocks() == 0
        engine.add_request("c", PROMPT, 2)
        engine.run()
        assert engine.outputs["c"] == reference_output(PROMPT)
        assert engine.check() == 0 and engine.stats.integrity_errors == 0


def late_copy_over_a_new_request(engine: FakeEngine, backend: FaultyBackend) -> None:
    """B's load is given up on; B recomputes and finishes; D then wants 3 of the 5 GPU blocks while B's
    copy is still stalled; the copy runs late, and D decodes on."""
    cpu_hit_scenario(engine)
    engine.run()  # B finishes
    engine.add_request("d", [7000 + i for i in range(8)], 4)  # 2 blocks, 3 with its outputs
    for _ in range(3):
        engine.step()
    backend.release_all()
    time.sleep(0.05)  # the late copy lands
    engine.run()
    engine.drain()
    for model in engine.models:
        model.compute.synchronize()


def test_a_late_copy_cannot_reach_a_request_that_came_after() -> None:
    backend = stall_first_load()
    # 5 usable GPU blocks: B's 3 quarantined leave D 2, so D waits for them (and gets them once released)
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=6, num_cpu_blocks=32)), backend=backend) as engine:
        late_copy_over_a_new_request(engine, backend)
        assert engine.outputs["d"] == reference_output([7000 + i for i in range(8)], 4)
        assert engine.check() == 0 and engine.stats.integrity_errors == 0


def test_without_the_quarantine_a_late_copy_corrupts_another_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the blocks go back when the load is given up on, as for a load that ended."""
    monkeypatch.setattr(Completions, "_quarantine", lambda self, job, expired: self._release_load(job))
    backend = stall_first_load()
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=6, num_cpu_blocks=32)), backend=backend) as engine:
        with pytest.raises(IntegrityError, match="request d: .* wrong K/V"):
            late_copy_over_a_new_request(engine, backend)


def settle_stores(engine: FakeEngine) -> None:
    """Step an idle engine until every store event issued so far has completed."""
    conn = engine.connector
    assert conn is not None
    for _ in range(1000):
        if not conn.gpu_blocks_being_stored() and not conn.policy.num_held_blocks:
            return
        engine.step()
        time.sleep(0.001)
    raise AssertionError("stores still in flight")


def late_copy_under_new_stores(engine: FakeEngine, backend: FaultyBackend) -> list[int]:
    """B's load is given up on; B recomputes and finishes; E's stores then fill the CPU tier while B's copy
    is still stalled; the copy runs late; C (B's prompt) hits B's blocks on the GPU. Returns C's output."""
    cpu_hit_scenario(engine)
    engine.run()  # B finishes
    for k in range(3):
        engine.add_request(f"e{k}", [8000 + 100 * k + i for i in range(16)], 1)
        engine.run()
        settle_stores(engine)  # (drain would wait for the stalled copy too)
    backend.release_all()
    time.sleep(0.05)  # the late copy lands
    engine.drain()
    engine.add_request("c", PROMPT, 2)
    engine.run()
    for model in engine.models:
        model.compute.synchronize()
    return engine.outputs["c"]


def test_a_late_copy_reads_a_cpu_slot_nobody_rewrote() -> None:
    backend = stall_first_load()
    # 15 usable CPU blocks: after B's 4 recomputed blocks, E's stores need every free slot (B's 3 stay held)
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=12, num_cpu_blocks=16)), backend=backend) as engine:
        assert late_copy_under_new_stores(engine, backend) == reference_output(PROMPT)
        assert engine.stats.gpu_hit_tokens >= 12  # C read B's blocks on the GPU, where the late copy wrote
        assert engine.check() == 0 and engine.stats.integrity_errors == 0


def test_without_the_cpu_quarantine_a_late_copy_writes_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the GPU blocks are held but the CPU blocks go back (to the eviction end) at once, and
    the worker trusts the metadata (its own check of the loads in flight would hold the stores into those
    slots behind the late copy: tests/worker/test_store_after_load_reads.py)."""
    monkeypatch.setattr(LoadReads, "readers", lambda self, cpu_block_ids: ())
    def quarantine_gpu_only(self, job, expired) -> None:
        self.gpu_pool.touch(job.gpu_block_ids)
        self.cpu_pool.free(job.cpu_blocks, front=True)
        job.cpu_blocks = []
        job.gpu_block_ids, job.holds_gpu = list(job.gpu_block_ids), True
        expired.jobs.append(job)

    monkeypatch.setattr(Completions, "_quarantine", quarantine_gpu_only)
    backend = stall_first_load()
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=12, num_cpu_blocks=16)), backend=backend) as engine:
        with pytest.raises(IntegrityError, match="request c: .* wrong K/V"):
            late_copy_under_new_stores(engine, backend)


@pytest.mark.cudasim
@pytest.mark.parametrize("schedule", ["random", "copy_lag"])
def test_on_the_simulated_gpu_a_late_copy_harms_nobody(schedule: str) -> None:
    """The CUDA backend never waits for loads: the deadline passes while the engine polls, step by step."""
    rt = SimCudaRuntime(schedule=schedule, seed=5)
    backend = FaultyBackend(CudaBackend(num_streams=2, runtime=rt),
                            stall=lambda job: job.kind == "load" and job.event_id == 0)
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=12, num_cpu_blocks=16)), backend=backend,
                    wait_for_loads=False, compute=SimCompute(rt)) as engine:
        assert late_copy_under_new_stores(engine, backend) == reference_output(PROMPT)
        assert engine.connector is not None and engine.connector.stats.num_load_timeouts == 1
        assert engine.check() == 0 and engine.stats.integrity_errors == 0 and not rt.errors


def test_no_deadline_waits_for_the_copy() -> None:
    backend = FaultyBackend(CpuBackend(), hold=lambda job: job.kind == "load" and job.event_id == 0)
    with FakeEngine(with_timeout(small_config(num_gpu_blocks=12, num_cpu_blocks=32), None), backend=backend,
                    wait_for_loads=False) as engine:
        cpu_hit_scenario(engine)
        for _ in range(20):
            engine.step()
        assert engine.request_status("b") is RequestStatus.WAITING_FOR_REMOTE_KVS
        backend.release_all()
        engine.run()
        assert engine.outputs["b"] == reference_output(PROMPT) and engine.stats.failed_load_blocks == 0
        assert engine.check() == 0


def test_tensor_parallel_ranks_that_disagree() -> None:
    """Rank 0 gives the load up, rank 1 finishes it in time: the request recomputes (a failed block on any
    rank fails it), and the blocks stay quarantined until rank 0's copy ends; rank 1 never names it."""
    backends = [stall_first_load(), FaultyBackend(CpuBackend())]
    cfg = with_timeout(small_config(num_gpu_blocks=12, num_cpu_blocks=32))
    with FakeEngine(cfg, backend=backends, tp_size=2) as engine:
        cpu_hit_scenario(engine)
        engine.run()
        conn = engine.connector
        assert conn is not None and engine.outputs["b"] == reference_output(PROMPT)
        assert conn.stats.num_load_timeouts == 1 and conn.num_blocks_in_quarantine == 3
        backends[0].release_all()
        engine.drain()
        assert conn.num_blocks_in_quarantine == 0 and engine.check() == 0 and engine.stats.integrity_errors == 0


def test_an_end_from_a_rank_that_did_not_give_up_is_ignored() -> None:
    with FakeEngine(small_config()) as engine:
        conn = engine.connector
        assert conn is not None
        conn.update_connector_output(WorkerReport(rank=0, ended_load_events=[7]))
        assert conn.is_idle() and conn.num_blocks_in_quarantine == 0


def test_worker_without_deadline_keeps_waiting() -> None:
    w = OffloadWorker(load_config({"num_cpu_blocks": 8, "transfer": {"backend": "cpu", "load_timeout_s": None}}))
    assert w.load_timeout_s is None
    w.shutdown()
    assert TransferMetadata().is_empty
