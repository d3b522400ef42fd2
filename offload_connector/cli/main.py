"""The `offload-connector` command.

- `replay`: replay a Mooncake trace through the fake engine with the connector and report hit ratios,
  transfers, integrity errors and leaks. Exit status 0 on a clean run, 1 if the replay found integrity
  errors or leaked blocks.
- `check CONFIG [--model-config config.json] [--tp N] [--block-size N]`: validate a config and print what
  it gives per rank for that model (check.py). Exit status 0 when valid.

Both: exit status 2 with one `error:` line on stderr on bad input (config, model config, trace, flags) or a
missing optional dependency, found before any work starts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from offload_connector.cli.trace import BUNDLED_TRACES, TraceError, read_trace, resolve_trace

# With no --trace: the bundled trace, scaled, on a GPU pool of 5% and a CPU tier of 10% of its 43,924
# distinct blocks (the sizes of the references in the trace's README) unless --config or flags set sizes.
BUNDLED_GPU_BLOCKS = 2196
BUNDLED_CPU_BLOCKS = 4392
# The same for each bundled trace by name: (GPU, CPU) = 5% / 10% of its distinct blocks (agentic: 53,159).
BUNDLED_SIZES = {"synthetic": (BUNDLED_GPU_BLOCKS, BUNDLED_CPU_BLOCKS), "agentic": (2658, 5316)}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; allowed: an int >= 1")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("offload-connector")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-connector", description="CPU-offload KV connector tools")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser(
        "replay", help="replay a Mooncake trace through the fake engine with the connector",
        description="Replay a Mooncake-format trace through the fake engine with the connector. With no "
                    "arguments: the embedded default config on the bundled Mooncake trace, scaled (one trace "
                    f"block = one engine block), {BUNDLED_GPU_BLOCKS} GPU and {BUNDLED_CPU_BLOCKS} CPU "
                    "blocks (5% and 10% of its distinct blocks).")  # a description is not %-formatted
    rp.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded default.yaml)")
    rp.add_argument("--trace", metavar="FILE|NAME",
                    help="Mooncake-format JSONL trace (.gz read too), or a bundled trace by name: "
                         f"{', '.join(BUNDLED_TRACES)} (default: synthetic, the Mooncake synthetic trace)")
    rp.add_argument("--gpu-blocks", type=_positive, metavar="N", help="override engine.num_gpu_blocks")
    rp.add_argument("--cpu-blocks", type=_positive, metavar="N", help="override num_cpu_blocks")
    rp.add_argument("--store-policy", choices=["eager", "lazy"], help="override store_policy")
    rp.add_argument("--eviction", choices=["lru", "arc"], help="override eviction (the CPU tier's replacement)")
    rp.add_argument("--max-num-seqs", type=_positive, metavar="N",
                    help="override engine.max_num_seqs (1: one request at a time, like the trace's references)")
    rp.add_argument("--no-branch-filter", action="store_true",
                    help="set branch_filter: false (keep superseded branches in the CPU tier)")
    rp.add_argument("--no-session-close", action="store_true",
                    help="never close a trace's sessions (default: after each session's last request)")
    rp.add_argument("--session-close-delay", type=float, default=0.0, metavar="S",
                    help="close a session S seconds of trace time after its last request (default 0: with it)")
    rp.add_argument("--scaled", action="store_true",
                    help="one trace block = one engine block (block_size tokens per hash id, outputs scaled "
                         "alike): full traces replay in minutes (always on for the bundled trace unless "
                         "--full-size)")
    rp.add_argument("--full-size", action="store_true",
                    help="bundled trace only: 512 tokens per hash id as recorded (slow: use --limit)")
    rp.add_argument("--limit", type=_positive, metavar="N", help="replay only the first N requests")
    rp.add_argument("--hybrid", type=_positive, nargs="?", const=0, metavar="WINDOW",
                    help="hybrid model: odd layers attend within a sliding window of WINDOW tokens (default 4 "
                         "blocks) as a second KV-cache group; the report gives each group's hits")
    rp.add_argument("--disk-dir", metavar="DIR",
                    help="turn the disk tier on in DIR (created 0700; a second replay with it finds the blocks)")
    rp.add_argument("--disk-bytes", metavar="SIZE", help='the disk tier\'s budget, e.g. "2GiB" (default 16GiB)')
    rp.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    rp.add_argument("--plot", metavar="FILE", help="write a PNG of the hit ratio over time (needs matplotlib)")
    rp.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    rp.add_argument("--check-each-step", action="store_true",
                    help="check the connector's invariants (check_integrity, stores never over a block a "
                         "load in flight reads) after every step, not only at the end: slower, same report")
    ck = sub.add_parser(
        "check", help="validate a config and print what it gives per rank for a model",
        description="Validate a config (every key, type and value) and, with a model's config.json, print one "
                    "rank's CPU tier for that model's KV shape: bytes, blocks and tokens, sized as the vLLM "
                    "connector will size it; refuses a tier under 2 blocks per rank or above this host's "
                    "MemAvailable, as vLLM's start-up does.")
    ck.add_argument("config", metavar="CONFIG", help="YAML config file")
    ck.add_argument("--model-config", metavar="CONFIG_JSON",
                    help="the model's Hugging Face config.json (layers, KV heads, head size, dtype)")
    ck.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel size (default 1)")
    ck.add_argument("--block-size", type=_positive, metavar="N",
                    help="vLLM's --block-size in tokens (default 16, vLLM's default)")
    ck.add_argument("--dtype", metavar="DTYPE",
                    help="KV dtype when it differs from the config's torch_dtype (vLLM's --dtype or "
                         "--kv-cache-dtype): float16, bfloat16, float32, fp8")
    ck.add_argument("--no-host-memory", action="store_true",
                    help="do not compare with this host's MemAvailable (checking for another machine)")
    ck.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _check(args: argparse.Namespace) -> int:
    from offload_connector.cli.check import check_config, format_check

    result = check_config(args.config, args.model_config, tp=args.tp, block_size=args.block_size,
                          dtype=args.dtype, host_memory=not args.no_host_memory)
    print(json.dumps(result, sort_keys=True) if args.json else format_check(result))
    return 0


def _trace_path(name: str | None) -> str:
    """The trace file: a bundled trace by name, or a path that exists; a near miss of a bundled name is
    refused with the close matches."""
    if name is None or name in BUNDLED_TRACES or Path(name).exists():
        return str(resolve_trace(name))
    close = difflib.get_close_matches(name, BUNDLED_TRACES, n=2, cutoff=0.7)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise TraceError(f"--trace: got {name!r}: no such file and no bundled trace of that name; {hint}"
                     f"allowed: a trace file, or a bundled trace: {', '.join(BUNDLED_TRACES)}")


def _check_plot_path(path: str) -> None:
    """Before the run: the file can be created, matplotlib is there and writes the file's format."""
    from offload_connector.cli.replay_report import PlotError

    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise PlotError(f"--plot: cannot write {path!r}: {exc.strerror}") from None
    if not existed:
        os.unlink(path)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("--plot needs matplotlib (the [plot] extra): pip install matplotlib") from None
    suffix = Path(path).suffix.lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        raise PlotError(f"--plot: got {path!r}; allowed: a file name ending in one of "
                        f"{', '.join('.' + f for f in sorted(formats))}")


def _pool_sizes(args: argparse.Namespace, bundled_scaled: bool) -> tuple[int | None, int | None, dict[str, str]]:
    """GPU and CPU block counts to override the config with, and where each size comes from: a flag, the
    config file, the bundled trace's default (5% / 10% of its distinct blocks), or the embedded default.
    A config file keeps the bundled trace's sizes unless it sets a size itself."""
    from offload_connector.config import config_source_dict

    data = config_source_dict(args.config) if args.config else {}
    engine = data.get("engine") or {}
    file_sets = {"gpu_blocks": "num_gpu_blocks" in engine,
                 "cpu_blocks": "num_cpu_blocks" in data or "num_cpu_blocks" in engine}
    sizes: dict[str, int | None] = {"gpu_blocks": args.gpu_blocks, "cpu_blocks": args.cpu_blocks}
    gpu_default, cpu_default = BUNDLED_SIZES[args.trace or "synthetic"] if bundled_scaled else (0, 0)
    bundled_default = {"gpu_blocks": gpu_default, "cpu_blocks": cpu_default}
    bundled_share = {"gpu_blocks": "5%", "cpu_blocks": "10%"}
    sources = {}
    for key in sizes:
        if sizes[key] is not None:
            sources[key] = f"--{key.replace('_', '-')}"
        elif file_sets[key]:
            sources[key] = f"config file {args.config}"
        elif bundled_scaled:
            sizes[key] = bundled_default[key]
            sources[key] = f"the bundled trace's default ({bundled_share[key]} of its distinct blocks)"
        elif key == "cpu_blocks" and args.config:  # never cpu_bytes / the fake model's tiny blocks
            sizes[key] = config_source_dict(None)["engine"]["num_cpu_blocks"]
            sources[key] = "the embedded default.yaml's engine.num_cpu_blocks"
        else:
            sources[key] = "the config's defaults (the file sets none)" if args.config else "the embedded default.yaml"
    if sizes["cpu_blocks"] is not None and sources["cpu_blocks"] != "--cpu-blocks" \
            and any(k in data for k in ("cpu_bytes", "cpu_bytes_to_use")) and not file_sets["cpu_blocks"]:
        sources["cpu_bytes"] = ("not used: it sizes the tier under vLLM; the fake engine's blocks are tiny "
                                "(set num_cpu_blocks or --cpu-blocks)")
        print(f"note: cpu_bytes in {args.config} sizes the CPU tier under vLLM, not here: the fake engine keeps "
              f"{sizes['cpu_blocks']:,} CPU blocks, {sources['cpu_blocks']}; set num_cpu_blocks (or --cpu-blocks) "
              "to size it", file=sys.stderr)
    return sizes["gpu_blocks"], sizes["cpu_blocks"], sources


def _replay(args: argparse.Namespace) -> int:
    from offload_connector.cli.replay import ProgressBar, replay_config, run_replay
    from offload_connector.cli.replay_report import PlotError, format_report, write_plot

    if args.plot:
        try:
            _check_plot_path(args.plot)
        except PlotError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.full_size and (args.scaled or args.trace not in (None, "synthetic")):
        print("error: --full-size applies to the bundled trace unscaled; it cannot go with --scaled or --trace",
              file=sys.stderr)
        return 2
    if not args.session_close_delay >= 0:  # also refuses nan
        print(f"error: --session-close-delay: got {args.session_close_delay}; allowed: seconds >= 0",
              file=sys.stderr)
        return 2
    if args.disk_bytes is not None and args.disk_dir is None:
        print("error: --disk-bytes needs --disk-dir (the disk tier's directory)", file=sys.stderr)
        return 2
    bundled = args.trace is None or args.trace in BUNDLED_TRACES
    scaled = args.scaled or (bundled and not args.full_size)
    trace = _trace_path(args.trace)
    requests = read_trace(trace, limit=args.limit)
    gpu_blocks, cpu_blocks, sizes_from = _pool_sizes(args, bundled and scaled)
    config = replay_config(args.config, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                           store_policy=args.store_policy, eviction=args.eviction,
                           max_num_seqs=args.max_num_seqs, branch_filter=False if args.no_branch_filter else None,
                           hybrid_window=args.hybrid, disk_dir=args.disk_dir, disk_bytes=args.disk_bytes)
    if not requests:
        print(f"warning: trace {trace} holds no request", file=sys.stderr)
    bar = None if args.quiet else ProgressBar()
    try:
        result = run_replay(config, requests, scaled=scaled, trace_name=trace, progress=bar,
                            session_close=not args.no_session_close, session_close_delay=args.session_close_delay,
                            check_each_step=args.check_each_step)
    finally:
        if bar is not None:
            bar.close()
    if args.plot:
        try:
            write_plot(result, args.plot)
        except PlotError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    result.sizes_from = sizes_from
    if requests and result.stats.rejected_requests == len(requests):
        print("warning: every request was rejected (longer than the GPU pool can ever hold): raise "
              "--gpu-blocks", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
    else:
        print(format_report(result))
        if args.plot:
            print(f"  plot        {args.plot}")
    return 1 if result.stats.integrity_errors or result.stats.leaked_blocks else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. Every user error is one `error:` line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "replay":
            return _replay(args)
        if args.command == "check":
            return _check(args)
    except ValueError as exc:  # ConfigError, ModelConfigError, TraceError, HostPoolError, LayoutError, ...
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `| head` closed our stdout: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
