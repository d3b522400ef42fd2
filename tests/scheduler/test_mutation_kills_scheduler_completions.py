"""Completion accounting, skipped stores and the admission filter at a request's finish: behaviours the
mutation run found no test for (docs/mutation.md)."""

from __future__ import annotations

from helpers import FakeRequest, admit, finish, make_scheduler, report, step_done

from offload_connector.hashing import hash_request_tokens, with_group_id

BS = 4


def test_failed_load_blocks_add_up_over_reports() -> None:
    sched, _ = make_scheduler(block_size=BS)
    sched.update_connector_output(report(failed_load_gpu_blocks=[3, 4]))
    sched.update_connector_output(report(failed_load_gpu_blocks=[5]))
    assert sched.stats.num_failed_load_blocks == 3


def test_stores_the_cpu_tier_cannot_take_are_counted_as_skipped() -> None:
    sched, gpu = make_scheduler(num_cpu_blocks=3, block_size=BS)  # 2 usable CPU blocks
    req = FakeRequest("A", list(range(17)), BS)  # 4 full blocks
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done("A", ids, 17)])
    assert len(meta.store_gpu_blocks) == 2 and sched.stats.num_store_skipped_blocks == 2
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, req, ids)


def generate(req: FakeRequest, output: list[int]) -> None:
    """The engine appended `output` to the request: its block hashes grow (vLLM's request does the same)."""
    req.tokens = req.tokens + output
    req.block_hashes = list(hash_request_tokens(req.tokens, req.block_size, req.cache_salt))


def test_a_finishing_request_s_output_supersedes_nothing() -> None:
    """With the branch filter, a request's output joins the tree at its finish without superseding: two
    answers to the same prompt are siblings, the first one's blocks stay live."""
    sched, gpu = make_scheduler(block_size=BS, branch_filter=True)
    prompt = list(range(8))
    a = FakeRequest("A", list(prompt), BS)
    _, _, a_ids = admit(sched, gpu, a)
    generate(a, [100, 101, 102, 103])
    finish(sched, gpu, a, a_ids)
    b = FakeRequest("B", list(prompt), BS)
    _, _, b_ids = admit(sched, gpu, b)
    generate(b, [200, 201, 202, 203])
    finish(sched, gpu, b, b_ids)
    first_answer = with_group_id(a.block_hashes[2])
    assert first_answer in sched.admission._nodes and not sched.admission.is_dead(first_answer)


def superseded(sched, gpu):
    """A uses P0 P1 X; B then uses P0 P1 Y: B's new branch supersedes X. Returns A, A's ids, X's key."""
    a = FakeRequest("A", list(range(12)), BS)
    _, _, a_ids = admit(sched, gpu, a)
    b = FakeRequest("B", list(range(8)) + [50, 51, 52, 53], BS)
    admit(sched, gpu, b)
    x = with_group_id(a.block_hashes[2])
    assert sched.admission.is_dead(x)
    return a, a_ids, x


def test_a_request_admitted_again_revives_its_superseded_blocks() -> None:
    """Preempted and admitted again, a request uses all its blocks again: a dead one is live again."""
    sched, gpu = make_scheduler(block_size=BS, branch_filter=True)
    a, a_ids, x = superseded(sched, gpu)
    sched.request_preempted("A")
    gpu.free([gpu.blocks[i] for i in reversed(a_ids)])
    admit(sched, gpu, a)
    assert not sched.admission.is_dead(x)


def test_a_finishing_request_adds_its_output_and_revives_nothing() -> None:
    """At its finish only the blocks a request completed since admission join the tree: a prompt block
    superseded while it ran stays dead."""
    sched, gpu = make_scheduler(block_size=BS, branch_filter=True)
    a, a_ids, x = superseded(sched, gpu)
    generate(a, [60, 61, 62, 63])
    finish(sched, gpu, a, a_ids)
    assert sched.admission.is_dead(x) and with_group_id(a.block_hashes[3]) in sched.admission._nodes
