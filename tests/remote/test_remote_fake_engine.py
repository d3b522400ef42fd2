"""The remote tier end to end on fake engines sharing one real redis-server.

Engine A computes some prefixes (its stores are written to the server); engine B, with an empty CPU tier,
then sees each prefix once: every CPU hit B gets must come from the server (fetched into its CPU tier,
then loaded). The fake model verifies every block each request reads, so a wrong fetched byte is an
integrity error; outputs must equal an engine's without any connector.
"""

from __future__ import annotations

import pytest
from redis_servers import redis_cluster, redis_server  # noqa: F401 - fixtures
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs, remote_config, worker_counter

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload, small_config


@pytest.mark.parametrize("tp", [1, 2])
def test_second_engine_gets_remote_hits_on_the_first_ones_prefixes(redis_server, tp) -> None:  # noqa: F811
    shared = prefixes(1, 6)
    wl_a, wl_b = one_per_prefix("a", shared, 2), one_per_prefix("b", shared, 3)
    # 1. engine A computes the prefixes; its stores are written to the server
    with FakeEngine(remote_config(redis_server.url), tp_size=tp) as a:
        a.connector.emit_kv_events = True
        run_workload(a, wl_a)
        clean(a)
        written = sum(w.tier_ios["remote"].counters.written_blocks for w in a.workers)
        assert written > 0 and a.stats.cpu_hit_tokens == 0
        # one key per block per KV head at TP 1 (records per head); per rank at TP 2 (ranks salted apart)
        parts_per_write = a.config.engine.num_kv_heads if tp == 1 else 1
        assert int(redis_server.cli("DBSIZE")) == written * parts_per_write
        # every block is published once, with medium REMOTE, when every rank's copy is on the server
        remote = [e for e in a.connector.take_events() if e.medium == "REMOTE"]
        assert all(e.kind == "stored" for e in remote) and len({e.block_hash for e in remote}) == len(remote)
        assert len(remote) * tp == written
    # 2. engine B: an empty CPU tier, each prefix once; its only hits come from the server
    with FakeEngine(remote_config(redis_server.url), tp_size=tp) as b:
        run_workload(b, wl_b)
        clean(b)
        lookups, fetched = b.connector.tiers["remote"].counters, sum(w.tier_ios["remote"].counters.fetched_blocks for w in b.workers)
        assert lookups.lookup_hit_blocks > 0 and fetched == tp * lookups.lookup_hit_blocks
        # every prefix block (6 of 4 tokens, 6 requests) is a hit; B computed none of them, so the CPU hits
        # came from the server (a request preempted after its load may hit its own loaded blocks on the GPU)
        assert b.stats.gpu_hit_tokens + b.stats.cpu_hit_tokens == 4 * 6 * 6 and b.stats.cpu_hit_tokens >= 4 * 6 * 5
        assert all(w.tier_ios["remote"].counters.corrupt_blocks == 0 and w.tier_ios["remote"].counters.errors == 0 for w in b.workers)
        outputs = b.outputs
    assert outputs == reference_outputs(wl_b)


def test_different_models_never_share_blocks(redis_server) -> None:  # noqa: F811
    shared = prefixes(4, 4)
    with FakeEngine(remote_config(redis_server.url)) as a:
        run_workload(a, one_per_prefix("a", shared, 5))
    other = remote_config(redis_server.url)
    other.engine.head_dim = 8  # another layout: other keys
    with FakeEngine(other) as b:
        run_workload(b, one_per_prefix("b", shared, 6))
        clean(b)
        assert b.stats.cpu_hit_tokens == 0 and b.connector.tiers["remote"].counters.lookup_hit_blocks == 0


def test_remote_off_by_default_connects_nowhere() -> None:
    with FakeEngine(small_config()) as engine:
        assert engine.connector.tiers == {} and engine.worker.tier_ios == {}


def test_reset_cache_turns_the_tier_off_for_this_instance(redis_server) -> None:  # noqa: F811
    shared = prefixes(9, 4)
    with FakeEngine(remote_config(redis_server.url)) as a:
        run_workload(a, one_per_prefix("a", shared, 1))
    with FakeEngine(remote_config(redis_server.url)) as b:
        # vLLM resets the cache after a weight update: the server's KV may be the old weights'
        assert b.connector.reset_cache()
        keys = int(redis_server.cli("DBSIZE"))
        run_workload(b, one_per_prefix("b", shared, 2))
        clean(b)
        assert b.stats.cpu_hit_tokens == 0 and b.connector.tiers["remote"].counters.lookups == 0
        assert int(redis_server.cli("DBSIZE")) == keys  # nothing written either


@pytest.mark.parametrize("tp", [1, 2])
def test_write_back_on_cpu_evict_shares_what_the_cpu_tier_evicted(redis_server, tp) -> None:  # noqa: F811
    shared = prefixes(11, 8)
    wl_a, wl_b = one_per_prefix("a", shared, 1), one_per_prefix("b", shared, 2)
    # 1. engine A: only blocks its CPU tier evicts are written (write-back)
    # (a CPU tier of 15 blocks: the first prefixes are evicted by the later ones)
    with FakeEngine(remote_config(redis_server.url, 16, write="on_cpu_evict"), tp_size=tp) as a:
        run_workload(a, wl_a)
        clean(a)
        evicted, written = a.connector.stats.num_cpu_evictions, worker_counter(a, "written_blocks")
        assert 0 < written == tp * evicted < tp * a.connector.stats.num_stored_blocks
    # 2. engine B: hits on the evicted prefixes from the server, every block verified
    with FakeEngine(remote_config(redis_server.url, write="on_cpu_evict"), tp_size=tp) as b:
        run_workload(b, wl_b)
        clean(b)
        assert b.stats.cpu_hit_tokens > 0 and worker_counter(b, "corrupt_blocks") == 0
        assert worker_counter(b, "fetched_blocks") == tp * b.connector.tiers["remote"].counters.lookup_hit_blocks
        outputs = b.outputs
    assert outputs == reference_outputs(wl_b)


def test_two_engines_share_a_redis_cluster(redis_cluster) -> None:  # noqa: F811
    urls = [n.url for n in redis_cluster]
    shared = prefixes(13, 6)
    with FakeEngine(remote_config(urls)) as a:
        run_workload(a, one_per_prefix("a", shared, 1))
        clean(a)
        written, heads = worker_counter(a, "written_blocks"), a.config.engine.num_kv_heads  # a record per head
        assert written > 0 and sum(int(n.cli("DBSIZE")) for n in redis_cluster) == written * heads
        assert all(int(n.cli("DBSIZE")) > 0 for n in redis_cluster)  # the blocks spread over the masters
    with FakeEngine(remote_config(urls)) as b:
        wl = one_per_prefix("b", shared, 2)
        run_workload(b, wl)
        clean(b)
        assert b.stats.cpu_hit_tokens > 0 and worker_counter(b, "errors") == 0
        outputs = b.outputs
    assert outputs == reference_outputs(wl)
