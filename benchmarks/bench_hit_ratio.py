"""Hit ratio per bundled trace and CPU-tier policy, against the engine's exclusive ceiling and Belady's MIN.

For each bundled trace (`synthetic`, `agentic`), scaled, GPU 5% of its distinct blocks and a CPU tier of
each `--cpu-sizes` fraction of them (default 0.1: 10%; 10 and 100 give tiers 10x and 100x the trace), one
request at a time (`max_num_seqs: 1`) and 64 at once, this replays (the same `run_replay` as
`offload-connector replay`):
- `ceiling`: the engine's exclusive ceiling: a GPU of GPU + CPU blocks and no CPU tier;
- `eager`, `lazy`, `arc` (lazy with `eviction: arc`), `eager+arc`: `branch_filter: false`, no session closes;
- `lazy+filter`: lazy with the superseded-branch filter (`branch_filter: true`), no session closes;
- `lazy+filter+close` (traces with sessions): the same, each session closed after its last request.
Every replay must end with 0 integrity errors and 0 leaked blocks, or the script fails.

References, computed here over the flattened block stream of the trace (one request at a time, a cache of
GPU + CPU blocks; hit ratio in prompt tokens as the engine counts it: full blocks only, a request's hit
capped to leave one prompt token to compute):
- `min`: Belady's MIN with bypass (evict, or do not admit, the block used furthest in the future; exact for
  prefix hits, since a block's prefix is always used before it);
- `lru`: one LRU cache (the trace README's exclusive reference);
- `lru_close` (traces with sessions): the session close in the model of the study that proposed it, two
  exclusive LRU tiers of GPU and CPU blocks (`lru_close_reference`).
`gap closed` = (replay - ceiling) / (min - ceiling) with the ceiling of the same concurrency;
`lru gap closed` = (replay - lru) / (min - lru);
`vs ceiling` = replay / ceiling.

    nice python benchmarks/bench_hit_ratio.py [--traces synthetic,agentic] [--cpu-sizes 0.1,10,100]
                                              [--series ...] [--concurrency 1,64] [--jobs 2] [--json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload_connector.cli.main import BUNDLED_SIZES  # noqa: E402
from offload_connector.cli.trace import TRACE_BLOCK_TOKENS, TraceRequest, bundled_trace_path, read_trace  # noqa: E402
from offload_connector.config import default_config_dict, merge_configs  # noqa: E402

BLOCK_SIZE = 16  # the default engine's block size (scaled: one trace block = 16 tokens)
# name -> (store_policy, eviction, branch_filter, session_close)
SERIES = {
    "ceiling": ("eager", "lru", False, False),
    "eager": ("eager", "lru", False, False),
    "lazy": ("lazy", "lru", False, False),
    "lazy+filter": ("lazy", "lru", True, False),
    "lazy+filter+close": ("lazy", "lru", True, True),
    "arc": ("lazy", "arc", False, False),
    "eager+arc": ("eager", "arc", False, False),
}
CONCURRENCY = (1, 64)


class BenchmarkError(RuntimeError):
    """A replay was not clean."""


# --- references over the flattened block stream -------------------------------------------------

def _stream(requests: list[TraceRequest]) -> tuple[list[list[int]], list[int], list[int]]:
    """Per request: its full blocks (hash ids), how many may hit, and its scaled prompt tokens."""
    from offload_connector.cli.trace import prompt_length

    blocks, limits, tokens = [], [], []
    for req in requests:
        n_tokens = prompt_length(req, BLOCK_SIZE, True)
        blocks.append(req.hash_ids[:req.input_length // TRACE_BLOCK_TOKENS])
        limits.append((n_tokens - 1) // BLOCK_SIZE)
        tokens.append(n_tokens)
    return blocks, limits, tokens


def lru_reference(requests: list[TraceRequest], capacity: int) -> float:
    """One LRU cache of `capacity` blocks: a request hits its longest cached prefix, then all its blocks
    become most recent, its head the most recent (tails evicted first)."""
    blocks, limits, tokens = _stream(requests)
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for ids, limit in zip(blocks, limits, strict=True):
        n = 0
        while n < min(limit, len(ids)) and ids[n] in cache:
            n += 1
        hit += n * BLOCK_SIZE
        for h in reversed(ids):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hit / sum(tokens)


def lru_close_reference(requests: list[TraceRequest], gpu_blocks: int, cpu_blocks: int) -> float:
    """The session close in the model of the study that proposed it: two exclusive LRU tiers (a GPU of
    `gpu_blocks`, its evictions going to the most recent end of a CPU of `cpu_blocks`; a CPU hit moves the
    block back), and after a session's last request the CPU blocks only that session used go to the CPU's
    eviction end (oldest use nearest it) while its blocks the GPU evicts later are not admitted; a block
    used again is live again. Without closes this equals `lru_reference(requests, gpu_blocks + cpu_blocks)`."""
    blocks, limits, tokens = _stream(requests)
    last = {r.session: i for i, r in enumerate(requests) if r.session is not None}
    owner: dict[int, str | None] = {}  # block -> the one session that used it (None: two, or none)
    owned: dict[str, set[int]] = {}
    gpu: OrderedDict[int, None] = OrderedDict()
    cpu: OrderedDict[int, None] = OrderedDict()
    dead: set[int] = set()
    hit = 0
    for i, (req, ids, limit) in enumerate(zip(requests, blocks, limits, strict=True)):
        n = 0
        while n < min(limit, len(ids)) and (ids[n] in gpu or ids[n] in cpu):
            n += 1
        hit += n * BLOCK_SIZE
        for h in reversed(ids):
            dead.discard(h)
            if h not in owner:
                owner[h] = req.session
                if req.session is not None:
                    owned.setdefault(req.session, set()).add(h)
            elif owner[h] is not None and owner[h] != req.session:
                owned[owner[h]].discard(h)
                owner[h] = None
            cpu.pop(h, None)
            if h in gpu:
                gpu.move_to_end(h)
                continue
            gpu[h] = None
            if len(gpu) > gpu_blocks:
                victim, _ = gpu.popitem(last=False)
                if victim not in dead:
                    cpu[victim] = None
                    if len(cpu) > cpu_blocks:
                        cpu.popitem(last=False)
        if req.session is not None and last[req.session] == i:
            closed = owned.pop(req.session, set())
            for h in closed:
                owner[h] = None  # the session is gone: a later use by anyone keeps it live
            dead |= closed
            for h in reversed([h for h in cpu if h in closed]):
                cpu.move_to_end(h, last=False)
    return hit / sum(tokens)


def min_reference(requests: list[TraceRequest], capacity: int) -> float:
    """Belady's MIN with bypass over the flattened stream of full blocks (O(n log n))."""
    blocks, limits, tokens = _stream(requests)
    flat = [h for ids in blocks for h in ids]
    never = len(flat)
    next_use = [never] * len(flat)
    seen: dict[int, int] = {}
    for t in range(len(flat) - 1, -1, -1):
        next_use[t] = seen.get(flat[t], never)
        seen[flat[t]] = t
    cached: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hit, t = 0, 0
    for ids, limit in zip(blocks, limits, strict=True):
        prefix = True
        for pos, h in enumerate(ids):
            nxt = next_use[t]
            t += 1
            if h in cached:
                if prefix and pos < limit:
                    hit += BLOCK_SIZE
                if nxt == never:
                    del cached[h]
                else:
                    cached[h] = nxt
                    heapq.heappush(heap, (-nxt, h))
                continue
            prefix = False
            if nxt == never:
                continue  # bypass: never used again
            if len(cached) >= capacity:
                while heap and cached.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if -heap[0][0] <= nxt:
                    continue  # bypass: everything cached is used sooner
                del cached[heapq.heappop(heap)[1]]
            cached[h] = nxt
            heapq.heappush(heap, (-nxt, h))
    return hit / sum(tokens)


# --- replays -----------------------------------------------------------------------------------

def _replay_point(point: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from offload_connector.cli.replay import run_replay
    from offload_connector.config import load_config

    policy, eviction, branch_filter, close = SERIES[point["series"]]
    gpu, cpu = point["gpu_blocks"], point["cpu_blocks"]
    if point["series"] == "ceiling":
        gpu, cpu = gpu + cpu, 2
    config = load_config(merge_configs(default_config_dict(), {
        "store_policy": policy, "eviction": eviction, "branch_filter": branch_filter, "num_cpu_blocks": cpu,
        "engine": {"num_gpu_blocks": gpu, "max_num_seqs": point["max_num_seqs"]}}))
    trace = bundled_trace_path(point["trace"])
    d = run_replay(config, read_trace(trace), scaled=True, trace_name=point["trace"],
                   session_close=close).to_dict()
    prompt = d["prompt_tokens"]
    return {**point, "hit_ratio": (d["gpu_hit_tokens"] + d["cpu_hit_tokens"]) / prompt,
            "cpu_hit_ratio": d["cpu_hit_tokens"] / prompt, "integrity_errors": d["integrity_errors"],
            "leaked_blocks": d["leaked_blocks"], "error": d["error"], "wall_seconds": d["wall_seconds"],
            "gpu_evictions_unsaved": d["gpu_evictions_unsaved"], "steps": d["steps"],
            "stored_blocks": d["connector"].get("num_stored_blocks", 0),
            "dropped_blocks": d["connector"].get("num_dropped_blocks", 0),
            "demoted_blocks": d["connector"].get("num_demoted_blocks", 0),
            "deferred_lookups": d["connector"].get("num_deferred_lookups", 0),
            "cpu_evictions": d["connector"].get("num_cpu_evictions", 0)}


def run_points(points: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    order = sorted(points, key=lambda p: (p["trace"] != "agentic", p["max_num_seqs"]))  # slowest first
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(_replay_point, order))
    bad = [r for r in results if r["integrity_errors"] or r["leaked_blocks"] or r["error"]]
    if bad:
        raise BenchmarkError("replay not clean: " + "; ".join(
            f"{r['trace']} {r['series']} x{r['max_num_seqs']}: {r['integrity_errors']} integrity errors, "
            f"{r['leaked_blocks']} leaked blocks, error {r['error']!r}" for r in bad))
    return results


def gap_closed(value: float, base: float, best: float) -> float:
    """The share of the gap from `base` to `best` that `value` closes (0 when there is no gap)."""
    return (value - base) / (best - base) if best > base else 0.0


def summarize(results: list[dict[str, Any]], refs: dict[tuple[str, int], dict[str, float]]) -> None:
    """Add `vs_ceiling` and `gap_closed` to each result (against the ceiling of its own size and concurrency)."""
    ceiling = {(r["trace"], r["cpu_blocks"], r["max_num_seqs"]): r["hit_ratio"] for r in results
               if r["series"] == "ceiling"}
    for r in results:
        ref = refs[(r["trace"], r["cpu_blocks"])]
        base, best = ceiling[(r["trace"], r["cpu_blocks"], r["max_num_seqs"])], ref["min"]
        r["vs_ceiling"] = r["hit_ratio"] / base
        r["gap_closed"] = gap_closed(r["hit_ratio"], base, best)
        r["lru_gap_closed"] = gap_closed(r["hit_ratio"], ref["lru"], best)


def format_table(out: dict[str, Any]) -> str:
    lines = []
    for ref in out["references"]:
        trace, cpu = ref["trace"], ref["cpu_blocks"]
        lines.append(f"{trace}: GPU {ref['gpu_blocks']:,} + CPU {cpu:,} blocks (5% + {cpu / ref['distinct_blocks']:.3g}x "
                     f"the {ref['distinct_blocks']:,} distinct), scaled; one at a time: MIN {ref['min']:.2%}, "
                     f"LRU {ref['lru']:.2%} (references over the block stream)"
                     + (f"; LRU + session close (two exclusive tiers) {ref['lru_close']:.2%}, "
                        f"{gap_closed(ref['lru_close'], ref['lru'], ref['min']):+.1%} of the LRU->MIN gap"
                        if "lru_close" in ref else ""))
        lines.append(f"  {'series':<18} | {'one at a time':>13} {'vs ceil':>7} {'gap':>7} {'LRU gap':>7} | "
                     f"{'64 at once':>10} {'vs ceil':>7} {'gap':>7} {'LRU gap':>7} | {'CPU evictions':>13}")
        for series in SERIES:
            cells, evictions = [], []
            for n in CONCURRENCY:
                r = next((x for x in out["replays"] if (x["trace"], x["cpu_blocks"], x["series"], x["max_num_seqs"])
                          == (trace, cpu, series, n)), None)
                cells.append(f"{'-':>10} {'':>7} {'':>7} {'':>7}" if r is None else
                             f"{r['hit_ratio']:10.2%} {r['vs_ceiling']:7.3f} {r['gap_closed']:+7.1%} "
                             f"{r['lru_gap_closed']:+7.1%}")
                evictions.append("-" if r is None or series == "ceiling" else f"{r['cpu_evictions']:,}")
            if any(c.strip() != "-" for c in cells):
                lines.append(f"  {series:<18} | {cells[0]:>34} | {cells[1]} | {' / '.join(evictions):>13}")
    lines.append("gap = (replay - ceiling) / (MIN - ceiling), ceiling of the same size and concurrency; LRU gap = "
                 "(replay - LRU) / (MIN - LRU), the references above; all replays clean "
                 f"(0 integrity errors, 0 leaked blocks); {out['wall_seconds']:.0f} s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="synthetic,agentic", help="comma-separated bundled trace names")
    parser.add_argument("--series", default=",".join(SERIES), help="comma-separated series (ceiling always runs)")
    parser.add_argument("--concurrency", default="1,64", help="comma-separated max_num_seqs values")
    parser.add_argument("--cpu-sizes", default="0.1",
                        help="comma-separated CPU tier sizes, as fractions of the trace's distinct blocks")
    parser.add_argument("--jobs", type=int, default=2, choices=[1, 2], help="parallel replays (at most 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    traces = args.traces.split(",")
    series = set(args.series.split(",")) | {"ceiling"}
    if bad := [t for t in traces if t not in BUNDLED_SIZES] + [s for s in series if s not in SERIES]:
        parser.error(f"unknown trace or series {bad}; allowed: {list(BUNDLED_SIZES)}, {list(SERIES)}")
    concurrency = [int(x) for x in args.concurrency.split(",")]
    fractions = [float(x) for x in args.cpu_sizes.split(",")]
    start = time.perf_counter()
    refs, points = {}, []
    for trace in traces:
        requests = read_trace(bundled_trace_path(trace))
        gpu, _ = BUNDLED_SIZES[trace]
        distinct = len({h for r in requests for h in r.hash_ids})
        has_sessions = any(r.session is not None for r in requests)
        for fraction in fractions:
            cpu = max(2, round(fraction * distinct))
            ref = refs[(trace, cpu)] = {"trace": trace, "gpu_blocks": gpu, "cpu_blocks": cpu,
                                        "min": min_reference(requests, gpu + cpu),
                                        "lru": lru_reference(requests, gpu + cpu), "distinct_blocks": distinct}
            if has_sessions:
                ref["lru_close"] = lru_close_reference(requests, gpu, cpu)
            points += [{"trace": trace, "series": s, "max_num_seqs": n, "gpu_blocks": gpu, "cpu_blocks": cpu}
                       for s in SERIES if s in series and (has_sessions or "close" not in s) for n in concurrency]
    results = run_points(points, args.jobs)
    summarize(results, refs)
    out = {"references": list(refs.values()), "replays": results, "wall_seconds": time.perf_counter() - start}
    print(json.dumps(out, sort_keys=True) if args.json else format_table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
