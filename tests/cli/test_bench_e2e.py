"""benchmarks/bench_e2e.py's parts that decide what it measures: the workload it builds from the bundled
traces, how it reads a streamed completion and the server's metrics, the output comparison and the GPU
estimate's arithmetic (the benchmark itself runs vLLM servers for minutes: not in CI)."""

from __future__ import annotations

import io
import json

import pytest

from benchmarks.bench_e2e import (
    BLOCK,
    GPU,
    MODEL,
    StreamReader,
    assemble,
    build_workload,
    compare_outputs,
    distinct_blocks,
    gpu_estimate,
    kv_bytes_per_token,
    parse_prometheus,
    prefill_flops,
    print_table,
    summarize,
    total_params,
)


@pytest.fixture(scope="module")
def workload():
    return build_workload(seed=0, agents=2, conversations=2, turns=3, min_prompt=1024, max_prompt=3584)


def test_the_workload_is_seeded_round_robin_sessions_that_return(workload):
    assert workload == build_workload(seed=0, agents=2, conversations=2, turns=3, min_prompt=1024, max_prompt=3584)
    assert workload != build_workload(seed=1, agents=2, conversations=2, turns=3, min_prompt=1024, max_prompt=3584)
    sessions = [t.session for t in workload[:4]]
    assert len(set(sessions)) == 4 and sum(s.startswith("agent:") for s in sessions) == 2
    # round robin: turn t of every session, then turn t + 1 of every session, in the same order
    assert [(t.session, t.turn) for t in workload] == [(s, k) for k in range(3) for s in sessions]
    assert [t.returning for t in workload] == [False] * 4 + [True] * 8
    assert all(1024 <= len(t.prompt) <= 3584 and 4 <= t.max_tokens <= 16 for t in workload)
    assert all(0 <= tok < MODEL["vocab_size"] for t in workload for tok in t.prompt)
    by = {(t.session, t.turn): t.prompt for t in workload}
    for s in sessions:  # a returning turn shares its session's first blocks: the prefix the tiers can serve
        assert by[(s, 1)][:BLOCK * 8] == by[(s, 0)][:BLOCK * 8] == by[(s, 2)][:BLOCK * 8]
    firsts = {by[(s, 0)][:BLOCK] for s in sessions}
    assert len(firsts) == 4  # sessions (and the two traces' block ids) do not share blocks


def test_distinct_blocks_counts_each_prefix_once(workload):
    firsts = [t for t in workload if not t.returning]
    assert distinct_blocks(firsts) == sum(len(t.prompt) // BLOCK for t in firsts)
    assert distinct_blocks(firsts) < distinct_blocks(workload) < sum(len(t.prompt) // BLOCK for t in workload)


def test_a_streamed_completion_is_read_to_its_first_token():
    def data(obj) -> bytes:  # noqa: ANN001
        return b"data: " + json.dumps(obj).encode() + b"\n"

    reader = StreamReader()
    reader.feed(b": keep-alive\n", 0.01)
    reader.feed(b"\n", 0.02)
    reader.feed(data({"choices": [{"index": 0, "text": "", "token_ids": []}]}), 0.5)  # no token yet
    reader.feed(data({"choices": [{"index": 0, "text": "", "token_ids": [17]}]}), 1.25)
    reader.feed(data({"choices": [{"index": 0, "text": "", "token_ids": [3, 9]}]}), 1.5)
    reader.feed(data({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3,
                                               "prompt_tokens_details": {"cached_tokens": 64}}}), 1.6)
    assert not reader.done
    reader.feed(b"data: [DONE]\n", 1.7)
    assert reader.done and reader.ttft_s == 1.25 and reader.tokens == [17, 3, 9] and reader.cached_tokens == 64
    assert reader.token_times == [1.25, 1.5]
    errored = StreamReader()
    with pytest.raises(RuntimeError, match="server error"):
        errored.feed(data({"error": {"message": "boom"}}), 0.1)


def test_prometheus_samples_are_summed_over_labels():
    text = """# HELP vllm:offload_connector_disk_read_blocks_total blocks
# TYPE vllm:offload_connector_disk_read_blocks_total counter
vllm:offload_connector_disk_read_blocks_total{engine="0",model_name="m"} 12.0
vllm:offload_connector_disk_read_blocks_total{engine="1",model_name="m"} 3.0
vllm:offload_connector_cpu_hit_rate{engine="0"} 0.5
vllm:num_requests_running{engine="0"} 1.0
"""
    assert parse_prometheus(text) == {"vllm:offload_connector_disk_read_blocks_total": 15.0,
                                      "vllm:offload_connector_cpu_hit_rate": 0.5}


def test_outputs_are_compared_request_by_request():
    base = {"name": "a", "requests": [{"key": "s#0", "tokens": [1, 2]}, {"key": "s#1", "tokens": [3]}]}
    same = {"name": "b", "requests": [{"key": "s#1", "tokens": [3]}]}
    other = {"name": "c", "requests": [{"key": "s#0", "tokens": [1, 2]}, {"key": "s#1", "tokens": [4]}]}
    out = compare_outputs([base, same, other], "a")
    assert out["a"]["equal"] and out["b"] == {"equal": True, "compared": 1, "mismatches": []}
    assert out["c"] == {"equal": False, "compared": 2, "mismatches": ["s#1"]}


def test_the_gpu_estimate_charges_computed_and_loaded_tokens():
    assert 2e8 < total_params(MODEL) < 5e8  # "a few hundred million parameters"
    assert kv_bytes_per_token(MODEL) == 2 * 12 * 4 * 64 * 2
    assert prefill_flops(MODEL, 100, 100) == 0
    assert prefill_flops(MODEL, 0, 2048) == pytest.approx(prefill_flops(MODEL, 0, 1024) + prefill_flops(MODEL, 1024, 2048))
    computed = {"requests": [{"cached_tokens": 0, "prompt_tokens": 2048}], "connector": {}}
    loaded = {"requests": [{"cached_tokens": 2016, "prompt_tokens": 2048}], "connector": {}}
    from_disk = {"requests": [{"cached_tokens": 2016, "prompt_tokens": 2048}],
                 "connector": {"disk_read_bytes_total": 2016 * kv_bytes_per_token(MODEL)}}
    c, ld, d = (gpu_estimate(r, MODEL, GPU) for r in (computed, loaded, from_disk))
    assert c["copy_s"] == 0 and ld["compute_s"] < c["compute_s"] and ld["copy_s"] > 0
    assert d["disk_s"] > 0 and d["mean_ms_per_request"] > ld["mean_ms_per_request"]


def test_the_report_compares_each_run_with_its_baseline(workload):
    """Five runs as the benchmark makes them (made-up timings): ratios against the right baseline, output
    mismatches named, and the table printed."""
    def run(name: str, turns, ttft: float, cached: int, bad: str | None = None, connector=None) -> dict:  # noqa: ANN001
        requests = [{"key": t.key, "returning": t.returning, "ttft_s": ttft, "latency_s": ttft + 1.0,
                     "prompt_tokens": len(t.prompt), "cached_tokens": cached if t.returning else 0,
                     "tokens": [t.turn + (t.key == bad)] * t.max_tokens, "token_times": []} for t in turns]
        return {"name": name, "server_start_s": 1.0, "wall_s": 10.0, "requests": requests,
                "summary": summarize(requests, 10.0), "connector": connector or {}}

    returning = [t for t in workload if t.returning]
    runs = [run("no connector", workload, 4.0, 0), run("CPU tier", workload, 2.0, 1024),
            run("CPU + disk", workload, 1.0, 1024, bad=returning[0].key),
            run("restart: disk warm", returning, 0.5, 1024, connector={"disk_read_bytes_total": 1024 * 12288.0}),
            run("restart: no tier", returning, 4.0, 0)]
    out = assemble(runs, workload, {"gpu_blocks": 160, "cpu_bytes": 1 << 26},
                   {"agents": 2, "conversations": 2, "turns": 3})
    by = {r["name"]: r for r in out["runs"]}
    assert by["CPU tier"]["vs_baseline"]["ttft_p50_speedup"] == 2.0
    assert by["restart: disk warm"]["vs_baseline"]["baseline"] == "restart: no tier"
    assert by["restart: disk warm"]["vs_baseline"]["ttft_p50_speedup"] == 8.0
    assert by["restart: disk warm"]["gpu_estimate"]["disk_s"] > 0
    assert out["outputs_equal"]["CPU + disk"]["mismatches"] == [returning[0].key]
    assert out["outputs_equal"]["restart: no tier"]["equal"]
    assert all(isinstance(r["tokens"], int) and "token_times" not in r for run in out["runs"] for r in run["requests"])
    text = io.StringIO()
    print_table(out, text)
    lines = text.getvalue().splitlines()
    assert sum(" DIFFER " in line for line in lines) == 1 and sum(" equal " in line for line in lines) == 4
    assert any("estimate" in line and "not a measurement" in line for line in lines)
    sources = [row["configuration"] for row in out["returning_ttft_by_source"]]
    assert sources == ["CPU tier", "restart: disk warm", "no connector", "restart: no tier"]  # (no GPU-cache run)
    assert lines[-4].split()[:2] == ["CPU", "tier"] and "0.50 /  0.50 s" in lines[-3]


def test_rounds_give_medians_and_decode_against_the_same_rounds_baseline(workload):
    """Three alternated rounds: each connector run's decode is divided by its own round's "no connector"
    run, the report gives each configuration's medians, and a later round's output mismatch is named."""
    def run(name: str, round_no: int, ttft: float, decode: float, tokens: int = 1) -> dict:
        requests = [{"key": t.key, "returning": t.returning, "ttft_s": ttft, "latency_s": ttft + 1.0,
                     "prompt_tokens": len(t.prompt), "cached_tokens": 0, "tokens": [tokens] * t.max_tokens}
                    for t in workload]
        summary = summarize(requests, 10.0)
        summary["decode_probe_s_per_token"] = decode
        return {"name": name, "round": round_no, "requests": requests, "summary": summary, "connector": {}}

    runs = []
    for r, (base, ours) in enumerate([(0.10, 0.105), (0.20, 0.19), (0.10, 0.30)]):  # round 3 is noisy
        runs += [run("no connector", r, 4.0 + r, base), run("GPU prefix cache", r, 0.2, base),
                 run("CPU tier", r, 0.5 + r, ours, tokens=1 + (r == 2))]
    out = assemble(runs, workload, {"gpu_blocks": 160, "cpu_bytes": 1 << 26},
                   {"agents": 2, "conversations": 2, "turns": 3})
    cpu = out["medians"]["CPU tier"]
    assert cpu["rounds"] == 3 and cpu["ttft_returning_p50"] == 1.5 and cpu["decode_ratio"] == pytest.approx(1.05)
    assert out["medians"]["no connector"]["decode_ratio"] is None
    assert [row["source"] for row in out["returning_ttft_by_source"]][:2] == ["GPU prefix cache (the limit)",
                                                                             "CPU tier"]
    assert out["outputs_equal"]["GPU prefix cache"]["equal"] and out["outputs_equal"]["no connector"]["compared"] == 36
    assert out["outputs_equal"]["CPU tier"]["mismatches"] == [f"r3:{t.key}" for t in workload]
