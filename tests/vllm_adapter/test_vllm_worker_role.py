"""Both roles of OffloadConnector: vLLM's real Scheduler drives our real worker role on CPU KV tensors.

A tiny fake model stands in for the forward: it writes each block it completes with a value derived from
the block's hash and, before "computing", checks that every earlier block of the request (GPU prefix
hits and blocks loaded from our CPU tier) holds the right value. Any mismatch is an integrity error.
With `window` (a hybrid model, HMA on) both KV-cache groups' layers share the one KV tensor, as vLLM lays
them out: each group writes its own value into its own block ids, and the sliding-window group reads only
the blocks inside its window.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_sim_helpers import BS, MODES, RESUME_STEPS, Sim, tokens  # noqa: E402

from offload_connector.vllm.connector import OffloadConnector  # noqa: E402
from worker_side import CpuBackend, OffloadWorker  # noqa: E402
from worker_side.testing.faults import FaultyBackend  # noqa: E402


def block_value(block_hash: bytes, group: int = 0) -> float:
    return float(2 * int.from_bytes(block_hash[:3], "big") + group)


class WorkerSim(Sim):
    def __init__(self, *args, fail_load_events: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.worker_conn = OffloadConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        if fail_load_events:
            role = self.worker_conn.connector_worker
            role.worker.shutdown()
            role.worker = OffloadWorker(
                self.worker_conn.config, backend=FaultyBackend(CpuBackend(2), fail_loads=set(fail_load_events)))
        num_blocks = self.kv_cache_config.num_blocks
        self.kv = torch.zeros(num_blocks, 1, BS, 8)  # one layer, [B, H, N, 2*C], H=1, C=4: 512 bytes a block
        layers = {"layer": self.kv}
        if self.window is not None:  # the window group's layer overlays the same memory (HMA on)
            layers["swa_layer"] = self.kv
        self.worker_conn.register_kv_caches(layers)
        self.integrity_errors: list[tuple[str, int]] = []
        self.failed_recving: set[str] = set()  # requests whose load vLLM heard failed (several groups)

    def run_workers(self, out) -> KVConnectorOutput:
        conn = self.worker_conn
        conn.bind_connector_metadata(out.kv_connector_metadata)
        conn.start_load_kv(None)
        self._forward(out)
        conn.wait_for_save()
        if out.total_num_scheduled_tokens == 0:
            conn.worker.wait_all()  # an idle step: model the time that passes until the engine steps again
        results = conn.get_transfer_results(out.finished_req_ids)
        self.failed_recving |= results.failed_recving
        output = KVConnectorOutput(finished_recving=results.finished_recving or None,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=conn.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=conn.build_connector_worker_meta())
        conn.clear_connector_metadata()
        return output

    def _forward(self, out) -> None:
        for req_id, num_new in out.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            end = req.num_computed_tokens  # schedule() already advanced it
            start = end - num_new
            hashes = req.block_hashes
            for group, gpu_block_ids in enumerate(self.sched.kv_cache_manager.get_block_ids(req_id)):
                first = 0 if group == 0 else max(0, start - self.window + 1) // BS  # group 1: the window
                for i in range(first, min(start // BS, len(hashes))):  # read: prefix must hold the right KV
                    if not bool(torch.all(self.kv[gpu_block_ids[i]] == block_value(hashes[i], group))):
                        self.integrity_errors.append((req_id, i))
                for i in range(start // BS, min(end // BS, len(hashes))):  # write the blocks it completes
                    self.kv[gpu_block_ids[i]] = block_value(hashes[i], group)

    def assert_no_leaks(self) -> None:
        super().assert_no_leaks()
        assert self.worker_conn.worker.num_in_flight == 0


def evict_then_hit(sim: Sim, evictor_tokens: int = 64) -> dict[str, int]:
    """A computes a prefix, C pushes it off the GPU, B comes back for it; returns B's first compute."""
    prefix = tokens(21, 48)
    sim.add("A", prefix + tokens(22, 16))
    sim.run_until_idle()
    sim.add("C", tokens(23, evictor_tokens))
    sim.run_until_idle()
    sim.add("B", prefix + tokens(24, 16))
    sim.step()  # admission: load issued in start_load_kv and awaited in get_finished
    assert sim.loads[-1] == ["B"]
    # B runs once vLLM has processed the admission step's output: the next step, or in async mode the one
    # after (the next step was scheduled before that output was processed).
    assert sim.steps_until_scheduled("B") == RESUME_STEPS[sim.mode]
    return sim.scheduled[-1]


@pytest.mark.parametrize("mode", MODES)
def test_real_worker_loads_the_right_bytes(mode: str) -> None:
    sim = WorkerSim(num_gpu_blocks=6, mode=mode)
    # 1-3. Store, evict, CPU hit: B computes only its 16 uncached tokens, RESUME_STEPS after admission.
    assert evict_then_hit(sim) == {"B": 16}
    sim.run_until_idle()
    # 4. Every block any request read held the KV of its hash; the worker's byte counts reached the stats.
    assert sim.integrity_errors == []
    stats = sim.connector.offload.stats
    assert stats.num_loaded_blocks == 3 and stats.bytes_loaded == 3 * 512
    assert stats.bytes_stored == 512 * stats.num_stored_blocks > 0
    sim.assert_no_leaks()


@pytest.mark.parametrize(("mode", "policy"), [(m, p) for m in MODES for p in ("eager", "lazy")])
def test_batched_hits_evictions_and_aborts_read_only_the_right_kv(mode: str, policy: str) -> None:
    """Many requests in flight at once over 4 shared prefixes on 12 GPU blocks: prefixes are evicted,
    stored and loaded back while other requests compute and some are aborted mid-flight (in async mode
    while their batch is still in flight, so vLLM defers freeing their blocks)."""
    sim = WorkerSim(num_gpu_blocks=12, num_cpu_blocks=64, mode=mode, store_policy=policy)
    prefixes = [tokens(30 + p, 48) for p in range(4)]
    n, aborted = 0, {RequestStatus.WAITING_FOR_REMOTE_KVS: 0, RequestStatus.RUNNING: 0}
    deferred_frees = 0
    for round_no in range(4):
        # 1. A wave of 6 requests, each a shared prefix and its own suffix, scheduled together.
        for i in range(6):
            # A few decode steps (prompts end on a block boundary; 4 outputs complete no block).
            sim.add(f"r{n}", prefixes[(round_no + i) % 4] + tokens(100 + n, 16 + 16 * (i % 3)), max_tokens=4)
            n += 1
        # 2. The client aborts a request waiting for its load, then one computing (in async mode with its
        #    batch still in flight).
        for status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING):
            for _ in range(3):
                sim.step()
                victims = sorted(r for r, req in sim.sched.requests.items() if req.status == status)
                if victims:
                    sim.sched.finish_requests(victims[0], RequestStatus.FINISHED_ABORTED)
                    aborted[status] += 1
                    deferred_frees += len(sim.sched.deferred_frees)  # async: its batch is in flight
                    break
        sim.run_until_idle()
    # 3. Every block any request read (GPU hits and every block loaded from the CPU tier) held its KV.
    assert sim.integrity_errors == []
    stats = sim.connector.offload.stats
    assert stats.num_loaded_blocks > 0 and stats.num_failed_load_blocks == 0
    assert all(aborted.values())  # both kinds of abort happened
    assert (deferred_frees > 0) == (mode == "async")  # vLLM's defer_block_free held aborted blocks back
    sim.assert_no_leaks()


@pytest.mark.parametrize("mode", MODES)
def test_failed_load_is_reported_and_recomputed(mode: str) -> None:
    # 10 GPU blocks: vLLM 0.32 keeps a failed async load's prefill reservation while re-admitting the
    # request, so the retry needs room for B twice.
    sim = WorkerSim(num_gpu_blocks=10, fail_load_events=(0,), failure_policy="recompute", mode=mode)
    # 1-3. The first load of B's 3 blocks fails: vLLM is told the bad blocks and recomputes B from them
    # the next step; their CPU copies are forgotten, so they are not offered (and failed) again.
    assert evict_then_hit(sim, evictor_tokens=128) == {"B": 64}
    assert sim.connector.offload.stats.num_failed_load_blocks == 3
    assert sim.loads[-1] == []
    sim.run_until_idle()
    # 4. Nothing read stale KV; B's recomputed blocks were stored anew; nothing leaks.
    assert sim.integrity_errors == []
    sim.assert_no_leaks()


@pytest.mark.parametrize("mode", MODES)
def test_hybrid_model_loads_the_right_bytes_into_both_groups(mode: str) -> None:
    """HMA on: a full-attention and a 32-token sliding-window group over one KV tensor. B's CPU hit loads
    the full group's 3 blocks and the window group's blocks 1 and 2 (block 0 lies outside the window and
    stays the null block); every block read held its group's KV; the worker copied the shared tensor once."""
    sim = WorkerSim(num_gpu_blocks=24, mode=mode, window=32)
    assert sim.worker_conn.worker.bytes_per_block == 512 == sim.connector.shape.bytes_per_block
    prefix = tokens(21, 48)
    sim.add("A", prefix + tokens(22, 16))
    sim.run_until_idle()
    assert sim.sched.reset_prefix_cache()  # A's blocks leave vLLM's GPU cache (not ours)
    sim.add("B", prefix + tokens(24, 16))
    sim.step()
    assert sim.loads[-1] == ["B"]
    assert sim.steps_until_scheduled("B") == RESUME_STEPS[mode]
    assert sim.scheduled[-1] == {"B": 16}
    sim.run_until_idle()
    assert sim.integrity_errors == []
    stats = sim.connector.offload.stats
    assert (stats.num_hit_tokens, stats.num_loaded_blocks, stats.bytes_loaded) == (48, 5, 5 * 512)
    sim.assert_no_leaks()


@pytest.mark.parametrize("mode", MODES)
def test_hybrid_failed_load_is_reported_by_request_and_recomputed(mode: str) -> None:
    """vLLM raises on failed block ids from a model with several groups: the worker names the request
    (`failed_recving`) instead, vLLM recomputes it, and the failed blocks' CPU copies are forgotten."""
    sim = WorkerSim(num_gpu_blocks=24, fail_load_events=(0,), failure_policy="recompute", mode=mode, window=32)
    prefix = tokens(21, 48)
    sim.add("A", prefix + tokens(22, 16))
    sim.run_until_idle()
    assert sim.sched.reset_prefix_cache()
    sim.add("B", prefix + tokens(24, 16))
    sim.run_until_idle()
    assert sim.failed_recving == {"B"}
    stats = sim.connector.offload.stats
    assert stats.num_failed_load_blocks == 5 and stats.num_loaded_blocks == 5  # one load, all of it failed
    assert sim.first_scheduled["B"] == 64  # recomputed from the start
    assert sim.integrity_errors == []
    sim.assert_no_leaks()


@pytest.mark.parametrize(("tensor", "match"), [
    (torch.zeros(7, 1, BS, 8), "not a multiple of num_gpu_blocks"),  # block count differs from vLLM's
    (torch.zeros(6, 1, BS, 8)[:, :, ::2], "not dense"),  # a layout whose blocks we cannot copy exactly
])
def test_unsupported_kv_tensors_fail_at_registration(tensor: torch.Tensor, match: str) -> None:
    from worker_side import LayoutError

    sim = Sim(num_gpu_blocks=6)
    conn = OffloadConnector(sim.vllm_config, KVConnectorRole.WORKER, sim.kv_cache_config)
    with pytest.raises(LayoutError, match=match):
        conn.register_kv_caches({"layer": tensor})
    conn.shutdown()


def test_worker_and_scheduler_must_agree_on_the_cpu_block_count() -> None:
    from offload_connector.vllm.errors import UnsupportedSetupError

    sim = Sim(num_gpu_blocks=6, num_cpu_blocks=None, cpu_bytes=64 * 512)  # sized from bytes, not pinned
    conn = OffloadConnector(sim.vllm_config, KVConnectorRole.WORKER, sim.kv_cache_config)
    assert conn.num_cpu_blocks == 64
    # 256-byte blocks would buy 128 CPU blocks on this rank, but the scheduler counts 64: refused.
    with pytest.raises(UnsupportedSetupError, match="must agree"):
        conn.register_kv_caches({"layer": torch.zeros(6, 1, BS, 4)})
    conn.shutdown()
