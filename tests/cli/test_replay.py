"""`offload-connector replay`: the CLI, its JSON report, overrides, errors and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_connector.cli.main import main
from offload_connector.cli.replay import replay_config, run_replay
from offload_connector.cli.trace import bundled_trace_path, read_trace
from scheduler_side import OffloadScheduler

REQUIRED = ("requests", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens", "computed_prompt_tokens",
            "bytes_stored", "bytes_loaded", "integrity_errors", "leaked_blocks", "steps")


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main(["replay", "--json", "--quiet", *args])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    return out


@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_scaled_replay_json_has_the_contract_keys_and_cpu_hits(capsys: pytest.CaptureFixture[str],
                                                               policy: str) -> None:
    out = run_json(capsys, "--scaled", "--limit", "600", "--gpu-blocks", "300", "--cpu-blocks", "600",
                   "--store-policy", policy)
    for key in REQUIRED:
        assert key in out
    assert out["requests"] == 600 and out["store_policy"] == policy
    assert out["gpu_blocks"] == 300 and out["cpu_blocks"] == 600
    assert out["integrity_errors"] == 0 and out["leaked_blocks"] == 0
    assert out["cpu_hit_tokens"] > 0 and out["bytes_loaded"] > 0
    assert out["prompt_tokens"] == out["gpu_hit_tokens"] + out["cpu_hit_tokens"] + out["computed_prompt_tokens"]


def test_lazy_arc_one_at_a_time_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--scaled", "--limit", "300", "--gpu-blocks", "200", "--cpu-blocks", "300",
                   "--store-policy", "lazy", "--eviction", "arc", "--max-num-seqs", "1")
    assert out["eviction"] == "arc" and out["max_num_seqs"] == 1 and out["store_policy"] == "lazy"
    assert out["integrity_errors"] == 0 and out["leaked_blocks"] == 0 and out["cpu_hit_tokens"] > 0
    assert out["steps"] >= out["requests"]  # one request at a time: at least a step each


def test_unscaled_replay_of_a_few_requests(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--full-size", "--limit", "3")
    assert out["requests"] == 3 and out["scaled"] is False
    first = read_trace(bundled_trace_path(), limit=3)
    assert out["prompt_tokens"] == sum(r.input_length for r in first)


def test_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--quiet", "--scaled", "--limit", "50"]) == 0
    text = capsys.readouterr().out
    assert "hit ratio" in text and "CPU hit" in text and "leaked blocks" in text and "CPU evictions" in text


def test_config_file_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store_policy: lazy\nengine:\n  num_gpu_blocks: 100\n  block_size: 8\n")
    config = replay_config(cfg, cpu_blocks=50)
    assert config.store_policy == "lazy" and config.engine.block_size == 8
    assert config.engine.num_gpu_blocks == 100 and config.num_cpu_blocks == 50
    assert replay_config(cfg, gpu_blocks=64, store_policy="eager").engine.num_gpu_blocks == 64
    over = replay_config(cfg, eviction="arc", max_num_seqs=1)
    assert over.eviction == "arc" and over.engine.max_num_seqs == 1 and over.engine.block_size == 8


def test_bad_config_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  block_sise: 8\n")
    assert main(["replay", "--config", str(cfg), "--quiet"]) == 2
    assert "engine.block_sise" in capsys.readouterr().err


def test_malformed_trace_exits_2_with_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]}\n{"oops": 1}\n')
    assert main(["replay", "--trace", str(trace), "--quiet"]) == 2
    assert "t.jsonl:2" in capsys.readouterr().err


def test_plot_writes_a_png_or_explains_the_missing_extra(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "hits.png"
    code = main(["replay", "--quiet", "--scaled", "--limit", "100", "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "--plot needs matplotlib (the [plot] extra): pip install matplotlib" in capsys.readouterr().err
        return
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_run_replay_reports_the_error_instead_of_raising() -> None:
    config = replay_config(None, gpu_blocks=64, cpu_blocks=64)
    result = run_replay(config, read_trace(bundled_trace_path(), limit=20), scaled=True)
    assert result.error is None and result.to_dict()["integrity_errors"] == 0


def test_default_replay_shows_cpu_hits(capsys: pytest.CaptureFixture[str]) -> None:
    """The no-argument run: the bundled trace, scaled, GPU 5% / CPU 10% of its distinct blocks."""
    assert main(["replay", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3993 and out["scaled"] is True
    assert (out["gpu_blocks"], out["cpu_blocks"]) == (2196, 4392)
    connector = out["connector"]  # the connector's own counters, as vLLM's stats get them
    assert connector["num_hit_tokens"] == out["cpu_hit_tokens"]
    assert connector["bytes_stored"] == out["bytes_stored"] and connector["num_stored_blocks"] > 0
    assert out["cpu_hit_tokens"] > 0.05 * out["prompt_tokens"]  # the CPU tier visibly matters
    assert out["integrity_errors"] == 0 and out["leaked_blocks"] == 0


def test_the_readme_shows_what_the_default_replay_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41: the README (and the docs) printed 31.7% / 17.5% while the replay gave 31.8% / 17.6%. Every
    line the README shows of `offload-connector replay` is a line the replay prints."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("$ offload-connector replay\n", 1)[1].split("```", 1)[0]
    shown = [line for line in block.splitlines() if line.strip() not in ("", "...")]
    assert main(["replay", "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(shown) >= 6 and [line for line in shown if line not in printed] == []


def test_eager_with_room_to_spare_loses_no_evicted_block() -> None:
    """Eager stores every computed block before the GPU can evict it: with a CPU tier that never fills, no
    evicted GPU block is lost from both tiers (the measure lazy is judged by)."""
    config = replay_config(None, gpu_blocks=300, cpu_blocks=20_000, store_policy="eager")
    out = run_replay(config, read_trace(bundled_trace_path(), limit=300), scaled=True).to_dict()
    assert out["gpu_evictions"] > 0 and out["gpu_evictions_unsaved"] == 0
    assert out["integrity_errors"] == 0 and out["leaked_blocks"] == 0


def test_help_shows_plain_percent_signs_and_version_is_there(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from offload_connector.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "5% and 10%" in " ".join(text.split()) and "%%" not in text
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"offload-connector {version('offload-connector')}"


def replay_exit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["replay", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_config_file_keeps_the_bundled_sizes_unless_it_sets_them(tmp_path, capsys) -> None:
    """Issue 12 item 4: a YAML with only store_policy/eviction ran on 1,024 GPU / 4,194,304 CPU blocks."""
    path = tmp_path / "offload.yaml"
    path.write_text("store_policy: lazy\neviction: arc\n")
    out = run_json(capsys, "--config", str(path), "--limit", "50")
    assert (out["gpu_blocks"], out["cpu_blocks"]) == (2196, 4392) and out["store_policy"] == "lazy"
    # Issue 41: each pool's own share ("5% / 10%" on both read as if each pool were both).
    assert out["sizes_from"] == {"gpu_blocks": "the bundled trace's default (5% of its distinct blocks)",
                                 "cpu_blocks": "the bundled trace's default (10% of its distinct blocks)"}
    path.write_text("num_cpu_blocks: 999\n")
    out = run_json(capsys, "--config", str(path), "--limit", "50", "--gpu-blocks", "3000")
    assert (out["gpu_blocks"], out["cpu_blocks"]) == (3000, 999)
    assert out["sizes_from"] == {"gpu_blocks": "--gpu-blocks", "cpu_blocks": f"config file {path}"}


@pytest.mark.parametrize("args", [
    ("--cpu-blocks", str(1 << 40)),  # HostPoolError: larger than the machine
    ("--gpu-blocks", str(1 << 40)),  # the fake GPU KV cache would not fit
    ("--full-size", "--scaled"),  # conflicting flags
    ("--full-size", "--trace", "agentic"),
    ("--session-close-delay", "-1"),
    ("--session-close-delay", "nan"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, args) -> None:
    """Issue 12 items 5 and 11: these were tracebacks with exit 1, or accepted silently."""
    code, _, err = replay_exit(capsys, "--limit", "5", *args)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_two_gpu_blocks_is_not_a_layout_error(capsys) -> None:
    """The fake engine's (2, blocks, ...) tensors were ambiguous with 2 blocks; it now names its layout.
    Every request is then too long for the pool: a warning, not silence."""
    code, _, err = replay_exit(capsys, "--limit", "5", "--gpu-blocks", "2")
    assert code == 0 and "every request was rejected" in err


def test_hash_ids_beyond_64_bits_and_empty_traces(tmp_path, capsys) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [18446744073709551616]}\n')
    code, _, err = replay_exit(capsys, "--trace", str(path))
    assert code == 2 and "hash_ids" in err and "2**64" in err
    path.write_text("")
    code, _, err = replay_exit(capsys, "--trace", str(path))
    assert code == 0 and "holds no request" in err


def test_a_closed_pipe_is_quiet() -> None:
    """`offload-connector replay | head -1`: a BrokenPipeError traceback used to follow."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "offload_connector.cli.main", "replay", "--quiet", "--limit", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the replay prints anything: its writes hit a pipe with no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err, err


def test_the_bundled_agentic_trace_by_name_closes_its_sessions(capsys) -> None:
    out = run_json(capsys, "--trace", "agentic", "--limit", "120", "--store-policy", "lazy")
    assert (out["gpu_blocks"], out["cpu_blocks"]) == (2658, 5316) and out["scaled"] is True
    assert out["connector"]["num_closed_sessions"] > 0 and out["connector"]["num_bad_hints"] == 0
    off = run_json(capsys, "--trace", "agentic", "--limit", "120", "--store-policy", "lazy", "--no-session-close")
    assert off["connector"]["num_closed_sessions"] == 0


def test_a_broken_gzip_trace_is_one_error_line(tmp_path, capsys) -> None:
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(b"\x1f\x8b not really gzip")
    code, _, err = replay_exit(capsys, "--trace", str(path))
    assert code == 2 and err.startswith("error: ") and "cannot read" in err


def test_a_byte_size_cpu_bytes_does_not_buy_millions_of_fake_blocks(tmp_path, capsys) -> None:
    """Issue 30 item 10: the README's `cpu_bytes: 8GiB` bought 4,194,304 of the fake model's tiny blocks
    (65% hit ratio instead of 27%). The fake engine keeps its own sizing and says so on stderr."""
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 8GiB\nstore_policy: lazy\n")
    out = run_json(capsys, "--config", str(path), "--limit", "50")
    assert out["cpu_blocks"] == 4392 and "bundled trace's default" in out["sizes_from"]["cpu_blocks"]
    assert out["sizes_from"]["cpu_bytes"].startswith("not used")
    _, err = replay_exit(capsys, "--config", str(path), "--limit", "5", "--trace", str(bundled_trace_path()))[1:]
    assert err.startswith(f"note: cpu_bytes in {path} sizes the CPU tier under vLLM, not here: the fake engine "
                          "keeps 65,536 CPU blocks, the embedded default.yaml's engine.num_cpu_blocks")
    path.write_text("cpu_bytes: 8GiB\nnum_cpu_blocks: 100\n")  # a block count in the file wins, silently
    out = run_json(capsys, "--config", str(path), "--limit", "50")
    assert out["cpu_blocks"] == 100 and "cpu_bytes" not in out["sizes_from"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("plot", "message"), [
    ("{tmp}/missing/hits.png", "--plot: cannot write '{tmp}/missing/hits.png': No such file or directory"),
    ("{tmp}", "--plot: cannot write '{tmp}': Is a directory"),
])
def test_an_unwritable_plot_fails_before_the_run(tmp_path, capsys, plot: str, message: str) -> None:
    """Issue 30 item 10: it failed after the whole run."""
    code, out, err = replay_exit(capsys, "--plot", plot.format(tmp=tmp_path))
    assert code == 2 and out == "" and err == f"error: {message.format(tmp=tmp_path)}\n"


def test_a_plot_format_matplotlib_cannot_write_fails_before_the_run(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    code, out, err = replay_exit(capsys, "--plot", str(tmp_path / "hits.pnj"))
    assert code == 2 and out == "" and err.startswith(f"error: --plot: got '{tmp_path / 'hits.pnj'}'; allowed: a file ")
    assert not (tmp_path / "hits.pnj").exists()


@pytest.mark.parametrize(("name", "hint"), [
    ("agentc", "did you mean 'agentic'? "), ("synthtic", "did you mean 'synthetic'? "), ("nothing", ""),
])
def test_a_mistyped_trace_name_suggests_the_bundled_ones(capsys, name: str, hint: str) -> None:
    code, _, err = replay_exit(capsys, "--trace", name)
    assert code == 2 and err == (f"error: --trace: got {name!r}: no such file and no bundled trace of that name; "
                                 f"{hint}allowed: a trace file, or a bundled trace: synthetic, agentic\n")


def test_check_each_step_checks_every_step_and_reports_the_same(capsys, monkeypatch) -> None:
    """`--check-each-step` runs the connector's `check_integrity` after every step (and once at the end) and
    changes nothing in the report but its time."""
    args = ("--scaled", "--limit", "150", "--gpu-blocks", "100", "--cpu-blocks", "150", "--store-policy", "lazy")
    plain = run_json(capsys, *args)
    calls = []
    check = OffloadScheduler.check_integrity
    monkeypatch.setattr(OffloadScheduler, "check_integrity", lambda self: calls.append(1) or check(self))
    checked = run_json(capsys, *args, "--check-each-step")
    assert len(calls) == checked["steps"] + 1
    for out in (plain, checked):
        del out["wall_seconds"], out["connector"]["load_seconds"], out["connector"]["store_seconds"]
    assert checked == plain
