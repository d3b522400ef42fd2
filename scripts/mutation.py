"""Mutation testing of scheduler_side/ and worker_side/ with mutmut (docs/mutation.md). Not part of CI.

    python scripts/mutation.py                   # every target, fresh: worker, cudasim, scheduler
    python scripts/mutation.py worker            # one target (worker | cudasim | scheduler), fresh
    python scripts/mutation.py worker --again    # after adding tests: rerun only what was not killed
    python scripts/mutation.py worker --report   # print the last run's score and survivors again
    python scripts/mutation.py cudasim --only 'worker_side.backends.cuda.fences.*'   # just these mutants
    python scripts/mutation.py scheduler --planted  # the target's hand-written mutants (must all be killed)

A *target* is a set of files to mutate and the fast tests that may kill them; mutmut then runs, for each
mutant, only the selected tests that call the mutated function. The targets:
- `worker`: worker_side/ on the CPU path (the worker, the CPU backend, copy plans, layouts, the host pool);
- `cudasim`: the CUDA backend and its argument ring, exercised on the simulated device (`-m cudasim`;
  the first chunk of each randomized replay test only: the others repeat it with more seeds);
- `scheduler`: all of scheduler_side/.
Never mutated: worker_side/backends/cuda/runtime.py (the real CUDA runtime: no test reaches it without a GPU) and the
test doubles (cuda_sim.py, sim_memory.py, sim_streams.py, faults.py).

mutmut works in ./mutants/; each target's results are kept in ./mutants-TARGET/ between runs (renamed to
mutants/ while it runs; `mutmut show NAME` needs that name too). A run ends with the score:
killed / (mutants - equivalent). Killed counts mutants whose tests failed, timed out or crashed. A surviving
mutant is *equivalent* when it changes no behaviour: either only the text of an exception or log message
(recognised here from the two functions' syntax trees), or a mutant listed with its reason in
scripts/mutation_equivalents.toml (matched by function and mutated line, so it survives renumbering).
Anything else is printed with its diff: kill it with a test, or explain it in that file. `--again` keeps
the verdicts of killed mutants, so quote scores from a fresh run or from `--again` on unchanged sources.

*Planted* mutants (scripts/mutation_planted.toml) are bugs written by hand, for changes mutmut's operators do
not make (a `==` widened to `>=`, a check left out): `--planted` applies each, one at a time, to a scratch
copy of the checkout and runs the target's tests there, stopping at the first failure. Each must be killed
(exit status 1 otherwise); an entry whose original text is no longer in its file is refused as stale.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.toml"
PLANTED = ROOT / "scripts" / "mutation_planted.toml"
SCRATCH_COPY = ("scheduler_side", "worker_side", "offload_connector", "tests", "pyproject.toml")  # what tests need
FAST = "not vllm and not gpu and not soak"


@dataclass(frozen=True)
class Target:
    mutate: tuple[str, ...]  # glob patterns of files to mutate
    tests: tuple[str, ...]  # glob patterns of test files to select from
    description: str
    deselect: tuple[str, ...] = ()  # test ids left out: slow repeats of what a kept test already covers


TARGETS = {
    "worker": Target(
        mutate=("worker_side/worker.py", "worker_side/load_reads.py", "worker_side/backends/cpu.py",
                "worker_side/copy_plan.py",
                "worker_side/block_layout.py", "worker_side/host_pool.py", "worker_side/host_memory.py",
                "worker_side/backends/select.py", "worker_side/backends/base.py", "worker_side/errors.py"),
        tests=("tests/worker/test_*.py", "tests/engine/test_integrity.py", "tests/engine/test_fake_engine.py",
               "tests/engine/test_fake_engine_scenarios.py"),
        description="worker_side/ on the CPU path"),
    "cudasim": Target(
        mutate=("worker_side/backends/cuda/*.py",),
        tests=("tests/cuda_path/test_*.py",),
        description="worker_side/ CUDA backend on the simulated device",
        # The randomized replays run 240 + 60 seeds (about 25 s of the target's 36 s per mutant): keep the
        # first chunk of each (30 and 20 seeds); without this a fresh run takes hours on 2 cores.
        deselect=(*(f"tests/cuda_path/test_cudasim.py::test_replays_under_adversarial_schedules[{i}]" for i in range(1, 8)),
                  *(f"tests/cuda_path/test_cudasim.py::test_tensor_parallel_replays_two_simulated_gpus[{i}]" for i in (1, 2)))),
    "scheduler": Target(
        mutate=("scheduler_side/*.py", "scheduler_side/*/*.py", "scheduler_side/*/*/*.py"),
        tests=("tests/scheduler/test_*.py", "tests/engine/test_integrity.py", "tests/engine/test_fake_engine.py",
               "tests/engine/test_fake_engine_scenarios.py", "tests/remote/test_remote_scheduler.py",
               "tests/remote/test_remote_state_machine.py", "tests/remote/test_remote_client.py",
               "tests/remote/test_remote_fake_engine.py", "tests/remote/test_remote_lookup_thread.py",
               "tests/tiers/test_*.py"),
        description="scheduler_side/"),
}

KILLED = {"killed", "timeout", "segfault", "caught by type check"}


# ---- running mutmut -------------------------------------------------------------------------------------
def selected_tests(target: Target) -> list[str]:
    """The target's test files; every pattern must match one at least (a test file renamed or merged away
    would otherwise drop its tests from the run without a word)."""
    files: set[str] = set()
    for pattern in target.tests:
        matched = glob.glob(pattern, root_dir=ROOT)
        if not matched:
            raise SystemExit(f"no test file matches {pattern!r}: update the target's tests in {Path(__file__).name}")
        files.update(matched)
    return sorted(files)


def run_mutmut(name: str, mutants: list[str]) -> int:
    """In this process: mutmut's own configuration (pyproject.toml [tool.mutmut]) with the target's files and
    tests, then `mutmut run` (of `mutants` only, when given). mutmut reads one configuration per project;
    the targets differ only here."""
    import mutmut.configuration as mutmut_config

    target = TARGETS[name]
    cfg = mutmut_config._load_config()
    cfg.only_mutate = list(target.mutate)
    deselect = [arg for test in target.deselect for arg in ("--deselect", test)]
    cfg.pytest_add_cli_args_test_selection = [*selected_tests(target), "-m", FAST, *deselect]
    mutmut_config._config = cfg
    from mutmut.__main__ import cli  # reads the configuration at import

    try:
        cli.main(["run", *mutants], standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@contextlib.contextmanager
def read_only_view(name: str) -> Iterator[None]:
    """Work in a scratch folder whose mutants/ is a link to mutants-NAME/ (another target may be running)."""
    kept = ROOT / f"mutants-{name}"
    if not kept.exists():
        raise SystemExit(f"no results for {name} ({kept} is missing): run it first")
    with tempfile.TemporaryDirectory() as scratch:
        os.symlink(kept, Path(scratch) / "mutants")
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(ROOT)


@contextlib.contextmanager
def workspace(name: str, fresh: bool) -> Iterator[None]:
    """mutants-NAME/ renamed to mutants/ (where mutmut works) for the duration."""
    work, kept = ROOT / "mutants", ROOT / f"mutants-{name}"
    if work.exists():
        raise SystemExit(f"{work} exists: another run is in progress, or one was interrupted (delete it)")
    if fresh:
        shutil.rmtree(kept, ignore_errors=True)
    if kept.exists():
        kept.rename(work)
    try:
        yield
    finally:
        if work.exists():
            work.rename(kept)


# ---- reading results ------------------------------------------------------------------------------------
@dataclass
class Summary:
    total: int = 0
    killed: int = 0
    not_run: int = 0  # mutants no run has tested yet (after --only): not in total
    equivalent: list[tuple[str, str, str]] = field(default_factory=list)  # (mutant, diff, why)
    survived: list[tuple[str, str, str]] = field(default_factory=list)  # (mutant, diff, status)

    @property
    def score(self) -> float:
        counted = self.total - len(self.equivalent)
        return 100.0 * self.killed / counted if counted else 100.0


def mutant_functions(mutant: str, path: str) -> tuple[str, str]:
    """The original and the mutated function's source."""
    from mutmut.mutation.diff_apply import (
        read_functions_from_index,
        read_mutant_function,
        read_mutants_module,
        read_original_function,
    )

    functions = read_functions_from_index(mutant, path)
    if functions is None:
        module = read_mutants_module(path)
        functions = (read_original_function(module, mutant), read_mutant_function(module, mutant))
    import libcst as cst

    return tuple(cst.Module([f]).code for f in functions)  # type: ignore[return-value]


def _parse(source: str) -> ast.AST:
    import textwrap

    return ast.parse(textwrap.dedent(source))


Path_ = tuple[tuple[ast.AST, str], ...]  # (node, field) from the root down to where the trees differ


def _differences(a: ast.AST, b: ast.AST, path: Path_ = ()) -> list[Path_]:
    """The paths (in `a`) to the smallest places where the syntax trees `a` and `b` differ."""
    if type(a) is not type(b):
        return [path]
    out: list[Path_] = []
    for name, va in ast.iter_fields(a):
        vb, here = getattr(b, name, None), path + ((a, name),)
        if isinstance(va, ast.AST) and isinstance(vb, ast.AST):
            out += _differences(va, vb, here)
        elif isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            for x, y in zip(va, vb, strict=True):
                if isinstance(x, ast.AST) and isinstance(y, ast.AST):
                    out += _differences(x, y, here)
                elif x != y:
                    out.append(here)
        elif va != vb:
            out.append(here)
    return out


def _is_message_call(call: ast.AST, parent: ast.AST) -> bool:
    """An exception being raised, or a call on a logger."""
    if not isinstance(call, ast.Call):
        return False
    if isinstance(parent, ast.Raise) and parent.exc is call:
        return True
    func = call.func
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id in ("logger", "logging", "log"))


def only_message_text(orig: str, mutant: str) -> bool:
    """True when the mutant changes only the arguments of a raised exception or of a logger call: the
    message a person reads, never what the code does."""
    diffs = _differences(_parse(orig), _parse(mutant))
    return bool(diffs) and all(
        any(field in ("args", "keywords") and _is_message_call(node, path[i - 1][0])
            for i, (node, field) in enumerate(path) if i > 0)
        for path in diffs)


def changed_lines(diff: str) -> str:
    return "\n".join(line[1:].strip() for line in diff.splitlines()
                     if line.startswith("+") and not line.startswith("+++"))


def load_equivalents() -> list[dict]:
    if not EQUIVALENTS.exists():
        return []
    return tomllib.loads(EQUIVALENTS.read_text())["equivalent"]


def listed_equivalent(mutant: str, diff: str, equivalents: list[dict]) -> str | None:
    function = mutant.rsplit("__mutmut_", 1)[0]
    added = changed_lines(diff)
    for e in equivalents:
        if e["function"] == function and e["mutant"].strip() == added:
            return e["why"]
    return None


def summarize(name: str) -> Summary:
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    target, summary, equivalents = TARGETS[name], Summary(), load_equivalents()
    for pattern in target.mutate:
        for path in sorted(glob.glob(pattern, root_dir=ROOT)):
            meta = Path("mutants") / (path + ".meta")
            if not path.endswith(".py") or not meta.exists():
                continue
            for mutant, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                status = status_by_exit_code[code]
                if status == "not checked":
                    summary.not_run += 1
                    continue
                summary.total += 1
                if status in KILLED:
                    summary.killed += 1
                    continue
                diff = get_diff_for_mutant(mutant, path=path)
                why = listed_equivalent(mutant, diff, equivalents)
                if why is None and only_message_text(*mutant_functions(mutant, path)):
                    why = "message text"
                if why is not None:
                    summary.equivalent.append((mutant, diff, why))
                else:
                    summary.survived.append((mutant, diff, status))
    return summary


def report(name: str, show_equivalent: bool) -> Summary:
    s = summarize(name)
    print(f"\n== {name}: {TARGETS[name].description}")
    if show_equivalent:
        for mutant, diff, why in s.equivalent:
            print(f"\n-- equivalent ({why}): {mutant}\n{diff}")
    for mutant, diff, status in s.survived:
        print(f"\n-- {status}: {mutant}\n{diff}")
    message = sum(why == "message text" for _, _, why in s.equivalent)
    print(f"\n{name}: {s.killed} killed of {s.total} mutants; {len(s.equivalent)} equivalent ({message} message "
          f"text, {len(s.equivalent) - message} listed in {EQUIVALENTS.relative_to(ROOT)}); "
          f"{len(s.survived)} not killed; score {s.killed} / {s.total - len(s.equivalent)} = {s.score:.1f}%"
          + (f"; {s.not_run} mutants not run yet (a run with --only)" if s.not_run else ""))
    return s


def not_killed(name: str) -> list[str]:
    from mutmut.stats import status_by_exit_code

    out = []
    for pattern in TARGETS[name].mutate:
        for path in sorted(glob.glob(pattern, root_dir=ROOT)):
            meta = Path("mutants") / (path + ".meta")
            if meta.exists():
                codes = json.loads(meta.read_text())["exit_code_by_key"]
                out += [m for m, code in codes.items() if status_by_exit_code[code] not in KILLED | {"not checked"}]
    return out


# ---- planted mutants ------------------------------------------------------------------------------------
def load_planted(name: str) -> list[dict]:
    """The target's planted mutants; each names a file the target mutates."""
    entries = [e for e in tomllib.loads(PLANTED.read_text())["planted"] if e["target"] == name]
    patterns = TARGETS[name].mutate
    for e in entries:
        if not any(fnmatch.fnmatch(e["file"], pattern) for pattern in patterns):
            raise SystemExit(f"planted mutant {e['name']!r}: {e['file']} is not a file of target {name} "
                             f"(it mutates {', '.join(patterns)})")
    return entries


def run_planted_mutant(name: str, entry: dict) -> str | None:
    """Apply one planted mutant to a scratch copy of this checkout and run the target's tests there, up to
    the first failure: the first failing test's id (killed), or None (survived)."""
    target = TARGETS[name]
    with tempfile.TemporaryDirectory() as scratch:
        for part in SCRATCH_COPY:
            src, dst = ROOT / part, Path(scratch) / part
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
            else:
                shutil.copy2(src, dst)
        path = Path(scratch) / entry["file"]
        text = path.read_text()
        if text.count(entry["original"]) != 1:
            raise SystemExit(f"planted mutant {entry['name']!r}: {entry['original']!r} is not in {entry['file']} "
                             "exactly once (stale: update scripts/mutation_planted.toml)")
        path.write_text(text.replace(entry["original"], entry["mutant"]))
        deselect = [arg for test in target.deselect for arg in ("--deselect", test)]
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", "-m", FAST,
               *selected_tests(target), *deselect]
        proc = subprocess.run(cmd, cwd=scratch, env=dict(os.environ, PYTHONPATH=scratch), capture_output=True,
                              text=True, check=False)
    if proc.returncode == 0:
        return None
    failed = [line[len("FAILED "):].split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    if proc.returncode != 1 or not failed:
        raise SystemExit(f"planted mutant {entry['name']!r}: pytest exited {proc.returncode} without a failing "
                         f"test:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return failed[0]


def run_planted(name: str) -> int:
    """Every planted mutant of the target; the number not killed."""
    entries = load_planted(name)
    survived = 0
    for entry in entries:
        start = time.monotonic()
        killer = run_planted_mutant(name, entry)
        verdict = f"killed by {killer}" if killer else "NOT KILLED"
        print(f"{name} planted {entry['name']}: {verdict} ({time.monotonic() - start:.0f} s)\n"
              f"    {entry['file']}: {entry['original']!r} -> {entry['mutant']!r}")
        survived += killer is None
    print(f"{name}: {len(entries) - survived} of {len(entries)} planted mutants killed")
    return survived


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"any of {', '.join(TARGETS)} (default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--again", action="store_true", help="rerun only the mutants the last run did not kill")
    mode.add_argument("--report", action="store_true", help="only print the last run's score and survivors")
    mode.add_argument("--only", nargs="+", metavar="PATTERN",
                      help="run only the mutants whose names match (fnmatch), keeping the other results")
    mode.add_argument("--planted", action="store_true",
                      help="run the target's hand-written mutants (scripts/mutation_planted.toml) instead")
    parser.add_argument("--show-equivalent", action="store_true", help="also print the equivalent mutants")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mutants", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.child:
        return run_mutmut(args.child, args.mutants)
    targets = args.targets or ["worker", "cudasim", "scheduler"]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {unknown}; allowed: {', '.join(TARGETS)}")
    if args.planted:
        return 1 if sum(run_planted(name) for name in targets) else 0
    if args.report:
        for name in targets:
            with read_only_view(name):
                report(name, args.show_equivalent)
        return 0
    lines = []
    for name in targets:
        with workspace(name, fresh=not (args.again or args.only)):
            again = not_killed(name) if args.again else list(args.only or [])
            if args.again and not again:
                print(f"{name}: nothing to rerun (no previous run, or every mutant was killed)")
                continue
            start = time.monotonic()
            # a fresh interpreter per target: mutmut keeps its configuration and state in globals
            rc = subprocess.call([sys.executable, __file__, "--child", name,
                                  *(["--mutants", *again] if again else [])])
            minutes = (time.monotonic() - start) / 60
            if rc != 0:
                print(f"mutmut run for {name} failed (exit {rc})")
                return rc
            s = report(name, args.show_equivalent)
        lines.append(f"{name}: {s.killed} / {s.total - len(s.equivalent)} = {s.score:.1f}% "
                     f"({len(s.survived)} not killed, {len(s.equivalent)} equivalent) in {minutes:.0f} min")
    if lines:
        print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
