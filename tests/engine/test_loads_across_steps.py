"""Loads in flight across steps, through the fake engine with real copies: no store writes a host block that
a load in flight still reads.

Lazy under CPU pressure with the load wait off (`max_store_wait_steps: 0`) and a 12-block CPU tier; forty
requests share two prefixes, so requests hit CPU blocks that other requests are loading, in the same step
or while an earlier step's load is in flight; every other load event stalls for up to five steps (its copy
runs late and reads its slots only then). The scheduler lends a loaded slot to its step's store only when
that load alone reads it. Three checks watch it independently: the fake model verifies every K/V a request
reads (a store that beat a stalled load to its slot brings wrong bytes), the workers check every store
against their loads in flight (`StoreReadOverlapError` from the engine's check), and the connector's
`check_integrity` runs after every step.
"""

from __future__ import annotations

import pytest
from remote_helpers import reference_outputs

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import random_workload, small_config
from offload_connector.metadata import TransferMetadata
from worker_side import CpuBackend
from worker_side.load_reads import LoadReads
from worker_side.testing.faults import FaultyBackend

RELEASE_EVERY = 5  # steps a stalled load waits at most


class SettledFaulty(FaultyBackend):
    """Every copy not stalled is over before the worker polls, so a seed gives the same run every time."""

    def poll(self):
        self.inner.wait(None)  # (stalled jobs, and those behind them, are not in the inner backend yet)
        return super().poll()


def run_with_loads_stalled(seed: int, check_each_step: bool) -> tuple[int, int]:
    """One seed, checked throughout; returns (loads that read a block a stalled load still read, slots lent
    to stores)."""
    cfg = small_config(num_gpu_blocks=14, num_cpu_blocks=12, store_policy="lazy", max_store_wait_steps=0)
    wl = random_workload(seed, num_requests=40, num_prefixes=2)
    backend = SettledFaulty(CpuBackend(2), stall=lambda job: job.kind == "load" and job.event_id % 2 == 0)
    stalled: dict[int, set[int]] = {}  # load event not released yet -> the host blocks it reads
    shared = 0
    with FakeEngine(cfg, backend=backend, wait_for_loads=False,
                    check_each_step=check_each_step) as engine:
        conn = engine.connector
        assert conn is not None
        build = conn.build_connector_meta

        def watch(scheduled) -> TransferMetadata:
            nonlocal shared
            meta = build(scheduled)
            if meta.load_event is not None:
                reads = set(meta.load_cpu_blocks)
                shared += any(reads & other for other in stalled.values())
                if meta.load_event % 2 == 0:
                    stalled[meta.load_event] = reads
            return meta

        conn.build_connector_meta = watch
        for request_id, prompt, max_tokens in wl.requests:
            engine.add_request(request_id, prompt, max_tokens)
        step = 0
        while engine.has_unfinished():
            engine.step()
            step += 1
            if step % RELEASE_EVERY == 0:
                backend.release_all()
                stalled.clear()
        backend.release_all()
        assert engine.check() == 0 and engine.stats.integrity_errors == 0
        reference = reference_outputs(wl)
        assert len(engine.outputs) + engine.stats.rejected_requests == len(wl.requests)
        assert all(tokens == reference[rid] for rid, tokens in engine.outputs.items())
        return shared, conn.stats.num_reused_load_slots


@pytest.mark.parametrize("checks", ["all", "workers and K/V", "K/V only"])
def test_stores_never_take_a_slot_a_load_in_flight_reads(monkeypatch: pytest.MonkeyPatch, checks: str) -> None:
    """Each check on its own would see a wrong lend. Without the connector's check after every step, the
    workers still order such a store after the load and the engine's check reports it; with the workers
    trusting the metadata too (`K/V only`) the store overwrites the slot before the stalled load reads it,
    and the fake model sees the wrong bytes."""
    if checks == "K/V only":
        monkeypatch.setattr(LoadReads, "readers", lambda self, cpu_block_ids: ())
    shared = lent = 0
    for seed in range(20):
        s, n = run_with_loads_stalled(seed, check_each_step=checks == "all")
        shared, lent = shared + s, lent + n
    assert shared > 0 and lent > 0, (shared, lent)  # both happened: loads sharing blocks, and lent slots
