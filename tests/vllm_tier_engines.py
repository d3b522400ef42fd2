"""Prompts and the engine runner shared by the remote and disk tiers' vLLM end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "vllm_remote_engine.py"


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
