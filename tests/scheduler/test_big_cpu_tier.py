"""A CPU tier far larger than the working set keeps every prefix, under either store policy (fake engine).

Story (one request at a time, block size 4, 16 GPU blocks, 4,096 CPU blocks): three prefixes of 6 blocks,
each reused three times with a one-off prompt of 6 blocks after every request, so every prefix leaves
the GPU between its uses and must come back from the CPU. The tier never fills: no CPU block is evicted,
and lazy hits every reused prefix token, as eager does. A CPU copy given up after a load (lazy keeps it
until the tier fills) goes before older content, never ahead of the tier's empty blocks.
"""

from __future__ import annotations

import pytest

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import small_config

BS = 4
PREFIXES = [[1000 * p + i for i in range(6 * BS)] for p in range(1, 4)]


def one_off(n: int) -> list[int]:
    return [50_000 + 100 * n + i for i in range(6 * BS)]


def run(store_policy: str, eviction: str) -> dict[str, int]:
    """Hit tokens of the prefixes' reuses, and the connector's CPU evictions."""
    config = small_config(num_gpu_blocks=16, num_cpu_blocks=4096, store_policy=store_policy, eviction=eviction,
                          max_num_seqs=1)
    hit = wanted = 0
    with FakeEngine(config) as engine:
        for rnd in range(3):
            for p, prefix in enumerate(PREFIXES):
                before = engine.stats.gpu_hit_tokens + engine.stats.cpu_hit_tokens
                engine.add_request(f"p{p}-{rnd}", prefix + [7, 7, 7, 7 + rnd], 1)
                engine.run()
                if rnd:
                    hit += engine.stats.gpu_hit_tokens + engine.stats.cpu_hit_tokens - before
                    wanted += len(prefix)
                engine.add_request(f"o{p}-{rnd}", one_off(3 * rnd + p), 1)
                engine.run()
        engine.drain()
        assert engine.check() == 0
        connector = engine.connector
        assert connector is not None
        return {"hit": hit, "wanted": wanted, "cpu_evictions": connector.stats.num_cpu_evictions,
                "cpu_hit_tokens": engine.stats.cpu_hit_tokens}


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_a_tier_larger_than_the_working_set_keeps_every_prefix(eviction: str) -> None:
    eager, lazy = run("eager", eviction), run("lazy", eviction)
    assert eager["cpu_evictions"] == 0 and lazy["cpu_evictions"] == 0
    assert eager["hit"] == eager["wanted"] == 6 * 24  # each prefix's 2 reuses x 3 prefixes x 24 tokens
    assert lazy["hit"] >= eager["hit"]
    assert lazy["cpu_hit_tokens"] > 0  # the prefixes did come back from the CPU tier
