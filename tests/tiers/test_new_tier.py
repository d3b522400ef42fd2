"""A new tier below the CPU tier is one module and a registration (tests/memory_tier.py), nothing else.

The in-memory tier implements both interfaces for real (scheduler_side/tiers/base.py, worker_side/tiers/
base.py); registered under its config section's name, the fake engine runs with it unchanged. Engine A
computes some prefixes (its stores are written to the tier); engine B, with an empty CPU tier, then sees
each prefix once: its CPU hits must come from the tier (fetched into its CPU tier, then loaded). The fake
model verifies every block each request reads, so a wrong fetched byte is an integrity error; outputs
must equal an engine's without any connector.
"""

from __future__ import annotations

import itertools

import pytest
from memory_tier import STORES, MemoryTier, checksum, registered, with_memory
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs

from offload_connector.config import OffloadConfig
from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload, small_config
from offload_connector.lower_tiers import LOWER_TIERS
from scheduler_side.tiers.base import LowerTier
from scheduler_side.tiers.registry import TIERS
from worker_side.tiers.base import TierIO
from worker_side.tiers.registry import TIER_IOS

_stores = itertools.count()


def memory_config(store: str, num_cpu_blocks: int = 48, **section):
    return with_memory(small_config(num_gpu_blocks=32, num_cpu_blocks=num_cpu_blocks), store, **section)


def tier_counter(engine: FakeEngine, name: str) -> int:
    return engine.connector.tiers["memory"].counts[name]


def test_both_registries_serve_every_configured_tier_in_cascade_order() -> None:
    assert tuple(TIERS) == tuple(TIER_IOS) == LOWER_TIERS
    for name in LOWER_TIERS:
        assert name in OffloadConfig.__struct_fields__ and getattr(OffloadConfig(), name) is None  # off by default
        assert issubclass(TIERS[name], LowerTier) and TIERS[name].name == name
        assert issubclass(TIER_IOS[name], TierIO) and TIER_IOS[name].name == name
        assert len(set(TIERS[name].COUNTERS)) == len(TIERS[name].COUNTERS)


@pytest.mark.parametrize(("tp", "write"), [(1, "on_store"), (2, "on_store"), (1, "on_cpu_evict")])
def test_a_registered_memory_tier_serves_a_second_engine(tp, write) -> None:
    store = f"store{next(_stores)}"
    shared = prefixes(11, 6)
    wl_a, wl_b = one_per_prefix("a", shared, 2), one_per_prefix("b", shared, 3)
    with registered():
        # 1. engine A computes the prefixes; each block reaches the tier (stored, or evicted from a small CPU tier)
        cpu_blocks = 48 if write == "on_store" else 24
        with FakeEngine(memory_config(store, cpu_blocks, write=write), tp_size=tp) as a:
            assert isinstance(a.connector.tiers["memory"], MemoryTier)
            a.connector.emit_kv_events = True
            run_workload(a, wl_a)
            if write == "on_cpu_evict":  # what is still on its CPU tier reaches the tier when evicted
                run_workload(a, one_per_prefix("filler", prefixes(12, 8), 4))
            clean(a)
            written = tier_counter(a, "written_blocks")
            assert written > 0 and len(STORES[store].records) == written
            events = [e for e in a.connector.take_events() if e.medium == "MEMORY"]
            assert len(events) * tp == written  # each block once, when every rank's copy is there
        # 2. engine B: an empty CPU tier, each prefix once; its CPU hits come from the tier
        with FakeEngine(memory_config(store, write=write), tp_size=tp) as b:
            run_workload(b, wl_b)
            clean(b)
            found = tier_counter(b, "hit_blocks")  # blocks B fetched from the tier
            assert tier_counter(b, "fetched_blocks") == tp * found and tier_counter(b, "failed_blocks") == 0
            # B computed none of the prefixes: every hit (CPU, or GPU after a load) is a block from the tier
            assert 0 < b.stats.gpu_hit_tokens + b.stats.cpu_hit_tokens <= 4 * found
            if write == "on_store":  # every prefix block (6 of 4 tokens, 6 requests) was written and is a hit
                assert b.stats.gpu_hit_tokens + b.stats.cpu_hit_tokens == 4 * 6 * 6
            else:  # only what A's CPU tier evicted was written (a few stores were skipped, the pool full)
                assert found >= 4 * 6
            outputs = b.outputs
    assert outputs == reference_outputs(wl_b)


def test_a_record_that_fails_its_check_is_recomputed_never_loaded() -> None:
    store = f"store{next(_stores)}"
    shared = prefixes(13, 4)
    wl_b = one_per_prefix("b", shared, 5)
    with registered():
        with FakeEngine(memory_config(store)) as a:
            run_workload(a, one_per_prefix("a", shared, 4))
        records = STORES[store].records
        for key, (check, payload) in list(records.items()):  # one flipped byte, the old checksum kept
            records[key] = (check, bytes([payload[0] ^ 0xFF]) + payload[1:])
            assert checksum(key[-1], records[key][1]) != check
        with FakeEngine(memory_config(store)) as b:
            run_workload(b, wl_b)
            clean(b)
            assert tier_counter(b, "failed_blocks") == tier_counter(b, "hit_blocks") > 0
            assert b.stats.cpu_hit_tokens == 0 and not b.connector.check_integrity()
            outputs = b.outputs
    assert outputs == reference_outputs(wl_b)


def test_the_replay_report_lists_each_configured_tiers_counters() -> None:
    """`offload-connector replay --json` adds an object of counters per lower tier, under its name."""
    from offload_connector.cli.replay import replay_config, run_replay
    from offload_connector.cli.replay_report import format_report
    from offload_connector.cli.trace import bundled_trace_path, read_trace

    requests = read_trace(bundled_trace_path(), limit=40)
    plain = run_replay(replay_config(None, gpu_blocks=64, cpu_blocks=64), requests, scaled=True).to_dict()
    assert "memory" not in plain and "remote" not in plain
    with registered():
        config = with_memory(replay_config(None, gpu_blocks=64, cpu_blocks=64), f"store{next(_stores)}")
        result = run_replay(config, requests, scaled=True)
    out = result.to_dict()
    assert out["integrity_errors"] == 0 and out["error"] is None
    assert set(out["memory"]) == set(MemoryTier.COUNTERS) and out["memory"]["written_blocks"] > 0
    assert "  memory      " in format_report(result)
