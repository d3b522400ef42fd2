"""The fake engine itself: vLLM-like scheduling, the verifying fake model, stats, leaks.

Every run here goes through the fake model, which verifies the K/V of every block a request reads (computed,
GPU hit or loaded from the CPU tier) before each step.
"""

from __future__ import annotations

import pytest
import torch

from offload_connector.fake_engine import FakeEngine, IntegrityError, RequestStatus, kv_pattern
from offload_connector.fake_engine.workload import random_workload, run_workload, small_config


def test_kv_pattern_is_exact_in_every_dtype_and_depends_on_the_prefix() -> None:
    seeds = kv_pattern.prefix_seeds([5, 6, 7, 8])
    pos = torch.arange(4)
    ref = kv_pattern.kv_values(seeds, pos, (2, 2, 2, 4), torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(kv_pattern.kv_values(seeds, pos, (2, 2, 2, 4), dtype).float(), ref)
    other = kv_pattern.prefix_seeds([5, 9, 7, 8])
    assert seeds[0] == other[0] and not torch.equal(seeds[1:], other[1:])  # a change affects all later tokens
    assert kv_pattern.extend_seed(int(seeds[2]), 8, 3) == int(seeds[3])
    assert not torch.equal(ref[0], ref[1])  # layers differ


def test_outputs_equal_with_and_without_connector() -> None:
    wl = random_workload(seed=1, num_requests=40)
    outputs = {}
    for connector in (True, False):
        with FakeEngine(small_config(), connector=connector) as engine:
            run_workload(engine, wl)
            assert engine.stats.integrity_errors == 0 and engine.stats.leaked_blocks == 0
            assert engine.stats.finished_requests == 40
            outputs[connector] = engine.outputs
            if connector:
                assert engine.stats.cpu_hit_tokens > 0 and engine.stats.bytes_loaded > 0
                assert engine.stats.bytes_stored > 0
            else:
                assert engine.stats.cpu_hit_tokens == 0
    assert outputs[True] == outputs[False]


def test_prompt_tokens_split_into_gpu_cpu_and_computed() -> None:
    with FakeEngine(small_config()) as engine:
        run_workload(engine, random_workload(seed=2))
        s = engine.stats
        assert s.prompt_tokens == s.gpu_hit_tokens + s.cpu_hit_tokens + s.computed_prompt_tokens
        assert s.gpu_hit_tokens > 0 and s.steps > 0 and s.verified_tokens > 0
        d = s.to_dict()
        for key in ("requests", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens", "computed_prompt_tokens",
                    "bytes_stored", "bytes_loaded", "integrity_errors", "leaked_blocks", "steps"):
            assert key in d


def test_gpu_pool_pressure_preempts_and_recomputes() -> None:
    cfg = small_config(num_gpu_blocks=16, max_num_seqs=4)
    wl = random_workload(seed=3, num_requests=12, max_prefix=20, max_tokens=20)
    with FakeEngine(cfg) as engine:
        run_workload(engine, wl)
        assert engine.stats.num_preemptions > 0
        assert engine.stats.finished_requests == 12 and engine.stats.leaked_blocks == 0


def test_request_longer_than_the_gpu_pool_is_rejected() -> None:
    with FakeEngine(small_config(num_gpu_blocks=5)) as engine:  # 4 usable blocks of 4 tokens
        req = engine.add_request("long", list(range(20)), 2)
        assert req.status is RequestStatus.ABORTED and engine.stats.rejected_requests == 1
        assert not engine.has_unfinished()


def test_abort_waiting_and_running_requests_frees_everything() -> None:
    with FakeEngine(small_config()) as engine:
        engine.add_request("a", list(range(30)), 10)
        engine.add_request("b", list(range(100, 130)), 10)
        engine.step()
        assert engine.request_status("a") is RequestStatus.RUNNING
        assert engine.abort_request("a") and engine.abort_request("b")
        assert not engine.abort_request("a")
        engine.run()
        assert engine.check() == 0 and engine.stats.aborted_requests == 2


def test_corrupted_block_is_an_integrity_error_never_silent() -> None:
    with FakeEngine(small_config()) as engine:
        engine.add_request("a", list(range(12)), 5)
        engine.step()  # prefill: 12 tokens in 3 blocks
        req = engine.scheduler.requests["a"]
        layer = next(iter(engine.model.kv_caches.values()))
        layer[1, req.gpu_block_ids[1], 2, 0, 0] += 1  # one value of one token of one block
        with pytest.raises(IntegrityError, match=f"GPU blocks \\[{req.gpu_block_ids[1]}\\]"):
            engine.step()
        assert engine.stats.integrity_errors == 1


def test_stats_count_steps_and_load_waits() -> None:
    with FakeEngine(small_config(num_gpu_blocks=16, num_cpu_blocks=40)) as engine:
        run_workload(engine, random_workload(seed=4, num_requests=30))
        s = engine.stats
        assert s.num_loads > 0 and s.load_wait_steps == s.num_loads  # wait_for_loads: one step each
        assert s.max_load_wait_steps == 1


def test_a_request_hits_blocks_an_earlier_one_computes_in_the_same_step() -> None:
    """vLLM caches blocks when it schedules them: a second request admitted in the same step shares the
    prefix the first one is computing, and reads it only after the forward wrote it."""
    prompt = list(range(1, 18))  # 4 full blocks of 4 tokens and one token more
    with FakeEngine(small_config(), connector=False) as engine:
        a = engine.add_request("a", prompt, 2)
        b = engine.add_request("b", prompt[:16] + [99], 2)
        engine.step()
        assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.RUNNING
        assert engine.stats.steps == 1 and b.num_gpu_hit_tokens == 16 and a.num_gpu_hit_tokens == 0
        while engine.has_unfinished():
            engine.step()
        engine.check()
        assert engine.stats.integrity_errors == 0 and engine.stats.verified_tokens > 0


def test_the_fake_engine_keeps_no_kv_events_it_is_never_asked_for():
    """Issue 12 item 9: 77,541 events were pending after 24,000 requests, most of the replay's growth."""
    with FakeEngine(small_config(num_gpu_blocks=16, num_cpu_blocks=24)) as engine:
        run_workload(engine, random_workload(0, num_requests=40))
        assert engine.stats.cpu_hit_tokens > 0 and engine.connector.stats.num_stored_blocks > 0
        assert engine.connector.take_events() == []
