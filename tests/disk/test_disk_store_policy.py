"""The lazy store policy over a write-back disk tier: pressure means content the tiers lost, not moved.

Lazy stores what eager stores until a lookup misses on content dropped recently (lazy.py). A CPU eviction
that the disk tier writes (`write: on_cpu_evict`) loses nothing: the block comes back from disk, so only
the disk tier's own drops (evicted to stay within `disk.bytes`) count. Measured on the agentic trace with
a disk tier of about its distinct blocks: 95.1% hit ratio with eager, 94.0% with lazy counting CPU
evictions (docs/benchmarks.md, "Disk tier"). Same engine and requests in each test: 5 prefixes of 10
blocks, three rounds, GPU 32 blocks, CPU 24: the CPU tier evicts prefixes that the next round asks for."""

from __future__ import annotations

import pytest
from remote_helpers import clean, one_per_prefix, prefixes

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload, small_config

SHARED = prefixes(11, 5, length=40)


def rounds(tmp_path, disk_bytes: str | None) -> tuple[bool, int, dict[str, int]]:  # noqa: ANN001
    """(lazy under pressure at the end, CPU hit tokens, the disk tier's counters)."""
    disk = {} if disk_bytes is None else {"disk": {"path": str(tmp_path / "disk"), "bytes": disk_bytes,
                                                   "write": "on_cpu_evict"}}
    with FakeEngine(small_config(num_gpu_blocks=32, num_cpu_blocks=24, store_policy="lazy", **disk)) as engine:
        for r in range(3):
            run_workload(engine, one_per_prefix(f"r{r}-", SHARED, r))
        clean(engine)
        tier = engine.connector.tiers.get("disk")
        return (engine.connector.policy.under_pressure, engine.stats.cpu_hit_tokens,
                tier.counters.snapshot() if tier is not None else {})


def test_without_a_lower_tier_a_miss_on_what_the_cpu_evicted_is_pressure(tmp_path):
    under_pressure, _, _ = rounds(tmp_path, None)
    assert under_pressure


def test_cpu_evictions_the_disk_keeps_are_no_pressure(tmp_path):
    """Before: the disk served the returning prefixes, yet their CPU evictions put lazy under pressure."""
    under_pressure, cpu_hit_tokens, disk = rounds(tmp_path, "64MiB")
    assert disk["evicted_blocks"] == 0 and disk["lookup_hit_blocks"] > 0
    assert cpu_hit_tokens > 0  # loaded to the GPU from the CPU tier the disk refilled
    assert not under_pressure


@pytest.mark.parametrize("disk_bytes", ["48KiB"])  # 6 records of 8 KiB: the disk drops prefixes too
def test_a_miss_on_what_the_disk_dropped_is_pressure(tmp_path, disk_bytes):
    under_pressure, _, disk = rounds(tmp_path, disk_bytes)
    assert disk["evicted_blocks"] > 0
    assert under_pressure
