"""Presenting a replay: the readable text report and the hit-ratio plot (matplotlib, optional extra)."""

from __future__ import annotations

from pathlib import Path

from offload_connector.cli.replay import ReplayResult


class PlotError(RuntimeError):
    """The plot could not be written (matplotlib missing, or the file not writable)."""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _connector_lines(c: dict[str, float]) -> list[str]:
    """The connector's own counters (the figures vLLM's stats logger and Prometheus get)."""
    if not c:
        return []
    def gbps(nbytes: float, seconds: float) -> str:
        return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"
    return [
        f"  connector   {c['num_lookups']:,} lookups, {c['num_stored_blocks']:,} blocks stored "
        f"({gbps(c['bytes_stored'], c['store_seconds'])}), {c['num_loaded_blocks']:,} loaded "
        f"({gbps(c['bytes_loaded'], c['load_seconds'])}), "
        f"{c['num_cpu_evictions']:,} CPU evictions",
        f"              {c['num_store_skipped_blocks']:,} stores skipped (CPU pool pinned full), "
        f"{c['num_failed_store_blocks']:,} failed stores, {c['num_failed_load_blocks']:,} failed loads",
    ]


def _group_lines(result: ReplayResult) -> list[str]:
    """Hybrid mode: each KV-cache group's GPU-hit and CPU-loaded blocks (nothing with one group)."""
    s = result.stats
    if not s.group_loaded_blocks:
        return []
    names = ["full attention", f"sliding window {result.config.engine.sliding_window} tokens"]
    return [f"  KV group {g}  {name}: {hit:,} GPU-hit blocks, {loaded:,} blocks loaded from the CPU tier"
            for g, (name, hit, loaded) in enumerate(zip(names, s.group_gpu_hit_blocks, s.group_loaded_blocks,
                                                         strict=True))]


def _disk_lines(disk: dict[str, int]) -> list[str]:
    if not disk:
        return []
    return [f"  disk tier   {disk['records']:,} records ({_mib(disk['used_bytes'])} of {_mib(disk['capacity_bytes'])}), "
            f"{disk['scanned_blocks']:,} found at start; read {disk['read_blocks']:,} blocks, wrote "
            f"{disk['written_blocks']:,} ({disk['write_exists']:,} there already), evicted {disk['evicted_blocks']:,}, "
            f"refused {disk['corrupt_blocks']} corrupt + {disk['foreign_blocks']} foreign"]


def format_report(result: ReplayResult) -> str:
    s = result.stats
    d = result.to_dict()
    pct = s.ratio
    lines = [
        f"offload-connector replay: {result.trace}{' (scaled)' if result.scaled else ''}",
        f"  engine      {d['gpu_blocks']} GPU blocks x {d['block_size']} tokens, {d['cpu_blocks']} CPU blocks, "
        f"store policy {d['store_policy']}, eviction {d['eviction']}, up to {d['max_num_seqs']} requests at once",
        *([f"  sizes from  GPU: {d['sizes_from'].get('gpu_blocks', '?')}; CPU: {d['sizes_from'].get('cpu_blocks', '?')}"]
          if d.get("sizes_from") else []),
        f"  requests    {s.requests} ({s.finished_requests} finished, {s.aborted_requests} aborted, "
        f"{s.rejected_requests} rejected as too long)",
        f"  prompt      {s.prompt_tokens:,} tokens",
        f"    GPU hit   {s.gpu_hit_tokens:,} ({pct(s.gpu_hit_tokens):.1%})",
        f"    CPU hit   {s.cpu_hit_tokens:,} ({pct(s.cpu_hit_tokens):.1%})",
        *([f"      of it from disk {d['disk_hit_tokens']:,} ({pct(d['disk_hit_tokens']):.1%})"] if "disk" in result.tiers else []),
        f"    computed  {s.computed_prompt_tokens:,} ({pct(s.computed_prompt_tokens):.1%})",
        f"    hit ratio {pct(s.gpu_hit_tokens + s.cpu_hit_tokens):.1%} "
        f"({'GPU + CPU incl. disk' if 'disk' in result.tiers else 'GPU + CPU'})",
        f"  transfers   stored {_mib(s.bytes_stored)}, loaded {_mib(s.bytes_loaded)}; {s.num_loads} loads, "
        f"{s.load_wait_steps} load-wait steps (max {s.max_load_wait_steps}), {s.failed_load_blocks} failed blocks",
        f"  engine      {s.steps} steps, {s.output_tokens:,} output tokens, {s.num_preemptions} preemptions, "
        f"{s.recomputed_tokens:,} recomputed tokens",
        f"  GPU evicted {s.gpu_evictions:,} cached blocks, {s.gpu_evictions_unsaved:,} of them on neither tier",
        *_group_lines(result),
        *_disk_lines(result.tiers.get("disk", {})),
        *_connector_lines(result.connector),
        *(f"  {name:<11} " + (", ".join(f"{key} {value:,}" for key, value in counters.items() if value) or "idle")
          for name, counters in result.tiers.items() if name != "disk"),  # the disk's: its own line above
        f"  integrity   {s.integrity_errors} errors ({s.verified_tokens:,} token reads verified), "
        f"{s.leaked_blocks} leaked blocks",
        f"  wall time   {result.wall_seconds:.1f} s",
    ]
    if result.error:
        lines.append(f"  ERROR       {result.error}")
    return "\n".join(lines)


def write_plot(result: ReplayResult, path: str | Path, window: int = 100) -> None:
    """PNG of the hit ratio over the replay (moving window over requests), split by tier."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib (the [plot] extra): pip install matplotlib") from None
    samples = result.stats.samples
    if not samples:
        raise PlotError("nothing to plot: no request was admitted")
    w = max(1, min(window, len(samples)))
    xs, gpu, cpu = [], [], []
    acc_p = acc_g = acc_c = 0
    for i, smp in enumerate(samples):
        acc_p += smp.prompt_tokens
        acc_g += smp.gpu_hit_tokens
        acc_c += smp.cpu_hit_tokens
        if i >= w:
            old = samples[i - w]
            acc_p -= old.prompt_tokens
            acc_g -= old.gpu_hit_tokens
            acc_c -= old.cpu_hit_tokens
        xs.append(i + 1)
        gpu.append(acc_g / acc_p if acc_p else 0.0)
        cpu.append(acc_c / acc_p if acc_p else 0.0)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.stackplot(xs, gpu, cpu, labels=["GPU hit", "CPU hit"], colors=["#4c72b0", "#dd8452"], alpha=0.85)
    s = result.stats
    ax.axhline(s.ratio(s.gpu_hit_tokens + s.cpu_hit_tokens), color="black", lw=1, ls="--",
               label="overall hit ratio")
    ax.set_xlabel("request (admission order)")
    ax.set_ylabel(f"prompt tokens hit (moving window of {w} requests)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{Path(result.trace).name}: {result.config.store_policy}/{result.config.eviction}, "
                 f"{result.config.engine.num_gpu_blocks} GPU / {result.num_cpu_blocks} CPU blocks")
    ax.legend(loc="upper left")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"cannot write plot {str(path)!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
