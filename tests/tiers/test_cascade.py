"""Two lower tiers at once: the CPU tier asks them nearest first, each at most once per request.

The in-memory tier (tests/memory_tier.py, registered nearest) holds the first half of each prefix, the
real Redis tier (a redis-server on loopback) all of it. A second engine's request misses on its CPU tier
at block 0: the memory tier fetches blocks 0-2; its next lookup hits them and misses at block 3, which the
memory tier was asked about already, so the Redis tier fetches 3-5. Every block read is verified by the
fake model; outputs equal an engine's without any connector.
"""

from __future__ import annotations

import pytest
from memory_tier import STORES, registered, with_memory
from redis_servers import redis_server  # noqa: F401 - fixture
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs, remote_config

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload
from offload_connector.hashing import hash_request_tokens, with_group_id

pytest.importorskip("redis", reason="the remote tier's client needs the `redis` package")


def test_a_miss_goes_to_the_nearest_tier_first_then_the_next(redis_server) -> None:  # noqa: F811
    shared = prefixes(21, 4)
    wl_b = one_per_prefix("b", shared, 8)
    with registered(nearest=True):
        config = with_memory(remote_config(redis_server.url), "cascade")
        # 1. engine A computes the prefixes: each stored block is written to both tiers
        with FakeEngine(config) as a:
            run_workload(a, one_per_prefix("a", shared, 7))
            clean(a)
        # 2. the memory tier keeps only the first three blocks of each prefix
        bs = config.engine.block_size
        tail = {with_group_id(h, 0) for p in shared for h in hash_request_tokens(p, bs)[3:6]}
        records = STORES["cascade"].records
        for key in [k for k in records if k[-1] in tail]:
            del records[key]
        # 3. engine B: blocks 0-2 come from the memory tier, 3-5 from the server
        with FakeEngine(config) as b:
            run_workload(b, wl_b)
            clean(b)
            memory, remote = b.connector.tiers["memory"], b.connector.tiers["remote"]
            assert list(b.connector.tiers) == ["memory", "remote"]
            assert memory.counts["hit_blocks"] == 3 * 4 and memory.counts["failed_blocks"] == 0
            assert remote.counters.lookup_hit_blocks == 3 * 4
            assert b.stats.gpu_hit_tokens + b.stats.cpu_hit_tokens == 6 * bs * 4
            outputs = b.outputs
    assert outputs == reference_outputs(wl_b)
