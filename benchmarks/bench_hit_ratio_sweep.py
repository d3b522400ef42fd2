"""Hit ratio vs CPU size: `offload-connector replay` (eager and lazy) against LRU references (issue 6 §4).

Replays the bundled Mooncake synthetic trace (`--scaled`, one trace block = one engine block) through the
fake engine with the connector, the same `run_replay` the `offload-connector replay` command calls, with a
fixed GPU pool (`--gpu-blocks`, default 2,196 = 5% of the trace's 43,924 distinct blocks) and a range of
CPU sizes, for both store policies under both CPU evictions (lru, arc). Combined hit ratio = (gpu_hit_tokens + cpu_hit_tokens) / prompt_tokens.
A replay with integrity errors or leaked blocks fails the benchmark.

References (traces README: blocks hit / blocks requested, one request at a time, a request hits its longest
prefix of cached hash ids, LRU evicting tail blocks first), from a block-level simulation of the trace:
- inclusive: every block written through to the CPU; GPU + CPU behave like one LRU of max(GPU, CPU) blocks;
- exclusive: GPU evictions moved to the CPU; one LRU of GPU + CPU blocks.
The simulator must reproduce the README's table (LRU 2,196 -> 15.7%, 4,392 -> 26.2%, 6,588 -> 33.5%) or the
script stops. The `*_last` variants never count a request's last block as a hit, as the engine must
compute at least one prompt token (scaled prompts end on a block boundary).

Extra points at `--one-at-a-time-cpu`: every series one request at a time (`engine.max_num_seqs: 1`), and
the engine's own ceiling for an exclusive tier: no CPU tier and a GPU of GPU + CPU blocks, both ways.

    nice python benchmarks/bench_hit_ratio_sweep.py [--json] [--plot [FILE]] [--jobs 2] [--from-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload_connector.cli.trace import bundled_trace_path, read_trace  # noqa: E402
from offload_connector.config import default_config_dict, merge_configs  # noqa: E402

DEFAULT_GPU_BLOCKS = 2196
DEFAULT_CPU_SIZES = (2, 1098, 2196, 4392, 6588, 8784, 13176, 17568, 35136)  # 2: the smallest allowed (block 0 is null)
SERIES = (("eager", "lru"), ("lazy", "lru"), ("eager", "arc"), ("lazy", "arc"))  # (store_policy, eviction)
# traces README: (cache blocks, hit ratio); the simulator must match each to +-0.3 points.
README_REFERENCES = ((2196, 0.157), (4392, 0.262), (2196 + 4392, 0.335))
README_TOLERANCE = 0.003


class BenchmarkError(RuntimeError):
    """A replay was not clean, or the reference simulator disagrees with the traces README."""


# --- references: one-request-at-a-time block-level LRU ---

def lru_hit_ratio(requests: list[list[int]], num_blocks: int, last_block_hits: bool = True) -> float:
    """Blocks hit / blocks requested for one LRU cache of `num_blocks` blocks, one request at a time.

    A request hits its longest prefix of cached hash ids (only the first len - 1 blocks may hit when
    `last_block_hits` is False). Afterwards all its blocks become the most recently used, its head the most
    recent and its tail the least recent among them, so eviction takes tail blocks first.
    """
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    hits = total = 0
    for hash_ids in requests:
        total += len(hash_ids)
        limit = len(hash_ids) if last_block_hits else len(hash_ids) - 1
        n = 0
        while n < limit and hash_ids[n] in cache:
            n += 1
        hits += n
        if num_blocks <= 0:
            continue
        for h in reversed(hash_ids):  # tail first: the head ends most recently used
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > num_blocks:
                    cache.popitem(last=False)
    return hits / total if total else 0.0


def check_readme_references(requests: list[list[int]]) -> dict[int, float]:
    got = {size: lru_hit_ratio(requests, size) for size, _ in README_REFERENCES}
    bad = [(size, want, got[size]) for size, want in README_REFERENCES
           if abs(got[size] - want) > README_TOLERANCE]
    if bad:
        raise BenchmarkError("reference LRU simulator disagrees with the traces README: " + "; ".join(
            f"LRU {size} blocks: got {g:.1%}, README {w:.1%}" for size, w, g in bad))
    return got


class References:
    """Reference hit ratios for a GPU size and any CPU size (each LRU size simulated once)."""

    def __init__(self, requests: list[list[int]], gpu_blocks: int) -> None:
        self.requests = requests
        self.gpu_blocks = gpu_blocks
        self._memo: dict[tuple[int, bool], float] = {}

    def lru(self, num_blocks: int, last_block_hits: bool = True) -> float:
        key = (num_blocks, last_block_hits)
        if key not in self._memo:
            self._memo[key] = lru_hit_ratio(self.requests, num_blocks, last_block_hits)
        return self._memo[key]

    def at(self, cpu_blocks: int, with_last: bool = True) -> dict[str, float]:
        inclusive, exclusive = max(self.gpu_blocks, cpu_blocks), self.gpu_blocks + cpu_blocks
        out = {"cpu_blocks": cpu_blocks, "inclusive": self.lru(inclusive), "exclusive": self.lru(exclusive)}
        if with_last:
            out["inclusive_last"] = self.lru(inclusive, last_block_hits=False)
            out["exclusive_last"] = self.lru(exclusive, last_block_hits=False)
        return out


def reference_grid(cpu_sizes: list[int], gpu_blocks: int) -> list[int]:
    """CPU sizes for the smooth reference curves: linear up to half the GPU, then 8 per doubling."""
    lin = max(1, gpu_blocks // 2)
    grid = set(cpu_sizes) | set(range(0, lin, max(1, lin // 8)))
    size = float(lin)
    while size <= max(cpu_sizes):
        grid.add(round(size))
        size *= 2 ** (1 / 8)
    return sorted(grid)


# --- replays ---

def _replay_point(point: dict[str, Any]) -> dict[str, Any]:
    """One `offload-connector replay --scaled --json` run (in a worker process)."""
    import torch

    torch.set_num_threads(1)  # two workers on two shared cores
    from offload_connector.cli.replay import replay_config, run_replay

    config = replay_config(point.get("config"), gpu_blocks=point["gpu_blocks"],
                           cpu_blocks=point["cpu_blocks"], store_policy=point["policy"],
                           eviction=point["eviction"])
    trace = str(bundled_trace_path())
    result = run_replay(config, read_trace(trace), scaled=True, trace_name=trace)
    d = result.to_dict()
    prompt = d["prompt_tokens"]
    return {
        "label": point["label"],
        "policy": point["policy"],
        "eviction": point["eviction"],
        "kind": point.get("kind", "replay"),
        "gpu_blocks": d["gpu_blocks"],
        "cpu_blocks": d["cpu_blocks"],
        "max_num_seqs": config.engine.max_num_seqs,
        "hit_ratio": (d["gpu_hit_tokens"] + d["cpu_hit_tokens"]) / prompt,
        "gpu_hit_ratio": d["gpu_hit_tokens"] / prompt,
        "cpu_hit_ratio": d["cpu_hit_tokens"] / prompt,
        "prompt_tokens": prompt,
        "integrity_errors": d["integrity_errors"],
        "leaked_blocks": d["leaked_blocks"],
        "finished_requests": d["finished_requests"],
        "rejected_requests": d["rejected_requests"],
        "num_preemptions": d["num_preemptions"],
        "steps": d["steps"],
        "gpu_evictions_unsaved": d["gpu_evictions_unsaved"],
        "deferred_lookups": d["connector"].get("num_deferred_lookups", 0),
        "error": d["error"],
        "wall_seconds": d["wall_seconds"],
    }


def run_points(points: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    # Slowest first (small CPU tiers compute more; one-at-a-time runs take many steps) to pack two workers.
    order = sorted(points, key=lambda p: (p.get("config") is None, p["cpu_blocks"] if p.get("kind") != "ceiling" else 0))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(_replay_point, order))
    bad = [r for r in results if r["integrity_errors"] or r["leaked_blocks"] or r["error"]]
    if bad:
        raise BenchmarkError("replay not clean: " + "; ".join(
            f"{r['label']}: {r['integrity_errors']} integrity errors, {r['leaked_blocks']} leaked blocks, "
            f"error {r['error']!r}" for r in bad))
    return results


def one_at_a_time_config(directory: str) -> str:
    """default.yaml with `engine.max_num_seqs: 1`, written as a YAML file (what `--config` would read)."""
    import yaml

    path = os.path.join(directory, "one_at_a_time.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(merge_configs(default_config_dict(), {"engine": {"max_num_seqs": 1}}), f)
    return path


# --- output ---

def format_table(out: dict[str, Any]) -> str:
    distinct = out["distinct_blocks"]
    lines = [f"hit ratio vs CPU size: bundled Mooncake trace (scaled), GPU {out['gpu_blocks']} blocks "
             f"({out['gpu_blocks'] / distinct:.0%} of {distinct:,} distinct); combined = GPU + CPU hits",
             f"{'CPU blocks':>10} {'%dist':>6} | " + " | ".join(f"{p + '/' + e:>9}" for p, e in SERIES)
             + f" | {'incl':>6} {'excl':>6} | {'incl*':>6} {'excl*':>6}"]
    by = {(r["policy"], r["eviction"], r["cpu_blocks"]): r for r in out["replays"]}
    for row in out["references"]:
        cpu = row["cpu_blocks"]
        cells = [f"{by[(p, e, cpu)]['hit_ratio']:9.1%}" if (p, e, cpu) in by else f"{'-':>9}" for p, e in SERIES]
        lines.append(f"{cpu:>10} {cpu / distinct:6.1%} | " + " | ".join(cells) + f" | {row['inclusive']:6.1%} "
                     f"{row['exclusive']:6.1%} | {row['inclusive_last']:6.1%} {row['exclusive_last']:6.1%}")
    for r in out["one_at_a_time"]:
        lines.append(f"one request at a time (max_num_seqs 1), {r['policy']}/{r['eviction']}, CPU {r['cpu_blocks']}: "
                     f"{r['hit_ratio']:.1%} ({r['gpu_hit_ratio']:.1%} GPU + {r['cpu_hit_ratio']:.1%} CPU)")
    for r in out.get("ceilings", []):
        lines.append(f"engine ceiling of an exclusive LRU tier (GPU {r['gpu_blocks']}, no CPU tier), up to "
                     f"{r['max_num_seqs']} at once: {r['hit_ratio']:.1%}")
    lines.append("incl/excl: LRU references (README); incl*/excl*: same, a request's last block never hits")
    lines.append(f"all replays clean (0 integrity errors, 0 leaked blocks); {out['wall_seconds']:.0f} s")
    return "\n".join(lines)


def write_plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    distinct, gpu = out["distinct_blocks"], out["gpu_blocks"]
    fig, ax = plt.subplots(figsize=(9, 5.2))
    curve = out["reference_curve"]
    xs = [c["cpu_blocks"] for c in curve]
    ax.plot(xs, [c["exclusive"] for c in curve], color="#55a868", lw=1.8,
            label="exclusive reference (LRU of GPU + CPU)")
    ax.plot(xs, [c["inclusive"] for c in curve], color="#8172b2", lw=1.8,
            label="inclusive reference (LRU of max(GPU, CPU))")
    styles = {"eager": ("#4c72b0", "o"), "lazy": ("#dd8452", "s")}
    for policy, eviction in SERIES:
        rows = sorted((r for r in out["replays"] if (r["policy"], r["eviction"]) == (policy, eviction)),
                      key=lambda r: r["cpu_blocks"])
        if not rows:
            continue
        color, marker = styles[policy]
        ax.plot([r["cpu_blocks"] for r in rows], [r["hit_ratio"] for r in rows], color=color, marker=marker,
                lw=2 if eviction == "arc" else 1.2, ls="-" if eviction == "arc" else ":",
                label=f"replay, {policy}/{eviction} (up to {rows[0]['max_num_seqs']} requests at once)")
    for r in out["one_at_a_time"]:
        if r["eviction"] != "arc":
            continue
        color, marker = styles[r["policy"]]
        ax.plot([r["cpu_blocks"]], [r["hit_ratio"]], color=color, marker=marker, ms=10, mfc="none", mew=2,
                ls="none", label=f"replay, {r['policy']}/arc, one request at a time")
    ax.axhline(out["infinite_cache_hit_ratio"], color="grey", lw=1, ls="--",
               label=f"infinite cache ({out['infinite_cache_hit_ratio']:.1%})")
    # Linear below half the GPU size (the smallest CPU tier sits at the left edge), log2 above.
    ax.set_xscale("symlog", base=2, linthresh=max(1, gpu // 2), linscale=0.7)
    ax.set_xlim(0, max(xs) * 1.05)
    ticks = sorted({r["cpu_blocks"] for r in out["replays"]})
    ax.set_xticks(ticks, [f"{t:,}\n{f'{100 * t / distinct:.3g}%' if t >= distinct / 1000 else '~0%'}"
                          for t in ticks], fontsize=8)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_ylim(0, 0.7)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel(f"CPU tier: blocks and % of the trace's {distinct:,} distinct blocks (log scale)")
    ax.set_ylabel("hit ratio (GPU + CPU hits / prompt)")
    ax.grid(alpha=0.3)
    ax.set_title(f"Hit ratio vs CPU size, GPU {gpu:,} blocks ({gpu / distinct:.0%} of distinct), "
                 "bundled Mooncake trace (scaled)", fontsize=10.5)
    ax.legend(loc="upper left", fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-blocks", type=int, default=DEFAULT_GPU_BLOCKS)
    parser.add_argument("--cpu-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DEFAULT_CPU_SIZES), help="comma-separated CPU sizes in blocks (>= 2)")
    parser.add_argument("--one-at-a-time-cpu", type=int, default=4392,
                        help="CPU size of the max_num_seqs=1 point (0: skip it)")
    parser.add_argument("--jobs", type=int, default=2, choices=[1, 2], help="parallel replays (at most 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", nargs="?", const=str(ROOT / "docs" / "hit_ratio_vs_cpu.png"), metavar="FILE",
                        help="write the PNG (default file: docs/hit_ratio_vs_cpu.png)")
    parser.add_argument("--from-json", metavar="FILE", help="reuse the --json output of an earlier run (no replays)")
    args = parser.parse_args()
    if args.from_json:
        out = json.loads(Path(args.from_json).read_text())
        if args.plot:
            write_plot(out, args.plot)
        print(json.dumps(out, sort_keys=True) if args.json else format_table(out))
        return 0
    if any(c < 2 for c in args.cpu_sizes):
        parser.error(f"--cpu-sizes: got {args.cpu_sizes}; allowed: ints >= 2")

    start = time.perf_counter()
    requests = [r.hash_ids for r in read_trace(str(bundled_trace_path()))]
    readme = check_readme_references(requests)
    distinct = len({h for ids in requests for h in ids})
    gpu = args.gpu_blocks
    refs = References(requests, gpu)
    curve = [refs.at(c, with_last=False) for c in reference_grid(args.cpu_sizes, gpu)]
    with tempfile.TemporaryDirectory() as tmp:
        points = [{"label": f"{p}/{e} cpu={c}", "policy": p, "eviction": e, "gpu_blocks": gpu, "cpu_blocks": c}
                  for p, e in SERIES for c in args.cpu_sizes]
        if args.one_at_a_time_cpu:
            cfg, cpu1 = one_at_a_time_config(tmp), args.one_at_a_time_cpu
            points += [{"label": f"{p}/{e} cpu={cpu1} max_num_seqs=1", "policy": p, "eviction": e,
                        "gpu_blocks": gpu, "cpu_blocks": cpu1, "config": cfg} for p, e in SERIES]
            points += [{"label": f"ceiling gpu={gpu + cpu1}{' max_num_seqs=1' if c else ''}", "policy": "eager",
                        "eviction": "lru", "kind": "ceiling", "gpu_blocks": gpu + cpu1, "cpu_blocks": 2,
                        "config": c} for c in (None, cfg)]
        results = run_points(points, args.jobs)
    out: dict[str, Any] = {
        "trace": str(bundled_trace_path()),
        "scaled": True,
        "gpu_blocks": gpu,
        "distinct_blocks": distinct,
        "blocks_requested": sum(len(r) for r in requests),
        "infinite_cache_hit_ratio": lru_hit_ratio(requests, distinct),
        "readme_check": {str(k): v for k, v in readme.items()},
        "replays": sorted((r for r in results if r["max_num_seqs"] != 1 and r["kind"] == "replay"),
                          key=lambda r: (r["policy"], r["eviction"], r["cpu_blocks"])),
        "one_at_a_time": [r for r in results if r["max_num_seqs"] == 1 and r["kind"] == "replay"],
        "ceilings": [r for r in results if r["kind"] == "ceiling"],
        "references": [refs.at(c) for c in args.cpu_sizes],
        "reference_curve": curve,
        "wall_seconds": time.perf_counter() - start,
    }
    if args.plot:
        write_plot(out, args.plot)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(format_table(out))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
