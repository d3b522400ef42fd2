"""The `offload-connector` command. Subcommand `replay` (SPEC §7): replay a Mooncake trace through the fake
engine with the connector and report hit ratios, transfers, integrity errors and leaks.

Exit status: 0 on a clean run, 1 if the replay found integrity errors or leaked blocks, 2 on bad input
(config, trace, flags) or a missing optional dependency.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from offload_connector.config import ConfigError
from offload_connector.trace import TraceError, bundled_trace_path, read_trace

DEFAULT_LIMIT = 80


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; allowed: an int >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-connector", description="CPU-offload KV connector tools")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser(
        "replay", help="replay a Mooncake trace through the fake engine with the connector",
        description="Replay a Mooncake-format trace through the fake engine with the connector. With no "
                    f"arguments: the embedded default config, the first {DEFAULT_LIMIT} requests of the "
                    "bundled trace.")
    rp.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded default.yaml)")
    rp.add_argument("--trace", metavar="FILE",
                    help="Mooncake-format JSONL trace (default: the bundled Mooncake synthetic trace)")
    rp.add_argument("--gpu-blocks", type=_positive, metavar="N", help="override engine.num_gpu_blocks")
    rp.add_argument("--cpu-blocks", type=_positive, metavar="N", help="override num_cpu_blocks")
    rp.add_argument("--store-policy", choices=["eager", "lazy"], help="override store_policy")
    rp.add_argument("--scaled", action="store_true",
                    help="one trace block = one engine block (block_size tokens per hash id, outputs scaled "
                         "alike): full traces replay in minutes")
    rp.add_argument("--limit", type=_positive, metavar="N",
                    help=f"replay only the first N requests (default: all with --trace or --scaled, "
                         f"else {DEFAULT_LIMIT})")
    rp.add_argument("--all", action="store_true", help="replay every request (no default limit)")
    rp.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    rp.add_argument("--plot", metavar="FILE", help="write a PNG of the hit ratio over time (needs matplotlib)")
    rp.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    return parser


def _replay(args: argparse.Namespace) -> int:
    from offload_connector.replay import ProgressBar, replay_config, run_replay
    from offload_connector.replay_report import PlotError, format_report, write_plot

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'offload-connector[plot]'", file=sys.stderr)
            return 2
    config = replay_config(args.config, gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks,
                           store_policy=args.store_policy)
    trace = args.trace or str(bundled_trace_path())
    limit = args.limit
    if limit is None and not (args.all or args.trace or args.scaled):
        limit = DEFAULT_LIMIT
    requests = read_trace(trace, limit=limit)
    bar = None if args.quiet else ProgressBar()
    try:
        result = run_replay(config, requests, scaled=args.scaled, trace_name=trace, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if args.plot:
        try:
            write_plot(result, args.plot)
        except PlotError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
    else:
        print(format_report(result))
        if args.plot:
            print(f"  plot        {args.plot}")
    return 1 if result.stats.integrity_errors or result.stats.leaked_blocks else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "replay":
            return _replay(args)
    except (ConfigError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
