"""Connector overhead in vLLM's real `Scheduler`: no connector vs vLLM's SimpleCPUOffloadConnector vs ours.

The same request stream goes through the three variants (benchmarks/vllm_sim.py: each connector's
worker completions are faked the way its real worker reports them, so both CPU caches fill and hit).
Timed per step: `Scheduler.schedule()` + `update_from_output()`, i.e. the scheduler process's work,
after `--warmup-steps` untimed steps. Headline: ours_vs_simple = (ours - none) / (simple - none), the
connector overhead above no connector, ours divided by Simple's (goal <= 0.5). `--simple-lazy` runs Simple
with its `lazy_offload` mode instead: each step it walks on along the GPU free queue from where it stopped,
about twice the per-step token budget in blocks, and stores the cached blocks it passes that the CPU lacks.
`--like-with-like` runs five variants in one lockstep run: none, both connectors in their default store mode
(Simple eager, ours lazy) and in their other one (`simple_lazy`, `ours_eager`); its JSON adds
`like_with_like`: per mode, ours' overhead over Simple's (`ratio`, goals: lazy <= 1.0, eager <= 0.5) and both
hit token counts (GPU + CPU hits).

Workload (defaults; about 97 requests running): requests arrive at `--rate` per step; each prompt is
one of `--prefixes` shared prefixes of `--prefix-blocks` blocks (Zipf-like popularity) + 1-4 unique
blocks + a partial block, and decodes 16-64 tokens. The GPU pool (`--gpu-blocks`) is too small to keep every prefix cached, so
prefixes are evicted from the GPU and come back from the CPU tier (`--cpu-blocks`, the same for both).

`--workload hit-heavy` (issue 6 §4, the hit-heavy case): 256 shared prefixes, a GPU pool that keeps few of
them and a CPU tier that keeps them all, so that CPU hits are >= 15 % of prompt tokens (about 26 %). Its
JSON adds `prompt_tokens` and `cpu_hit_share` (cpu_hit_tokens / prompt_tokens) per variant. Explicit flags
override a preset's values.

Also measured (issue 6 §2): steps from admission (load issued) to first compute for a CPU-hit request,
alone in an idle engine (`*_steps_to_first_compute`, and `*_async_steps_to_first_compute` with vLLM's
AsyncScheduler and two batches in flight, the default of vLLM's GPU builds) and over the workload
(mean / max).

    python benchmarks/bench_scheduler.py [--workload default|hit-heavy] [--json] [--breakdown] [--repeats N]
                                         [--profile ours|simple|none] [--store-policy eager|lazy] [--simple-lazy]
                                         [--like-with-like]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]

from vllm_sim import OTHER_MODES, REMOTE_VARIANT, VARIANTS, SimShape, VllmSim, instrument_connector  # noqa: E402

# Preset workloads: argparse defaults that explicit flags override. "default" is the flags' own defaults.
WORKLOADS: dict[str, dict] = {
    "default": {},
    # 256 shared prefixes (2048 blocks) against 1200 GPU blocks, most of them held by ~95 running requests, so
    # few prefixes stay on the GPU; the CPU tier (8192 blocks) keeps them all next to the suffixes it stores.
    # CPU hits: ~26 % of prompt tokens (default workload: ~6 %), no preemptions. A flatter popularity
    # (--zipf 0.6) gives ~35 % but preempts.
    "hit-heavy": {"prefixes": 256, "cpu_blocks": 8192},
}


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int
    req_id: str
    tokens: list[int]
    max_tokens: int


def make_workload(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)
    bs = args.block_size
    prefixes = [[rng.randrange(3, 1024) for _ in range(args.prefix_blocks * bs)] for _ in range(args.prefixes)]
    weights = [1 / (i + 1) ** args.zipf for i in range(args.prefixes)]
    arrivals = []
    for i in range(args.requests):
        prefix = rng.choices(prefixes, weights)[0]
        suffix = [rng.randrange(3, 1024) for _ in range(rng.randint(1, 4) * bs + rng.randrange(bs))]
        arrivals.append(Arrival(int(i / args.rate), f"r{i}", prefix + suffix, rng.randint(16, 64)))
    return arrivals


def shape_of(args: argparse.Namespace) -> SimShape:
    return SimShape(num_gpu_blocks=args.gpu_blocks, num_cpu_blocks=args.cpu_blocks, block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=2048, remote_url=getattr(args, "remote_url", None),
                    store_policy=getattr(args, "store_policy", None), simple_lazy=getattr(args, "simple_lazy", False))


class Feed:
    """One variant's copy of the request stream: adds each arrival once its step has come."""

    def __init__(self, sim: VllmSim, arrivals: list[Arrival]) -> None:
        self.sim, self._arrivals, self._next = sim, arrivals, 0

    @property
    def done(self) -> bool:
        return self._next == len(self._arrivals) and not self.sim.busy

    def admit(self) -> None:
        while self._next < len(self._arrivals) and self._arrivals[self._next].step <= self.sim.step_no:
            a = self._arrivals[self._next]
            self.sim.add(a.req_id, a.tokens, a.max_tokens)
            self._next += 1


def run_lockstep(arrivals: list[Arrival], args: argparse.Namespace,
                 profile: tuple[str, cProfile.Profile] | None = None, breakdown: bool = False) -> dict[str, dict]:
    """All three variants step by step in turn (rotating order), so machine noise hits them alike.

    The garbage collector is off while stepping and runs, untimed, every 50 steps: one variant's garbage
    must not be collected inside another's timed step.
    """
    variants = (VARIANTS + ((REMOTE_VARIANT,) if getattr(args, "remote_url", None) else ())
                + (OTHER_MODES if getattr(args, "like_with_like", False) else ()))
    feeds = {v: Feed(VllmSim(v, shape_of(args), store_delay=args.store_delay), arrivals) for v in variants}
    timed_steps = dict.fromkeys(variants, 0)
    hooks = {v: instrument_connector(f.sim) for v, f in feeds.items()} if breakdown else {}
    gc.collect()
    gc.disable()
    try:
        rnd = 0
        while not all(f.done for f in feeds.values()):
            rnd += 1
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for v in order:
                f = feeds[v]
                if f.done:
                    continue
                f.admit()
                if f.sim.step_no == args.warmup_steps:
                    f.sim.cpu_seconds = f.sim.wall_seconds = 0.0
                    for name in hooks.get(v, ()):
                        hooks[v][name] = 0.0
                prof = profile[1] if profile and profile[0] == v and f.sim.step_no >= args.warmup_steps else None
                if prof is not None:
                    prof.enable()
                f.sim.step()
                if prof is not None:
                    prof.disable()
                timed_steps[v] += f.sim.step_no > args.warmup_steps
            if rnd % 50 == 0:
                gc.collect()
    finally:
        gc.enable()
    results = {v: summarize(f.sim, arrivals, timed_steps[v]) for v, f in feeds.items()}
    for v, f in feeds.items():
        offload = getattr(f.sim.sched.connector, "offload", None)  # ours only
        remote = offload.tiers.get("remote") if offload is not None else None
        if remote is not None:  # the lookup thread's CPU time is the scheduler process's too
            results[v]["lookup_thread_us_per_step"] = round(remote.lookups.cpu_seconds / max(1, f.sim.step_no) * 1e6, 1)
            results[v]["remote"] = remote.counters.snapshot()
            remote.close()
    for v, spent in hooks.items():
        if feeds[v].sim.sched.connector is not None:
            results[v]["hook_us_per_step"] = {k: round(x / max(1, timed_steps[v]) * 1e6, 1)
                                              for k, x in spent.items()}
    return results


def summarize(sim: VllmSim, arrivals: list[Arrival], timed_steps: int) -> dict:
    bad = [a.req_id for a in arrivals
           if sim.finish_reasons.get(a.req_id) != "length" or sim.num_output_tokens.get(a.req_id) != a.max_tokens]
    problems = sim.leaks() + ([f"{len(bad)} requests without exactly max_tokens outputs (e.g. {bad[:3]})"]
                              if bad else [])
    # Every prompt token and every decoded token but the last is computed once or comes from a cache.
    expected = sum(len(a.tokens) + a.max_tokens - 1 for a in arrivals)
    accounted = sim.num_scheduled_tokens + sim.gpu_hit_tokens + sim.connector_hit_tokens
    if not sim.num_preempted and accounted != expected:
        problems.append(f"computed + GPU-hit + CPU-hit tokens = {accounted}, expected {expected}")
    t = sim.worker.transfers
    if sim.connector_hit_tokens != t.loaded_blocks * sim.shape.block_size:
        problems.append(f"vLLM counted {sim.connector_hit_tokens} CPU-hit tokens, {t.loaded_blocks} blocks were loaded")
    waits = sim.load_waits
    return {
        "us_per_step": round(sim.cpu_seconds / max(1, timed_steps) * 1e6, 1),
        "wall_us_per_step": round(sim.wall_seconds / max(1, timed_steps) * 1e6, 1),
        "steps": sim.step_no,
        "timed_steps": timed_steps,
        "scheduled_tokens": sim.num_scheduled_tokens,
        "gpu_hit_tokens": sim.gpu_hit_tokens,
        "cpu_hit_tokens": sim.connector_hit_tokens,
        "stored_blocks": t.stored_blocks,
        "loaded_blocks": t.loaded_blocks,
        "load_requests": t.num_load_requests,
        "preemptions": sim.num_preempted,
        "steps_to_first_compute_mean": round(sum(waits) / len(waits), 2) if waits else None,
        "steps_to_first_compute_max": max(waits) if waits else None,
        "problems": problems,
    }


def steps_to_first_compute(variant: str, async_scheduling: bool = False) -> int:
    """A alone, then C evicts A's blocks from the GPU, then B (A's 3-block prefix) hits the CPU tier."""
    sim = VllmSim(variant, SimShape(num_gpu_blocks=6, num_cpu_blocks=32, max_num_seqs=4,
                                    max_num_batched_tokens=64, max_model_len=1024,
                                    async_scheduling=async_scheduling))

    def toks(seed: int, n: int) -> list[int]:
        return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]

    prefix = toks(1, 48)
    for req_id, tokens in (("A", prefix + toks(2, 16)), ("C", toks(3, 64)), ("B", prefix + toks(4, 16))):
        sim.add(req_id, tokens, 1)
        sim.drain()
    if sim.connector_hit_tokens != 48 or len(sim.load_waits) != 1:
        raise RuntimeError(f"{variant}: B got no 48-token CPU hit (hit tokens {sim.connector_hit_tokens})")
    return sim.load_waits[0]


def hotspots(profiler: cProfile.Profile, top: int, timed_steps: int) -> str:
    """pstats' top functions by own time, then the connectors' functions by cumulative time per timed step."""
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    ours = [(key, row) for key, row in stats.stats.items()  # type: ignore[attr-defined]
            if any(m in key[0] for m in ("offload_connector", "scheduler_side", "simple_kv_offload"))]
    ours.sort(key=lambda kr: -kr[1][3])
    n = max(1, timed_steps)
    buf.write(f"connector functions, per timed step ({n} steps; cProfile inflates every time):\n"
              f"{'cum us':>9} {'own us':>8} {'calls':>7}  function\n")
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in ours[:top]:
        where = "/".join(Path(filename).parts[-2:])
        buf.write(f"{cumtime / n * 1e6:9.1f} {tottime / n * 1e6:8.1f} {ncalls / n:7.2f}  {where}:{line}({func})\n")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=WORKLOADS, default="default",
                   help="preset of the flags below (explicit flags override it)")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--rate", type=float, default=2.5, help="arrivals per step")
    p.add_argument("--prefixes", type=int, default=64)
    p.add_argument("--prefix-blocks", type=int, default=8)
    p.add_argument("--zipf", type=float, default=0.8, help="prefix i is drawn with weight 1 / (i + 1) ** zipf")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=1200)
    p.add_argument("--cpu-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--store-delay", type=int, default=1, help="steps until a store is reported (both)")
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1, help="lockstep runs; each variant's lowest us/step kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", choices=VARIANTS + OTHER_MODES,
                   help="cProfile the timed steps of this variant (extra run)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--breakdown", action="store_true",
                   help="extra run timing each connector hook (CPU us/step per hook, both connectors)")
    p.add_argument("--store-policy", choices=("eager", "lazy"),
                   help="ours' store_policy (default: unset, the default configuration's)")
    p.add_argument("--simple-lazy", action="store_true",
                   help="run Simple with its lazy_offload mode (a cursor along the GPU free queue) instead of its "
                        "default (every computed block); the idle-engine steps-to-first-compute stay Simple's default")
    p.add_argument("--like-with-like", action="store_true",
                   help="also run Simple's lazy_offload (simple_lazy) and ours with store_policy eager (ours_eager), "
                        "and compare each mode with the same mode of the other connector")
    p.add_argument("--json", action="store_true")
    p.add_argument("--remote", action="store_true",
                   help="also run ours with the remote tier on (a throwaway redis-server on a loopback port)")
    p.set_defaults(**WORKLOADS[p.parse_known_args(argv)[0].workload])
    args = p.parse_args(argv)
    if args.like_with_like and (args.store_policy or args.simple_lazy):
        p.error("--like-with-like runs both store modes of both connectors: drop --store-policy and --simple-lazy")

    arrivals = make_workload(args)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    server = None
    if args.remote:
        from bench_fleet import Server

        server = Server(tempfile.mkdtemp())
        args.remote_url = server.url
    try:
        for _ in range(args.repeats):
            if server is not None:
                server.client.flushall()  # each repeat starts from an empty tier
            for variant, r in run_lockstep(arrivals, args).items():
                if variant not in results or r["us_per_step"] < results[variant]["us_per_step"]:
                    results[variant] = r
    finally:
        if server is not None:
            server.stop()
    none, simple, ours = (results[v]["us_per_step"] for v in ("none", "simple", "ours"))
    hidden = {"json", "profile", "profile_top", "breakdown", "remote", "remote_url"}
    if args.store_policy is None:  # the default configuration's: the JSON keeps its keys
        hidden.add("store_policy")
    if not args.simple_lazy:
        hidden.add("simple_lazy")
    if not args.like_with_like:
        hidden.add("like_with_like")
    if args.workload == "default":  # the default JSON keeps its keys
        hidden |= {"workload", "zipf"}
    else:
        prompt_tokens = sum(len(a.tokens) for a in arrivals)
        for r in results.values():
            r["prompt_tokens"] = prompt_tokens
            r["cpu_hit_share"] = round(r["cpu_hit_tokens"] / prompt_tokens, 4)
    out = {
        "ours_us_per_step": ours,
        "simple_us_per_step": simple,
        "none_us_per_step": none,
        "ours_overhead_us": round(ours - none, 1),
        "simple_overhead_us": round(simple - none, 1),
        "ours_vs_simple": round((ours - none) / (simple - none), 3) if simple != none else None,
        "ours_steps_to_first_compute": steps_to_first_compute("ours"),
        "simple_steps_to_first_compute": steps_to_first_compute("simple"),
        "ours_async_steps_to_first_compute": steps_to_first_compute("ours", async_scheduling=True),
        "simple_async_steps_to_first_compute": steps_to_first_compute("simple", async_scheduling=True),
        "variants": results,
        "workload": {k: v for k, v in vars(args).items() if k not in hidden},
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    if args.like_with_like:
        out["like_with_like"] = {mode: like_with_like(results, ours, simple)
                                 for mode, ours, simple in (("lazy", "ours", "simple_lazy"), ("eager", "ours_eager", "simple"))}
    if args.remote:  # the tier's cost: scheduler thread, and with the lookup thread's CPU time added
        remote = results[REMOTE_VARIANT]
        out["remote_us_per_step"] = remote["us_per_step"]
        out["remote_vs_ours"] = round(remote["us_per_step"] / ours, 3)
        out["remote_with_lookup_thread_vs_ours"] = round(
            (remote["us_per_step"] + remote["lookup_thread_us_per_step"]) / ours, 3)
    profile_text = None
    if args.profile:
        profiler = cProfile.Profile()
        profiled = run_lockstep(arrivals, args, (args.profile, profiler))
        profile_text = hotspots(profiler, args.profile_top, profiled[args.profile]["timed_steps"])
    if args.breakdown:
        timed = run_lockstep(arrivals, args, breakdown=True)
        out["hook_us_per_step"] = {v: timed[v]["hook_us_per_step"] for v in timed if "hook_us_per_step" in timed[v]}
        # The rest of a connector's overhead in that run: vLLM's own work for a connector (the same for any
        # connector) and what a connector's decisions change in vLLM's (hits, loads, preemptions).
        base = timed["none"]["us_per_step"]
        out["outside_hooks_us_per_step"] = {v: round(timed[v]["us_per_step"] - base - sum(hooks.values()), 1)
                                            for v, hooks in out["hook_us_per_step"].items()}
    ok = not any(r["problems"] for r in results.values())
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_readable(out)
    if profile_text:
        print(profile_text, file=sys.stderr if args.json else sys.stdout)
    return 0 if ok else 1


def like_with_like(results: dict[str, dict], ours: str, simple: str) -> dict:
    """Ours in one store mode against Simple in the same mode, from one lockstep run: overheads above no
    connector, their ratio, and the tokens each served from a cache (GPU hits + CPU hits)."""
    none = results["none"]["us_per_step"]
    ours_over, simple_over = results[ours]["us_per_step"] - none, results[simple]["us_per_step"] - none
    hits = {v: results[v]["gpu_hit_tokens"] + results[v]["cpu_hit_tokens"] for v in (ours, simple)}
    return {"ours": ours, "simple": simple, "ours_overhead_us": round(ours_over, 1),
            "simple_overhead_us": round(simple_over, 1),
            "ratio": round(ours_over / simple_over, 3) if simple_over > 0 else None,
            "ours_hit_tokens": hits[ours], "simple_hit_tokens": hits[simple]}


def print_readable(out: dict) -> None:
    w = out["workload"]
    print(f"vLLM Scheduler, {w.get('workload', 'default')} workload: {w['requests']} requests at {w['rate']}/step, {w['prefixes']} shared prefixes of "
          f"{w['prefix_blocks']} blocks (zipf {w.get('zipf', 0.8)}), GPU {w['gpu_blocks']} blocks, CPU {w['cpu_blocks']} blocks "
          f"(block size {w['block_size']}), max_num_seqs {w['max_num_seqs']}, warm-up {w['warmup_steps']} steps")
    cols = {"us_per_step": "CPU us/step", "wall_us_per_step": "wall us/step", "steps": "steps", "scheduled_tokens": "sched tok",
            "gpu_hit_tokens": "GPU-hit tok", "cpu_hit_tokens": "CPU-hit tok", "stored_blocks": "stored blk",
            "loaded_blocks": "loaded blk", "preemptions": "preempt", "steps_to_first_compute_mean": "1st-compute",
            "steps_to_first_compute_max": "(max)", "cpu_hit_share": "CPU-hit share"}
    print(f"{'':12}" + "".join(f"{h:>13}" for h in cols.values()))
    for variant, r in out["variants"].items():
        print(f"{variant:12}" + "".join(f"{'-' if r.get(c) is None else r[c]:>13}" for c in cols))
        for problem in r["problems"]:
            print(f"  PROBLEM ({variant}): {problem}")
    simple = "Simple (lazy_offload)" if w.get("simple_lazy") else "Simple"
    print(f"connector overhead per step: ours {out['ours_overhead_us']} us, {simple} {out['simple_overhead_us']} us"
          f" -> ours_vs_simple = {out['ours_vs_simple']} (goal <= 0.5)")
    print(f"steps from admission to first compute (CPU hit, idle engine): ours "
          f"{out['ours_steps_to_first_compute']}, Simple {out['simple_steps_to_first_compute']}; async scheduling "
          f"(2 batches in flight): ours {out['ours_async_steps_to_first_compute']}, "
          f"Simple {out['simple_async_steps_to_first_compute']}")
    for mode, row in out.get("like_with_like", {}).items():
        print(f"{mode}: {row['ours']} overhead {row['ours_overhead_us']} us vs {row['simple']} {row['simple_overhead_us']} us "
              f"-> ratio {row['ratio']} (goal <= {1.0 if mode == 'lazy' else 0.5}); hit tokens {row['ours_hit_tokens']} vs "
              f"{row['simple_hit_tokens']}")
    for variant, hooks in out.get("hook_us_per_step", {}).items():
        total = round(sum(hooks.values()), 1)
        print(f"{variant} hooks, CPU us/step (total {total}): "
              + ", ".join(f"{k} {x}" for k, x in hooks.items() if x))
    print(f"wall time {out['wall_seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
