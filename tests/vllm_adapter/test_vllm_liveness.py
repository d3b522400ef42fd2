"""Liveness under pressure in vLLM's real Scheduler: the engine never wedges with our connector.

The failure vLLM users report most with CPU offload (vLLM #45406, #53868, #57841): requests parked on
loads hold GPU blocks while the queue head cannot be scheduled, and the engine sits at "Running: 0".
Here a tight GPU pool, shared prefixes evicted and loaded back, loads held back for several steps at a
time, aborts of requests in every state and the preemptions the pool forces run in both scheduling modes.
After every step the engine must have made progress or be entitled to wait: it scheduled a request,
admitted one whose load it issued or preempted one to free blocks, or a transfer of ours was in flight,
or nothing is waiting. Every request must finish, and nothing leaks.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_sim_helpers import MODES, Sim, tokens  # noqa: E402


def transfers_in_flight(sim: Sim) -> bool:
    """A load the fake worker holds back, or a store or load our scheduler side still waits for."""
    offload = sim.connector.offload
    return bool(sim._held) or (offload is not None and offload.num_inflight_transfers > 0)


def nothing_waiting(sim: Sim) -> bool:
    return not sim.sched.waiting and not getattr(sim.sched, "skipped_waiting", None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_engine_never_wedges_under_pressure(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    # 14 usable GPU blocks for up to 4 requests of 4-7 blocks each: admissions evict, the pool preempts.
    sim = Sim(num_gpu_blocks=15, num_cpu_blocks=48, max_num_seqs=4, max_num_batched_tokens=64, mode=mode)
    prefixes = [tokens(300 + i, 48) for i in range(4)]
    added: list[str] = []
    aborted: set[str] = set()
    for step in range(400):
        if len(added) < 60 and rng.random() < 0.5:
            req_id = f"r{len(added)}"
            sim.add(req_id, rng.choice(prefixes) + tokens(400 + len(added), rng.randrange(1, 40)),
                    max_tokens=rng.randrange(1, 24))
            added.append(req_id)
        sim.hold_loads = rng.random() < 0.3  # loads in flight for a few steps at a time
        live = [r for r in added if r in sim.sched.requests and r not in aborted]
        # Abort whatever state it is in (waiting, loading, running), while requests still arrive and at
        # most 8 times: aborts must not clear away a request that is stuck (the end would not see it).
        if live and len(added) < 60 and len(aborted) < 8 and rng.random() < 0.05:
            victim = rng.choice(live)
            sim.sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        had_transfers = transfers_in_flight(sim)
        running_batch = any(out.num_scheduled_tokens for out, _ in sim._in_flight)  # async: still executing
        scheduled = sim.step()
        # Progress, or a reason to wait. Async mode: a batch executing while this step was scheduled is
        # requests running (their blocks are freed only once its output is processed: vLLM's
        # defer_block_free), so a step that schedules nothing because of it is not a stall.
        issued = bool(sim.scheduled and sim.loads[-1])  # admitted with a CPU hit: computes once loaded
        # A step whose schedule() preempted frees blocks but schedules no waiting request (vLLM's rule):
        preempting = bool(sim.scheduled and sim.last_preempted)
        waited = had_transfers or transfers_in_flight(sim)  # a load held back, or a store, in this step
        if not (scheduled or issued or preempting or waited or nothing_waiting(sim) or running_batch):
            raise AssertionError(f"step {step}: nothing scheduled, no transfer in flight, "
                                 f"{len(sim.sched.waiting)} waiting: the engine is wedged")
        if not sim.busy and len(added) >= 60:
            break
    sim.hold_loads = False
    sim.run_until_idle(max_steps=500)
    assert len(added) == 60 and not sim.sched.requests  # every request finished (or was aborted)
    assert sim.preempted, "the pool was meant to force preemptions"
    assert any(sim.loads), "prefixes were meant to come back from the CPU tier"
    sim.assert_no_leaks()
