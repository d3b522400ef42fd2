"""Replay fingerprints: the `replay --json` output of a fixed set of replays, to prove a change kept behaviour.

Each point runs `python -m offload_connector.cli replay ... --json` on a bundled trace (scaled, the first
requests only, pools small enough to evict), over every store policy, eviction policy and one request at
a time or 64, plus one hybrid-model replay and one with `branch_filter: true`. The JSON is kept as printed
except for what measures time rather than behaviour (`TIMING_KEYS`) and the trace's path (its file name
stays): two runs of the same code give the same bytes.

    python scripts/replay_fingerprints.py --write DIR [--jobs 2] [--only NAME,...] [--check-each-step]
    python scripts/replay_fingerprints.py --check DIR [--jobs 2] [--only NAME,...] [--check-each-step]

`--write` records one `NAME.json` per point; `--check` replays again and compares byte for byte, printing
a diff per differing point; exit status 1 if any differs or a replay fails. About two minutes with two jobs.
`--check-each-step` has every replay check the connector's invariants after every step (`replay
--check-each-step`: same JSON, a broken invariant fails the point); slower.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# trace -> (requests replayed, GPU blocks, CPU blocks): evictions on both tiers, CPU hits, loads, deferrals
SIZES = {"synthetic": (1500, 300, 3000), "agentic": (600, 500, 1000)}
TIMING_KEYS = ("wall_seconds", "connector.load_seconds", "connector.store_seconds")


def points() -> dict[str, list[str]]:
    """Point name -> the replay's arguments (a config file named `{branch_filter}` is written for it)."""
    out: dict[str, list[str]] = {}
    for trace, (limit, gpu, cpu) in SIZES.items():
        base = ["--trace", trace, "--scaled", "--limit", str(limit), "--gpu-blocks", str(gpu),
                "--cpu-blocks", str(cpu)]
        for policy in ("eager", "lazy"):
            for eviction in ("lru", "arc"):
                for seqs in (1, 64):
                    out[f"{trace}-{policy}-{eviction}-x{seqs}"] = base + [
                        "--store-policy", policy, "--eviction", eviction, "--max-num-seqs", str(seqs)]
        out[f"{trace}-hybrid-eager-arc-x64"] = base + ["--hybrid", "--store-policy", "eager", "--eviction", "arc",
                                                       "--max-num-seqs", "64"]
    limit, gpu, cpu = SIZES["agentic"]
    out["agentic-lazy-lru-filter-x64"] = ["--trace", "agentic", "--scaled", "--limit", str(limit), "--gpu-blocks",
                                          str(gpu), "--cpu-blocks", str(cpu), "--config", "{branch_filter}",
                                          "--store-policy", "lazy", "--max-num-seqs", "64"]
    return out


def normalize(text: str) -> str:
    """The replay's JSON without timing keys, the trace as its file name; sorted, one key per line."""
    data: dict[str, Any] = json.loads(text)
    for dotted in TIMING_KEYS:
        *path, last = dotted.split(".")
        node = data
        for name in path:
            node = node.get(name, {})
        node.pop(last, None)
    data["trace"] = Path(data["trace"]).name
    return json.dumps(data, sort_keys=True, indent=1) + "\n"


def run_point(args: list[str], filter_config: str, check_each_step: bool = False) -> str:
    cmd = [sys.executable, "-m", "offload_connector.cli", "replay", "--json", "--quiet"]
    cmd += ["--check-each-step"] if check_each_step else []
    cmd += [filter_config if a == "{branch_filter}" else a for a in args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return normalize(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="DIR", help="record the fingerprints into DIR")
    mode.add_argument("--check", metavar="DIR", help="compare with the fingerprints in DIR")
    parser.add_argument("--jobs", type=int, default=2, help="replays run at once (default 2)")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated point names (default: all)")
    parser.add_argument("--check-each-step", action="store_true",
                        help="every replay checks the connector's invariants after every step (slower)")
    args = parser.parse_args(argv)
    todo = points()
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in todo]
        if unknown:
            parser.error(f"--only: unknown points {unknown}; allowed: {', '.join(todo)}")
        todo = {n: todo[n] for n in names}
    directory = Path(args.write or args.check)
    if args.write:
        directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        filter_config = str(Path(tmp) / "branch_filter.yaml")
        Path(filter_config).write_text("branch_filter: true\n")
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {name: pool.submit(run_point, a, filter_config, args.check_each_step)
                       for name, a in todo.items()}
            bad = 0
            for name, future in futures.items():
                try:
                    got = future.result()
                except RuntimeError as exc:
                    print(f"FAIL {name}: {exc}")
                    bad += 1
                    continue
                path = directory / f"{name}.json"
                if args.write:
                    path.write_text(got)
                    print(f"wrote {path}")
                    continue
                want = path.read_text() if path.exists() else ""
                if got == want:
                    print(f"same {name}")
                else:
                    bad += 1
                    print(f"DIFF {name}")
                    sys.stdout.writelines(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                                               f"{path} (recorded)", f"{name} (now)"))
    if args.check:
        print(f"{len(todo) - bad} of {len(todo)} identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
