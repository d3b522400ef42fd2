"""benchmarks/bench_scheduler.py end to end on a short hit-heavy stream: vLLM's real Scheduler with no connector,
Simple and ours, in lockstep. The benchmark's own checks (every request ends with exactly its outputs, no
block leaks, vLLM's hit tokens equal the blocks loaded) make it exit 1; these runs must exit 0."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from benchmarks import bench_scheduler  # noqa: E402

SHORT = ["--workload", "hit-heavy", "--requests", "300", "--warmup-steps", "20", "--json"]


@pytest.mark.parametrize("simple_lazy", [False, True])
def test_a_short_run_is_clean_and_names_the_simple_mode(simple_lazy: bool, capsys: pytest.CaptureFixture) -> None:
    assert bench_scheduler.main(SHORT + (["--simple-lazy"] if simple_lazy else [])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"].get("simple_lazy", False) is simple_lazy
    for variant in ("none", "simple", "ours"):
        assert out["variants"][variant]["problems"] == []
    assert out["variants"]["simple"]["cpu_hit_tokens"] > 0 and out["variants"]["ours"]["cpu_hit_tokens"] > 0



def test_like_with_like_runs_both_modes_of_both_connectors(capsys: pytest.CaptureFixture) -> None:
    assert bench_scheduler.main(SHORT + ["--like-with-like"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["variants"]) == {"none", "simple", "ours", "simple_lazy", "ours_eager"}
    assert all(r["problems"] == [] for r in out["variants"].values())
    lazy, eager = out["like_with_like"]["lazy"], out["like_with_like"]["eager"]
    assert (lazy["ours"], lazy["simple"], eager["ours"], eager["simple"]) == ("ours", "simple_lazy", "ours_eager", "simple")
    none = out["variants"]["none"]["us_per_step"]
    assert lazy["ours_overhead_us"] == round(out["variants"]["ours"]["us_per_step"] - none, 1)
    assert eager["simple_hit_tokens"] == (out["variants"]["simple"]["gpu_hit_tokens"]
                                          + out["variants"]["simple"]["cpu_hit_tokens"])


def test_the_breakdown_splits_each_connectors_overhead_into_its_hooks_and_the_rest(
        capsys: pytest.CaptureFixture) -> None:
    assert bench_scheduler.main(SHORT + ["--breakdown"]) == 0
    out = json.loads(capsys.readouterr().out)
    hooks, outside = out["hook_us_per_step"], out["outside_hooks_us_per_step"]
    assert set(hooks) == set(outside) == {"simple", "ours"}
    for variant in ("simple", "ours"):
        assert hooks[variant]["build_connector_meta"] > 0 and hooks[variant]["update_state_after_alloc"] > 0
        assert isinstance(outside[variant], float)


def test_like_with_like_refuses_a_mode_flag() -> None:
    with pytest.raises(SystemExit):
        bench_scheduler.main(SHORT + ["--like-with-like", "--simple-lazy"])
