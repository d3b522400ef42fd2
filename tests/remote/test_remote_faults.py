"""Faults of the remote tier against a real redis-server: each is a miss, never an engine error.

For each fault: the engine finishes every request, every block it read is verified (0 integrity errors),
nothing leaks, outputs equal an engine's without any connector, and the counters say what happened.
"""

from __future__ import annotations

import pytest
from redis_servers import RedisServer, redis_server, require_redis  # noqa: F401 - fixture
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs, remote_config, worker_counter

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.engine import tier_identity
from offload_connector.fake_engine.workload import run_workload
from offload_connector.hashing import hash_request_tokens, with_group_id
from offload_connector.remote.breaker import OPEN
from offload_connector.remote.format import BlockParts, block_key, decode_value, key_prefix

SHARED = prefixes(7, 6)


def seed_server(url: str) -> int:
    """Engine A computes SHARED; returns how many blocks it wrote."""
    with FakeEngine(remote_config(url)) as a:
        run_workload(a, one_per_prefix("a", SHARED, 1))
        clean(a)
        return worker_counter(a, "written_blocks")


def run_b(url: str, tag: str = "b", **remote) -> tuple[FakeEngine, dict]:
    wl = one_per_prefix(tag, SHARED, 2)
    engine = FakeEngine(remote_config(url, **remote))
    run_workload(engine, wl)
    clean(engine)
    assert engine.outputs == reference_outputs(wl)
    return engine, engine.outputs


def test_server_killed_mid_run_and_restarted(redis_server) -> None:  # noqa: F811
    fast = {"breaker_backoff_ms": 20, "breaker_max_backoff_ms": 40}
    with FakeEngine(remote_config(redis_server.url, **fast)) as engine:
        wl = one_per_prefix("k", prefixes(8, 12), 3)
        for request_id, prompt, max_tokens in wl.requests:
            engine.add_request(request_id, prompt, max_tokens)
        # 1. some steps with the server up, then it dies (SIGKILL) while requests are in flight
        for _ in range(30):
            engine.step()
        redis_server.stop()
        engine.run()
        clean_after = engine.check()
        assert clean_after == 0 and engine.stats.integrity_errors == 0
        assert engine.stats.finished_requests == 12
        errors = worker_counter(engine, "errors") + engine.connector.tiers["remote"].counters.errors
        assert errors > 0 and engine.worker.tier_ios["remote"].breaker.num_trips > 0
        # 2. the server comes back (empty): the breaker lets a trial through by itself, writes resume
        redis_server.start()
        written = worker_counter(engine, "written_blocks")
        for i in range(200):  # a bound on rounds, not on time: each round stores new blocks
            run_workload(engine, one_per_prefix(f"r{i}-", prefixes(100 + i, 2), 4))
            if worker_counter(engine, "written_blocks") > written:
                break
        assert worker_counter(engine, "written_blocks") > written
        assert int(redis_server.cli("DBSIZE")) > 0
        clean(engine)


def test_server_stalled_longer_than_timeout(redis_server) -> None:  # noqa: F811
    assert seed_server(redis_server.url) > 0
    redis_server.pause()  # SIGSTOP: connections hang instead of failing
    try:
        engine, _ = run_b(redis_server.url, timeout_ms=100, breaker_backoff_ms=60000, breaker_max_backoff_ms=60000)
        lookups = engine.connector.tiers["remote"].counters
        assert lookups.lookup_timeouts + lookups.errors > 0 and engine.stats.cpu_hit_tokens == 0
        assert engine.connector.tiers["remote"].lookups.client.breaker.state == OPEN
        # 2. later requests do not wait at all while the breaker is open
        run_workload(engine, one_per_prefix("c", prefixes(9, 3), 5))
        clean(engine)
        assert lookups.lookups_skipped == 3
        engine.close()
    finally:
        redis_server.resume()


def test_maxmemory_reached_evicts_and_stays_correct(redis_server) -> None:  # noqa: F811
    before = redis_server.info("used_memory")
    written = seed_server(redis_server.url)
    after = redis_server.info("used_memory")
    # 1. the server is now full: half of what A wrote must go before anything new fits (allkeys-lru)
    redis_server.cli("CONFIG", "SET", "maxmemory", str(after - (after - before) // 2))
    engine, _ = run_b(redis_server.url)
    assert written > 0 and redis_server.info("evicted_keys") > 0
    # 2. B fetched what was left (a hole ends a request's run), never wrong bytes
    assert worker_counter(engine, "corrupt_blocks") == 0
    assert engine.connector.tiers["remote"].counters.lookup_hit_blocks < written
    engine.close()


def test_server_refusing_writes_when_full(tmp_path) -> None:
    require_redis()
    server = RedisServer(tmp_path, policy="noeviction")
    try:
        server.cli("CONFIG", "SET", "maxmemory", str(server.info("used_memory") + 10_000))
        with FakeEngine(remote_config(server.url)) as a:
            run_workload(a, one_per_prefix("a", SHARED, 1))
            clean(a)
            assert worker_counter(a, "errors") > 0 and worker_counter(a, "dropped_writes") > 0  # OOM replies
            assert a.worker.tier_ios["remote"].breaker.state != OPEN  # a full server is up: no reason to stop asking
    finally:
        server.stop()


def test_corrupted_value_is_a_miss_and_deleted(redis_server) -> None:  # noqa: F811
    assert seed_server(redis_server.url) > 0
    cfg = remote_config(redis_server.url)
    first_block = with_group_id(hash_request_tokens(SHARED[0], cfg.engine.block_size)[0], 0)
    part = BlockParts.of(tier_identity(cfg), 0, 1).labels[0]  # the first KV head's part
    victim = block_key(key_prefix(tier_identity(cfg), "t"), part, first_block).decode()  # B asks for it
    redis_server.cli("SETRANGE", victim, "40", "X")  # one payload byte changed; the header is intact
    engine, _ = run_b(redis_server.url)
    assert worker_counter(engine, "corrupt_blocks") == 1
    # deleted, then B computed the block and wrote it again: the value is valid now
    redis = pytest.importorskip("redis")
    blob = redis.Redis(port=redis_server.port).get(victim)
    part_bytes = engine.worker.bytes_per_block // engine.config.engine.num_kv_heads  # one head's part
    assert decode_value(victim.encode(), blob, part_bytes)[1] == ""
    assert worker_counter(engine, "fetched_blocks") > 0  # the other blocks were still used
    engine.close()


def test_wrong_password_is_a_miss(tmp_path) -> None:
    require_redis()
    server = RedisServer(tmp_path, password="right")
    try:
        seed_server(server.url)
        wrong = f"redis://:wrong@127.0.0.1:{server.port}/0"
        engine, _ = run_b(wrong, breaker_backoff_ms=60000, breaker_max_backoff_ms=60000)
        assert engine.stats.cpu_hit_tokens == 0
        assert engine.connector.tiers["remote"].counters.errors > 0
        assert engine.connector.tiers["remote"].lookups.client.breaker.state == OPEN
        assert worker_counter(engine, "written_blocks") == 0 and worker_counter(engine, "dropped_writes") > 0
        engine.close()
    finally:
        server.stop()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0"])
def test_no_server_at_all(url) -> None:
    require_redis()
    engine, _ = run_b(url, timeout_ms=50)
    assert engine.stats.cpu_hit_tokens == 0 and engine.connector.tiers["remote"].counters.errors > 0
    engine.close()


def test_a_failing_fetch_path_is_a_miss_not_a_stuck_request(redis_server, monkeypatch) -> None:  # noqa: F811
    assert seed_server(redis_server.url) > 0

    def broken(self, cpu_block_id, payloads):
        raise RuntimeError("injected: the host-pool write fails")

    monkeypatch.setattr("worker_side.tiers.remote_io.HeadRows.write_parts", broken)
    engine, _ = run_b(redis_server.url)  # finishes, every block verified, outputs unchanged
    assert engine.stats.cpu_hit_tokens == 0 and worker_counter(engine, "errors") > 0
    assert engine.connector.tiers["remote"].counters.lookup_hit_blocks > 0  # found, fetched, refused: recomputed
    engine.close()
