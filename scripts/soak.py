"""Soak: the test suite's randomized checks run far longer than CI runs them, with fresh seeds.

    python scripts/soak.py [--scale 10] [--seed N] [--only NAME,...]

Each check is one of the suite's own: its Hypothesis state machines (run with `scale` times their CI
examples and twice their steps, no example database) and its property tests of the fake engine (their
inner test called with random arguments drawn from the same ranges, `scale` x 100 times). Nothing here
re-states what a check verifies: a failure is the test's own assertion, printed with the seed and, for a
property, the arguments that reproduce it (`--seed N --only NAME`). Exit status 1 if any check failed.
About 3 minutes at `--scale 10` on two cores, in proportion above. The fake engine's long integrity soak is
`OFFLOAD_SOAK=1 python -m pytest tests/engine/test_integrity.py -k soak` (seeds from `OFFLOAD_SOAK_SEEDS`).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("tests", "tests/scheduler", "tests/remote", "tests/disk", "tests/engine"):
    sys.path.insert(0, str(ROOT / sub))

# name: (the test module that sets its CI settings, the module of the state machine, its class)
MACHINES = {
    "scheduler": ("test_scheduler_state_machine", "scheduler_machine", "SchedulerMachine"),
    "remote": ("test_remote_state_machine", "test_remote_state_machine", "RemoteMachine"),
    "arc": ("test_arc_queue", "test_arc_queue", "ArcPoolMachine"),
    "disk_index": ("test_disk_index", "test_disk_index", "IndexMachine"),
}


def integrity_args(rng: random.Random) -> dict:
    """test_integrity.test_property_any_pool_sizes_and_faults' strategy ranges."""
    return dict(seed=rng.randint(0, 10**6), gpu=rng.randint(16, 40), cpu=rng.randint(3, 40),
                policy=rng.choice(["eager", "lazy"]), fail_rate=rng.choice([0.0, 0.05, 0.3]),
                wait=rng.random() < 0.5, eviction=rng.choice(["lru", "arc"]))


def hybrid_args(rng: random.Random) -> dict:
    """test_fake_engine_hybrid.test_hybrid_any_workload_keeps_kv_intact's strategy ranges."""
    return dict(seed=rng.randint(0, 10**6), num_gpu_blocks=rng.randint(24, 48), num_cpu_blocks=rng.randint(8, 96))


# name: (module, property test, its arguments)
PROPERTIES: dict[str, tuple[str, str, Callable[[random.Random], dict]]] = {
    "integrity": ("test_integrity", "test_property_any_pool_sizes_and_faults", integrity_args),
    "hybrid": ("test_fake_engine_hybrid", "test_hybrid_any_workload_keeps_kv_intact", hybrid_args),
}


def soak_machine(name: str, scale: int, seed: int) -> None:
    import hypothesis
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    test_module, module, cls = MACHINES[name]
    __import__(test_module)  # (sets the machine's `TestCase.settings`: what CI runs)
    machine = getattr(__import__(module), cls)
    ci = machine.TestCase.settings
    config = settings(max_examples=scale * ci.max_examples, stateful_step_count=2 * ci.stateful_step_count,
                      deadline=None, suppress_health_check=list(HealthCheck), database=None)
    hypothesis.seed(seed)(lambda: run_state_machine_as_test(machine, settings=config))()


def soak_property(name: str, scale: int, seed: int) -> None:
    module, test, draw = PROPERTIES[name]
    run_property(name, getattr(__import__(module), test).hypothesis.inner_test, draw, 100 * scale, seed)


def run_property(name: str, inner: Callable[..., None], draw: Callable[[random.Random], dict], calls: int,
                 seed: int) -> None:
    """`inner(**draw(rng))` `calls` times; the first failure prints the arguments that reproduce it and raises."""
    rng = random.Random(seed)
    for _ in range(calls):
        args = draw(rng)
        try:
            inner(**args)
        except Exception:
            print(f"  {name}: failed with {args}", flush=True)
            raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=10, help="times the CI examples (properties: x100 calls)")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--only", default=None, help=f"comma-separated: {', '.join([*MACHINES, *PROPERTIES])}")
    args = parser.parse_args()
    names = [*MACHINES, *PROPERTIES]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only {','.join(unknown)}: allowed {', '.join(names)}")
        names = [n for n in names if n in wanted]
    if args.scale < 1:
        parser.error(f"--scale {args.scale}: must be at least 1")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    logging.disable(logging.WARNING)  # the checks feed repeated and late reports on purpose: their warnings
    failed = []
    for name in names:
        t0 = time.monotonic()
        print(f"{name}: seed {seed}, scale {args.scale}", flush=True)
        try:
            (soak_machine if name in MACHINES else soak_property)(name, args.scale, seed)
        except Exception as exc:
            failed.append(name)
            print(f"{name}: FAILED after {time.monotonic() - t0:.0f} s: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"{name}: ok, {time.monotonic() - t0:.0f} s", flush=True)
    print("failed: " + ", ".join(failed) if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
