"""`offload-connector replay --disk-dir DIR --disk-bytes SIZE`: the disk tier in the replay, its JSON and
report, and a warm restart: a second replay on the same directory hits what the first left there."""

from __future__ import annotations

import json
import os

import pytest

from offload_connector.cli.main import main

ARGS = ("--scaled", "--limit", "400", "--gpu-blocks", "150", "--cpu-blocks", "200")


def run_json(capsys, *args: str) -> dict:  # noqa: ANN001
    code = main(["replay", "--json", "--quiet", *ARGS, *args])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["integrity_errors"] == 0 and out["leaked_blocks"] == 0
    return out


def test_without_the_tier_disk_hits_are_zero(capsys):
    out = run_json(capsys)
    assert out["disk_hit_tokens"] == 0 and "disk" not in out


def test_a_second_replay_on_the_same_directory_hits_what_the_first_wrote(tmp_path, capsys):
    disk = ("--disk-dir", str(tmp_path / "tier"), "--disk-bytes", "128MiB")  # holds every block
    cold = run_json(capsys, *disk)
    assert cold["disk"]["written_blocks"] > 0 and cold["disk"]["scanned_blocks"] == 0
    assert os.stat(tmp_path / "tier").st_mode & 0o777 == 0o700
    warm = run_json(capsys, *disk)
    # 1. the restart found the first run's records and read from them: more hits, fewer tokens computed
    assert warm["disk"]["scanned_blocks"] == cold["disk"]["records"] > 0
    assert warm["disk_hit_tokens"] > cold["disk_hit_tokens"]
    assert warm["disk_hit_tokens"] == warm["disk"]["lookup_hit_blocks"] * warm["block_size"]
    assert warm["computed_prompt_tokens"] < cold["computed_prompt_tokens"]


def test_the_report_has_a_disk_line(tmp_path, capsys):
    assert main(["replay", "--quiet", *ARGS, "--disk-dir", str(tmp_path / "tier")]) == 0
    out = capsys.readouterr().out
    assert "of it from disk" in out and "disk tier" in out and "records" in out
    assert "hit ratio" in out and "(GPU + CPU incl. disk)" in out  # issue 41: it was labelled "GPU + CPU"


@pytest.mark.parametrize("args, message", [
    (("--disk-bytes", "1GiB"), "--disk-bytes needs --disk-dir"),
    (("--disk-dir", "x", "--disk-bytes", "lots"), "'disk.bytes': got 'lots'"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, args, message):
    assert main(["replay", "--quiet", *ARGS, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_directory_others_can_write_in_is_refused(tmp_path, capsys):
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    assert main(["replay", "--quiet", *ARGS, "--disk-dir", str(tmp_path / "open")]) == 2
    assert "'disk.path'" in capsys.readouterr().err
