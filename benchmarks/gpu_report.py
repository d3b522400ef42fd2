"""A short table of `bench_datapath.py --backend cuda --json` (scripts/gpu_check.sh prints it last).

`python benchmarks/gpu_report.py bench_cuda.json`: per segment size, the ratio to the contiguous pinned
copy of each path (store / load, scattered ids) in both layouts; the matmul slowdown per path; the round
trip; the DMA piece sizes; the smallest ratio of the default configuration.
"""

from __future__ import annotations

import json
import sys

PATHS = ("default", "staged", "dma", "kernel")


def cell(row: dict, pattern: str) -> str:
    if "error" in row:
        return "error"
    r = row.get(pattern)
    return f"{r['store_vs_copy']:.2f}/{r['load_vs_copy']:.2f}" if r else "-"


def report(data: dict) -> list[str]:
    lines = [f"{data.get('device')} {data.get('date')} torch {data.get('torch')} ({data.get('seconds')} s); "
             "ratios to the contiguous copy, store/load"]
    for pattern in ("scattered", "runs"):
        lines.append(f"-- {pattern} ids --")
        lines.append(f"{'segment':>8} {'layout':>15} " + " ".join(f"{p:>11}" for p in PATHS) + "  default takes")
        for name, row in data.get("sweep", {}).items():
            if "error" in row:
                lines.append(f"{name:>8} error: {row['error'][:200]}")
                continue
            for layout in ("layer_compact", "block_outermost"):
                per = row.get(layout, {})
                taken = per.get("default", {}).get("policy", "?")
                lines.append(f"{name:>8} {layout:>15} " + " ".join(f"{cell(per.get(p, {}), pattern):>11}" for p in PATHS)
                             + f"  {taken}")
    slow = data.get("forward_slowdown", {})
    lines.append("-- matmul slowdown beside stores + loads of scattered 32 KiB segments (copies GB/s alone) --")
    for name, row in slow.items():
        if isinstance(row, dict):
            if "error" in row:
                lines.append(f"{name:>24}: error {row['error'][:200]}")
            else:
                lo, hi = row.get("matmul_slowdown_range", [0, 0])
                over = row.get("matmul_slowdown_over_copy")
                over_text = f" (x{over:.4f} over copy_)" if over is not None else ""
                lines.append(f"{name:>24}: matmul x{row['matmul_slowdown']:.4f} [{lo:.3f}, {hi:.3f}]{over_text}  copies "
                             f"{row['copies_gbps_alone']} GB/s (x{row['copy_slowdown']:.3f} beside the matmul), "
                             f"submitted in {row.get('submit_ms')} ms")
    for layout, row in data.get("round_trip", {}).items():
        if isinstance(row, dict):
            lines.append(f"round trip {layout}: {row.get('blocks_wrong', row.get('error'))} wrong of "
                         f"{row.get('blocks_checked')} blocks; {row.get('policy')}")
    pieces = data.get("dma_pieces", {})
    lines.append("-- one batched DMA of scattered pieces vs copy_ (d2h/h2d, one stream | two) --")
    for name, row in pieces.items():
        if isinstance(row, dict) and "d2h_one_stream_vs_copy" in row:
            lines.append(f"{name:>8}: {row['d2h_one_stream_vs_copy']:.2f}/{row['h2d_one_stream_vs_copy']:.2f} | "
                         f"{row['d2h_two_streams_vs_copy']:.2f}/{row['h2d_two_streams_vs_copy']:.2f}")
    for policy, row in data.get("submit_us", {}).items():
        if isinstance(row, dict):
            lines.append(f"host us per start_store/start_load ({policy}), to the first copy call in (): " + ", ".join(
                f"{n} blocks {r['store_us']}/{r['load_us']} ({r.get('store_first_us')}/{r.get('load_first_us')})"
                for n, r in row.items() if isinstance(r, dict)))
    lines.append(f"summary: {json.dumps(data.get('summary'))}")
    return lines


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(report(json.load(f))))
