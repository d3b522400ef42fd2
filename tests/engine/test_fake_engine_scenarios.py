"""One story per SPEC §4 path, told through the fake engine with the real scheduler and worker sides.

Block size 4. The fake model verifies every block a request reads before each step, so each story also
checks the K/V contents after every load. Each test ends with no leaked blocks and clean pool invariants.
"""

from __future__ import annotations

from offload_connector.fake_engine import FakeEngine, RequestStatus
from offload_connector.fake_engine.workload import small_config
from worker_side import CpuBackend
from worker_side.testing.faults import FaultyBackend

PROMPT = list(range(100, 116))  # 16 tokens = 4 full blocks


def finish(engine: FakeEngine, request_id: str, prompt: list[int], max_tokens: int = 2) -> list[int]:
    """Run one request to the end, then let its stores land (stores complete asynchronously)."""
    engine.add_request(request_id, prompt, max_tokens)
    engine.run()
    backend = engine.worker.backend if engine.worker is not None else None
    if not (isinstance(backend, FaultyBackend) and backend.held_job_ids()):
        engine.drain()
    return engine.outputs[request_id]


def evict_gpu(engine: FakeEngine, tag: int) -> None:
    """Run a request big enough to take every free GPU block, so earlier prefixes leave the GPU cache."""
    n = (engine.gpu.num_usable_blocks - 1) * engine.block_size
    finish(engine, f"filler-{tag}", [5000 + tag * 1000 + i for i in range(n)], 1)


def reference_output(prompt: list[int], max_tokens: int = 2) -> list[int]:
    with FakeEngine(small_config(), connector=False) as engine:
        return finish(engine, "ref", prompt, max_tokens)


def test_cpu_hit_loads_the_prefix_and_resumes_next_step() -> None:
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32)) as engine:
        # 1. admit A, compute 4 full blocks; eager stores them; A finishes.
        out_a = finish(engine, "a", PROMPT)
        # 2. the GPU cache forgets A's blocks.
        evict_gpu(engine, 1)
        # 3. B, same prompt: GPU miss, CPU hit of 3 blocks (at least one token is computed).
        before = engine.stats.cpu_hit_tokens
        engine.add_request("b", PROMPT, 2)
        engine.step()
        assert engine.request_status("b") is RequestStatus.WAITING_FOR_REMOTE_KVS
        # 4. the load completed in that step; B runs next step on the loaded (verified) blocks.
        engine.run()
        assert engine.stats.cpu_hit_tokens - before == 12
        assert engine.outputs["b"] == out_a == reference_output(PROMPT)
        assert engine.check() == 0


def test_partial_cpu_hit_loads_the_shared_blocks_only() -> None:
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32)) as engine:
        finish(engine, "a", PROMPT)
        evict_gpu(engine, 1)
        before = engine.stats.cpu_hit_tokens
        other = PROMPT[:8] + [7, 7, 7, 7, 7, 7, 7, 7]  # shares 2 blocks with A
        assert finish(engine, "b", other) == reference_output(other)
        assert engine.stats.cpu_hit_tokens - before == 8
        assert engine.check() == 0


def test_miss_computes_everything_and_loads_nothing() -> None:
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32)) as engine:
        finish(engine, "a", PROMPT)
        loads = engine.stats.num_loads
        finish(engine, "b", list(range(900, 916)))
        assert engine.stats.num_loads == loads and engine.stats.cpu_hit_tokens == 0
        assert engine.check() == 0


def test_full_cpu_pool_skips_stores_and_never_fails_a_step() -> None:
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=3)) as engine:  # 2 usable CPU blocks
        # 1. A's 4 blocks want a store; only 2 CPU blocks exist: the rest is skipped.
        finish(engine, "a", PROMPT)
        assert engine.connector is not None
        assert engine.connector.stats.num_store_skipped_blocks >= 2
        evict_gpu(engine, 1)
        # 2. whatever made it to the CPU is still a valid (verified) hit.
        before = engine.stats.cpu_hit_tokens
        assert finish(engine, "b", PROMPT) == reference_output(PROMPT)
        assert engine.stats.cpu_hit_tokens - before in (0, 4, 8)
        assert engine.check() == 0


def test_preempted_request_resumes_from_the_cpu_tier() -> None:
    # A decodes long enough to need B's blocks: B (last running) is preempted, A's growth evicts B's
    # blocks from the GPU cache, and B comes back by loading its stored prefix from the CPU.
    cfg = small_config(num_gpu_blocks=13, num_cpu_blocks=40, max_num_batched_tokens=64)
    prompt_a, prompt_b = list(range(4)), list(range(200, 216))
    with FakeEngine(cfg) as engine:
        engine.add_request("a", prompt_a, 40)
        engine.add_request("b", prompt_b, 30)
        engine.run()
        s = engine.stats
        assert s.num_preemptions >= 1
        assert s.num_loads >= 1 and s.bytes_loaded > 0  # B's resume loaded from the CPU
        assert engine.check() == 0
        outputs = dict(engine.outputs)
    with FakeEngine(cfg, connector=False) as ref:
        ref.add_request("a", prompt_a, 40)
        ref.add_request("b", prompt_b, 30)
        ref.run()
        assert ref.outputs == outputs


def test_abort_during_load_keeps_the_blocks_until_the_load_is_done() -> None:
    backend = FaultyBackend(CpuBackend(), hold=lambda job: job.kind == "load" and job.event_id == 0)
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32), backend=backend,
                    wait_for_loads=False) as engine:
        finish(engine, "a", PROMPT)
        evict_gpu(engine, 1)
        engine.drain()  # no store left in flight
        # 1. B hits on the CPU; its load is held in flight.
        engine.add_request("b", PROMPT, 2)
        engine.step()
        engine.step()
        assert engine.request_status("b") is RequestStatus.WAITING_FOR_REMOTE_KVS
        # 2. abort B: the engine frees its blocks, the load job's own references keep 3 GPU blocks alive.
        assert engine.abort_request("b")
        assert engine.connector is not None and engine.connector.num_inflight_transfers == 1
        assert engine.gpu.pool.num_held_blocks() == 3
        # 3. the load completes; everything is released and C still hits correct data.
        backend.release_all()
        engine.drain()
        assert engine.gpu.pool.num_held_blocks() == 0
        assert finish(engine, "c", PROMPT) == reference_output(PROMPT)
        assert engine.check() == 0 and engine.stats.aborted_requests == 1


def test_an_id_reused_and_aborted_while_the_old_load_runs_keeps_that_load() -> None:
    backend = FaultyBackend(CpuBackend(), hold=lambda job: job.kind == "load" and job.event_id == 0)
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32), backend=backend,
                    wait_for_loads=False) as engine:
        finish(engine, "a", PROMPT)
        evict_gpu(engine, 1)
        engine.drain()
        # 1. B hits on the CPU; its load is held in flight; B is aborted.
        engine.add_request("b", PROMPT, 2)
        engine.step()
        engine.step()
        assert engine.abort_request("b")
        # 2. a new request under the id "b": its lookup waits for the old load; it is aborted too.
        engine.add_request("b", PROMPT, 2)
        engine.step()
        assert engine.abort_request("b")
        # 3. the old load still holds its 3 GPU and 3 CPU blocks, and the connector is not idle.
        connector = engine.connector
        assert connector is not None and connector.num_inflight_transfers == 1 and not connector.is_idle()
        assert engine.gpu.pool.num_held_blocks() == 3 and connector.cpu_pool.num_held_blocks() == 3
        # 4. the load completes: everything is released.
        backend.release_all()
        engine.drain()
        assert engine.gpu.pool.num_held_blocks() == 0 and connector.cpu_pool.num_held_blocks() == 0
        assert connector.is_idle()
        assert finish(engine, "c", PROMPT) == reference_output(PROMPT)
        assert engine.check() == 0 and engine.stats.aborted_requests == 2


def test_finish_during_store_keeps_the_source_blocks_until_the_store_is_done() -> None:
    backend = FaultyBackend(CpuBackend(), hold=lambda job: job.kind == "store" and job.event_id == 0)
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32), backend=backend) as engine:
        # 1. A computes and finishes while its store is held in flight.
        finish(engine, "a", PROMPT, 1)
        assert engine.connector is not None and engine.connector.num_inflight_transfers == 1
        assert engine.gpu.pool.num_held_blocks() == 4  # the store pins A's 4 source blocks
        # 2. other work cannot take the pinned blocks; the store then completes.
        backend.release_all()
        engine.drain()
        assert engine.gpu.pool.num_held_blocks() == 0
        evict_gpu(engine, 1)
        # 3. the stored copy is a correct CPU hit.
        before = engine.stats.cpu_hit_tokens
        assert finish(engine, "b", PROMPT) == reference_output(PROMPT)
        assert engine.stats.cpu_hit_tokens - before == 12
        assert engine.check() == 0


def test_failed_load_recomputes_from_the_first_failed_block() -> None:
    backend = FaultyBackend(CpuBackend(), fail_loads=True)
    with FakeEngine(small_config(num_gpu_blocks=12, num_cpu_blocks=32), backend=backend) as engine:
        finish(engine, "a", PROMPT)
        evict_gpu(engine, 1)
        before = engine.stats.cpu_hit_tokens
        assert finish(engine, "b", PROMPT) == reference_output(PROMPT)
        assert engine.stats.cpu_hit_tokens == before  # nothing usable arrived
        assert engine.stats.failed_load_blocks == 3
        assert engine.check() == 0
