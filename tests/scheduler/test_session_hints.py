"""Per-request hints (`kv_transfer_params`: store, session, close_session) through the fake engine, the
superseded-branch filter in the connector, and the replay's session closes. Block size 4; every load is
verified by the fake model and each story ends with no leaked blocks."""

from __future__ import annotations

import pytest

from offload_connector.cli.replay import replay_config, run_replay
from offload_connector.cli.trace import TraceRequest
from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import small_config
from offload_connector.hashing import with_group_id
from scheduler_side.admission.hints import (
    MAX_SESSION_CHARS,
    NO_HINTS,
    RequestHints,
    parse_hints,
    session_params,
)


def run(engine: FakeEngine, request_id: str, prompt: list[int], params: dict | None = None) -> None:
    engine.add_request(request_id, prompt, 2, params)
    engine.run()
    engine.drain()


def keys_of(engine: FakeEngine, request_id: str, prompt: list[int]) -> list[bytes]:
    from offload_connector.hashing import hash_request_tokens

    return [with_group_id(h) for h in hash_request_tokens(prompt, engine.block_size)]


def cpu_order(engine: FakeEngine) -> list[bytes | None]:
    """The CPU tier's free queue, eviction end first: each block's content key."""
    return [block.block_hash for block in engine.connector.cpu_pool.free_queue]


A = list(range(100, 116))  # 4 blocks
B = list(range(300, 316))
SHARED = list(range(500, 508))  # 2 blocks both sessions use


def test_store_false_stores_nothing() -> None:
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32)) as engine:
        # 1. an eager tier stores every computed block, except for a request that says store: false
        run(engine, "a", A, {"store": False})
        assert engine.connector.stats.num_stored_blocks == 0
        # 2. the same content without the hint is stored
        run(engine, "b", B)
        assert engine.connector.stats.num_stored_blocks == 4
        assert engine.check() == 0


def test_closing_a_session_demotes_only_its_own_blocks() -> None:
    with FakeEngine(small_config(num_gpu_blocks=40, num_cpu_blocks=64)) as engine:
        run(engine, "a1", SHARED + A, session_params("a"))
        run(engine, "b1", SHARED + B, session_params("b"))
        own_a = keys_of(engine, "a1", SHARED + A)[2:]
        shared = keys_of(engine, "a1", SHARED + A)[:2]
        assert all(engine.connector.is_saved(k) for k in own_a + shared)
        # 1. a's last request carries the close: its own blocks go to the eviction end, oldest first
        run(engine, "a2", SHARED + A + [7, 7, 7, 7], session_params("a", close=True))
        order = cpu_order(engine)
        head = [k for k in order if k is not None][:len(own_a)]
        assert head == own_a
        assert engine.connector.stats.num_closed_sessions == 1
        # 2. blocks b used too stay where they were (not at the head), and stay live
        assert not set(shared) & set(head)
        assert not any(engine.connector.admission.is_dead(k) for k in shared)
        assert all(engine.connector.admission.is_dead(k) for k in own_a)
        # 3. requested again: live again (and still a CPU hit: a demoted copy keeps its content)
        run(engine, "c", SHARED + A)
        assert not any(engine.connector.admission.is_dead(k) for k in own_a)
        assert engine.check() == 0


def test_closing_sessions_returns_and_counts_the_demoted_copies() -> None:
    """`close_session` returns how many CPU copies it moved to the eviction end; the stats sum the moved
    copies and the closes over several sessions.

    Found by mutation testing of scheduler_side/admissions.py (docs/mutation.md)."""
    with FakeEngine(small_config(num_gpu_blocks=40, num_cpu_blocks=64)) as engine:
        # 1. session a stores 4 blocks, session b 3
        run(engine, "a1", list(range(100, 116)), session_params("a"))
        run(engine, "b1", list(range(300, 312)), session_params("b"))
        sched = engine.connector
        # 2. each close moves exactly its own copies
        assert sched.close_session("a") == 4
        assert (sched.stats.num_demoted_blocks, sched.stats.num_closed_sessions) == (4, 1)
        assert sched.close_session("b") == 3
        assert (sched.stats.num_demoted_blocks, sched.stats.num_closed_sessions) == (7, 2)
        assert engine.check() == 0


def test_the_tree_waits_for_the_first_hint_unless_the_branch_filter_is_on() -> None:
    """No hint and no branch filter: no request is fed to the admission tree (no per-block cost). The first
    request with a hint switches it on for every request after it; the branch filter needs it from the
    start."""
    with FakeEngine(small_config(num_gpu_blocks=40, num_cpu_blocks=64)) as engine:
        run(engine, "plain", A)
        assert len(engine.connector.admission) == 0 and not engine.connector.admission.active
        run(engine, "hinted", B, session_params("s"))
        assert engine.connector.admission.active and len(engine.connector.admission) == 4
        run(engine, "plain2", SHARED)
        assert len(engine.connector.admission) == 6  # fed from now on, hint or not
        assert engine.check() == 0
    with FakeEngine(small_config(num_gpu_blocks=40, num_cpu_blocks=64, branch_filter=True)) as engine:
        run(engine, "plain", A)
        assert len(engine.connector.admission) == 4
        assert engine.check() == 0


def test_bad_hints_are_ignored_and_counted() -> None:
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32)) as engine:
        run(engine, "a", A, {"store": "no"})
        run(engine, "b", B, {"close_session": True})  # no session to close
        stats = engine.connector.stats
        assert stats.num_bad_hints == 2 and stats.num_stored_blocks == 8  # the defaults applied
        run(engine, "c", A + B, {"other_connector": {"x": 1}})  # not ours: no hint, not bad
        assert stats.num_bad_hints == 2
        assert engine.check() == 0


@pytest.mark.parametrize(("params", "ok"), [
    (None, NO_HINTS), ({}, NO_HINTS), ({"remote_host": "x"}, NO_HINTS),
    ({"session": "s"}, RequestHints(True, "s", False)),
    ({"session": "s", "close_session": True, "store": False}, RequestHints(False, "s", True)),
])
def test_parse_hints_valid(params, ok) -> None:
    assert parse_hints(params) == (ok, None)


@pytest.mark.parametrize("params", [
    [1], {"store": 1}, {"session": ""}, {"session": 3}, {"session": "x" * 257}, {"close_session": "yes"},
    {"close_session": True},
])
def test_parse_hints_invalid_names_the_key(params) -> None:
    hints, problem = parse_hints(params)
    assert hints is NO_HINTS and problem and "kv_transfer_params" in problem


def test_bad_hints_are_named_in_the_message() -> None:
    """Found by mutation testing of scheduler_side/admission/hints.py (docs/mutation.md)."""
    assert "got list" in parse_hints([1])[1]
    long = "s" * (MAX_SESSION_CHARS + 1)
    assert repr(long[:40]) in parse_hints({"session": long})[1]
    assert parse_hints({"close_session": True})[1].startswith("kv_transfer_params 'close_session'")


def test_a_session_id_of_the_maximum_length_is_valid() -> None:
    """Found by mutation testing of scheduler_side/admission/hints.py (docs/mutation.md)."""
    hints, problem = parse_hints({"session": "s" * MAX_SESSION_CHARS})
    assert problem is None and hints.session == "s" * MAX_SESSION_CHARS



def test_session_params_with_store_false_parse_as_store_false() -> None:
    """The helper's `store=False` reaches the connector as the `store: false` hint.

    Found by mutation testing of scheduler_side/admission/hints.py (docs/mutation.md)."""
    params = session_params("s", store=False)
    assert params == {"session": "s", "store": False}
    assert parse_hints(params) == (RequestHints(store=False, session="s", close_session=False), None)


def test_branch_filter_drops_a_superseded_branch_and_a_revived_block_is_stored_again() -> None:
    with FakeEngine(small_config(num_gpu_blocks=40, num_cpu_blocks=64, branch_filter=True)) as engine:
        # 1. turn one: P + X (X: the old tail), stored (eager)
        p, x, y = list(range(100, 108)), list(range(200, 208)), list(range(300, 308))
        run(engine, "t1", p + x)
        kx = keys_of(engine, "t1", p + x)[2:]
        assert all(engine.connector.is_saved(k) for k in kx)
        # 2. turn two extends P with Y: X's subtree is dropped from the CPU tier
        run(engine, "t2", p + y)
        assert not any(engine.connector.is_saved(k) for k in kx)
        assert engine.connector.stats.num_dropped_blocks >= 2
        # 3. X is requested again: live; the block it computes again (its last) is stored again
        run(engine, "t3", p + x)
        assert not any(engine.connector.admission.is_dead(k) for k in kx)
        assert engine.connector.is_saved(kx[-1])
        assert engine.check() == 0


def test_branch_filter_never_drops_a_prefix_with_two_children() -> None:
    with FakeEngine(small_config(num_gpu_blocks=60, num_cpu_blocks=64, branch_filter=True)) as engine:
        system, p = list(range(100, 108)), list(range(900, 904))
        run(engine, "u1", system + list(range(200, 208)))
        run(engine, "u2", system + list(range(300, 308)))  # system's last block has two children now
        ks = keys_of(engine, "u1", system)
        run(engine, "u3", p + system)  # unrelated
        run(engine, "u4", system + list(range(400, 408)))
        assert all(engine.connector.is_saved(k) for k in ks)
        assert engine.check() == 0


def trace(sessions: list[str | None]) -> list[TraceRequest]:
    return [TraceRequest(timestamp=1000 * i, input_length=1024 + 512 * i, output_length=4,
                         hash_ids=list(range(2 + i)) if s == "a" else [100 + i, 200 + i], session=s)
            for i, s in enumerate(sessions)]


@pytest.mark.parametrize(("close", "delay", "want"), [(True, 0.0, 1), (False, 0.0, 0), (True, 1.5, 1)])
def test_replay_closes_a_session_after_its_last_request(close: bool, delay: float, want: int) -> None:
    config = replay_config({"num_cpu_blocks": 64, "engine": {"num_gpu_blocks": 64, "max_num_seqs": 1}})
    requests = trace(["a", "a", None, "a", None, None])
    result = run_replay(config, requests, scaled=True, session_close=close, session_close_delay=delay)
    assert result.connector["num_closed_sessions"] == want
    assert result.stats.integrity_errors == 0 and result.stats.leaked_blocks == 0
