"""docs/vllm.md, "Try it on the test model", run as written: every figure the walkthrough prints comes from
this run (issue 41: the page printed 192 hit tokens where the documented run gave 128).

The section's code blocks are read from the page, not copied here: the server command, run with bash as a
user pastes it (on a free port instead of 8765, in a process group of its own); the capacity query, before
any request; the requests and the metrics query; and the `vllm.LLM` script, written to a file and run as
`python offload_demo.py` with vLLM's default multiprocessing (so its `__main__` guard matters). Each
block's output must equal the output block the page prints after it (the script's: the lines it prints
among vLLM's log lines, which go to stdout too).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.dashboard_snapshot import free_port, wait_http  # the server helpers of the dashboard's run

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "vllm.md"
SECTION = "## Try it on the test model"
DOC_PORT = "8765"
START_TIMEOUT_S = 600  # a loaded 2-core machine took up to two minutes


def walkthrough_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced code block in the section, in order."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end != -1 else len(text)]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M)]


def block_after(blocks: list[tuple[str, str]], lang: str, needle: str) -> tuple[str, str]:
    """The first `lang` block containing `needle`, and the plain output block right after it."""
    for i, (language, text) in enumerate(blocks):
        if language == lang and needle in text:
            following = blocks[i + 1] if i + 1 < len(blocks) else ("", "")
            return text, following[1] if following[0] == "" else ""
    raise AssertionError(f"{PAGE.name}, {SECTION!r}: no {lang} block containing {needle!r}")


def user_env() -> dict[str, str]:
    """The environment of a user's shell: this checkout importable, `python` this interpreter, vLLM's
    defaults (the in-process engine some tests switch on is not what users run)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):
        env.pop(name, None)  # the page's commands set what they need
    return env


def bash(script: str, env: dict[str, str]) -> str:
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_page_has_the_walkthrough_blocks() -> None:
    blocks = walkthrough_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "", "bash", "", "python", ""]
    script, _ = block_after(blocks, "python", "llm.get_metrics()")
    assert 'if __name__ == "__main__":' in script and "disable_log_stats=False" in script


def test_the_documented_server_run_prints_the_documented_figures(tmp_path: Path) -> None:
    blocks = walkthrough_blocks()
    server, _ = block_after(blocks, "bash", "vllm.entrypoints.openai.api_server")
    capacity, capacity_out = block_after(blocks, "bash", "cpu_capacity")
    requests, requests_out = block_after(blocks, "bash", "req 1; req 2; req 3; req 1")
    assert DOC_PORT in server and capacity_out and requests_out
    port, env = str(free_port()), user_env()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(["bash", "-c", server.replace(DOC_PORT, port)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S, proc)
        except (RuntimeError, TimeoutError) as err:
            raise AssertionError(f"{err}:\n{(tmp_path / 'server.log').read_text()[-4000:]}") from None
        # 1. Before any request: the capacity from the first scrape (it read 0 until the first request).
        assert bash(capacity.replace(DOC_PORT, port), env) == capacity_out
        # 2. The four requests, then the hit figures.
        assert bash(requests.replace(DOC_PORT, port), env) == requests_out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_the_documented_llm_script_prints_the_documented_figures(tmp_path: Path) -> None:
    script, expected = block_after(walkthrough_blocks(), "python", "llm.get_metrics()")
    assert expected
    path = tmp_path / "offload_demo.py"
    path.write_text(script)
    env = {**user_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}  # as the page runs it
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=START_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]
    # vLLM logs to stdout too: the script's own lines are the metric lines it prints.
    printed = [line for line in out.stdout.splitlines() if line.startswith("vllm:")]
    assert printed == expected.splitlines()
