"""Hit ratio with the disk tier: each bundled trace, scaled, GPU 5% and CPU 10% of its distinct blocks (the
replay's defaults), and a disk tier of 25%, 100% and 400% of its distinct blocks, against the ceiling of one
LRU cache of GPU + CPU + disk blocks (`bench_hit_ratio.lru_reference`). Each point is a cold replay (an
empty directory); `warm` replays the 100% point again on the directory the cold run left (a restart).

    python benchmarks/bench_disk_hit_ratio.py --json [--traces synthetic agentic] [--points 25 100 400]
                                              [--store-policy lazy|eager]

Reads and writes run on threads against the replay's steps, so a point moves by a few tenths of a point
between runs (more on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile

from bench_hit_ratio import lru_reference

from offload_connector.cli.main import BUNDLED_SIZES
from offload_connector.cli.replay import replay_config, run_replay
from offload_connector.cli.trace import read_trace, resolve_trace
from offload_connector.disk.format import record_bytes

DISTINCT = {"synthetic": 43924, "agentic": 53159}
PAYLOAD = 2048  # one block of the replay's fake model (2 layers x K/V x 16 tokens x 2 heads x 8 x fp16)


def point(trace: str, pct: int, directory: str, store_policy: str | None) -> dict:
    gpu, cpu = BUNDLED_SIZES[trace]
    disk_blocks = DISTINCT[trace] * pct // 100
    config = replay_config(None, gpu_blocks=gpu, cpu_blocks=cpu, store_policy=store_policy, disk_dir=directory,
                           disk_bytes=str(disk_blocks * record_bytes(PAYLOAD)))
    requests = read_trace(resolve_trace(trace))
    result = run_replay(config, requests, scaled=True, trace_name=trace).to_dict()
    if result["integrity_errors"] or result["leaked_blocks"]:
        raise RuntimeError(f"{trace} {pct}%: not clean: {result['error']}")
    return {"trace": trace, "store_policy": config.store_policy, "disk_pct": pct, "disk_blocks": disk_blocks, "hit_ratio": result["hit_ratio"],
            "disk_hit_tokens": result["disk_hit_tokens"], "prompt_tokens": result["prompt_tokens"],
            "lru_ceiling": lru_reference(requests, gpu + cpu + disk_blocks), "wall_seconds": result["wall_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=["synthetic", "agentic"], choices=sorted(DISTINCT))
    ap.add_argument("--points", nargs="+", type=int, default=[25, 100, 400])
    ap.add_argument("--store-policy", choices=("lazy", "eager"), help="default: the config's (lazy)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = []
    for trace in args.traces:
        gpu, cpu = BUNDLED_SIZES[trace]
        base = run_replay(replay_config(None, gpu_blocks=gpu, cpu_blocks=cpu, store_policy=args.store_policy),
                          read_trace(resolve_trace(trace)),
                          scaled=True).to_dict()
        out.append({"trace": trace, "disk_pct": 0, "hit_ratio": base["hit_ratio"],
                    "lru_ceiling": lru_reference(read_trace(resolve_trace(trace)), gpu + cpu)})
        for pct in args.points:
            directory = tempfile.mkdtemp(prefix="bench_disk_hr.")
            try:
                out.append(point(trace, pct, directory + "/tier", args.store_policy))
                if pct == 100:
                    out.append(point(trace, pct, directory + "/tier", args.store_policy) | {"warm": True})
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for r in out:
        print(f"{r['trace']:9s} disk {r['disk_pct']:3d}%{' warm' if r.get('warm') else '     '} hit ratio "
              f"{r['hit_ratio']:.3f}  one LRU of the same size {r['lru_ceiling']:.3f}")


if __name__ == "__main__":
    main()
