"""What the scheduler refuses as an engine's misuse or our own bug, each error naming what is wrong: a
non-positive block or world size, a completion of an event never issued, a load that the allocated GPU
blocks cannot hold, a load job sent twice, a CPU reference no transfer accounts for."""

from __future__ import annotations

import pytest
from helpers import FakeRequest, admit, make_scheduler, report, step_done, store_and_finish

from offload_connector.config import load_config
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler, SchedulerError

BS = 4


def test_block_size_and_world_size_must_be_positive():
    """Found by mutation testing of scheduler_side/scheduler.py (docs/mutation.md)."""
    config, gpu = load_config({"store_policy": "eager", "num_cpu_blocks": 4}), BlockPoolGpuView(BlockPool(8))
    for block_size, world_size in ((0, 1), (1, 0), (-1, 1), (1, -2)):
        with pytest.raises(ValueError, match="must be positive"):
            OffloadScheduler(config, block_size, 4, gpu, world_size)
    assert OffloadScheduler(config, 1, 4, gpu, 1).block_size == 1


def test_a_completion_for_the_next_unissued_store_event_is_refused():
    """Found by mutation testing of scheduler_side/completions.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    a = FakeRequest("A", list(range(9)), BS)
    _, _, ids = admit(sched, gpu, a)
    meta = sched.build_connector_meta([step_done("A", ids, 9)])
    with pytest.raises(SchedulerError, match="never issued"):
        sched.update_connector_output(report(completed_store_events=[meta.store_event + 1]))


def test_load_mapping_errors_name_the_request_and_whole_blocks() -> None:
    """Found by mutation testing of scheduler_side/allocations.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(9)), BS))
    b = FakeRequest("req-b", list(range(9)) + [7, 7, 7, 7], BS)
    assert sched.get_num_new_matched_tokens(b, 0) == (2 * BS, True)
    with pytest.raises(SchedulerError, match=r"req-b: 1 GPU blocks cannot hold a load of 2 blocks after 0 GPU"):
        sched.update_state_after_alloc(b, [5], 2 * BS)


def test_a_load_queued_twice_is_refused() -> None:
    """Our invariant: a load job is handed to the workers once.

    Found by mutation testing of scheduler_side/transfers.py (docs/mutation.md)."""
    sched, gpu = make_scheduler(block_size=BS)
    store_and_finish(sched, gpu, FakeRequest("A", list(range(9)), BS))
    b = FakeRequest("B", list(range(9)), BS)
    admit(sched, gpu, b)
    state = sched.transfers.requests["B"]
    sched.build_connector_meta([])
    sched.transfers.loads_to_send.append(state)
    with pytest.raises(SchedulerError, match="without a fresh job"):
        sched.build_connector_meta([])


def test_integrity_finds_a_cpu_reference_nobody_accounts_for():
    """Found by mutation testing of scheduler_side/scheduler.py (docs/mutation.md)."""
    sched, _ = make_scheduler(block_size=BS)
    sched.check_integrity()
    sched.cpu_pool.touch([sched.cpu_pool.blocks[1]])  # block 1, one reference: nobody's
    with pytest.raises(SchedulerError, match="referenced but no transfer"):
        sched.check_integrity()
