"""scripts/soak.py: the suite's own randomized checks, run longer; it must still find them and report failures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def soak(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=600)


def test_the_soak_runs_a_state_machine_and_a_property_of_the_suite_and_passes():
    done = soak("--scale", "1", "--seed", "3", "--only", "disk_index,hybrid")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "disk_index: ok" in done.stdout and "hybrid: ok" in done.stdout
    assert done.stdout.rstrip().endswith("every check passed")


def test_an_unknown_check_is_refused_naming_the_allowed_ones():
    done = soak("--only", "nope")
    assert done.returncode == 2
    assert "--only nope: allowed scheduler, remote, arc, disk_index, integrity, hybrid" in done.stderr


def test_a_failing_property_is_reported_with_the_arguments_that_reproduce_it(capsys):
    spec = importlib.util.spec_from_file_location("soak_script", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = []

    def inner(seed: int) -> None:
        seen.append(seed)
        assert seed % 7, f"seed {seed}"

    with pytest.raises(AssertionError):
        module.run_property("sevens", inner, lambda rng: {"seed": rng.randint(0, 1000)}, 10_000, seed=1)
    assert seen[-1] % 7 == 0 and all(s % 7 for s in seen[:-1])
    assert f"sevens: failed with {{'seed': {seen[-1]}}}" in capsys.readouterr().out
