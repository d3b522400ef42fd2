"""The disk tier in the fake engine: warm restart, and every fault a miss, never a wrong KV byte.

For each scenario: the engine finishes every request, every block it read is verified against the fake
model's expected KV (0 integrity errors), nothing leaks, outputs equal an engine's without any connector,
and the tier's counters say what happened. Engine A fills the directory; engine B, started afresh on it
(a restart), runs requests sharing A's prefixes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from disk_helpers import mounted
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs

from offload_connector.disk.directory import DiskDirError
from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload, small_config

SHARED = prefixes(7, 6)
TESTS = Path(__file__).resolve().parents[1]


def disk_config(path, num_cpu_blocks: int = 48, engine: dict | None = None, **disk):  # noqa: ANN001, ANN201
    """Write-through unless `write` says otherwise: A's CPU tier of 48 blocks never evicts its prefixes."""
    return small_config(num_gpu_blocks=32, num_cpu_blocks=num_cpu_blocks, engine=engine or {},
                        disk={"path": str(path), "bytes": "64MiB", "write": "on_store", **disk})


def counters(engine: FakeEngine) -> dict[str, int]:
    tier = engine.connector.tiers["disk"]
    return dict(zip(tier.COUNTERS, tier.counter_values(), strict=True)) | tier.gauges()


def fill(path, **kw) -> dict[str, int]:  # noqa: ANN001
    with FakeEngine(disk_config(path, **kw)) as a:
        run_workload(a, one_per_prefix("a", SHARED, 1))
        clean(a)
        return counters(a)


def restart(path, **kw) -> tuple[dict[str, int], FakeEngine]:  # noqa: ANN001
    """Engine B on the same directory: its scan applied first, then requests sharing A's prefixes."""
    wl = one_per_prefix("b", SHARED, 2)
    with FakeEngine(disk_config(path, **kw)) as b:
        assert b.connector.tiers["disk"].wait_scan(30)
        run_workload(b, wl)
        clean(b)
        assert b.outputs == reference_outputs(wl)
        return counters(b), b


def record_files(path) -> list[Path]:  # noqa: ANN001
    return sorted(p for p in Path(path).rglob("*.kv"))


def test_a_restarted_engine_serves_the_prefixes_from_disk(tmp_path):
    a = fill(tmp_path / "disk")
    assert a["written_blocks"] > 0 and a["records"] == a["written_blocks"]
    b, engine = restart(tmp_path / "disk")
    # 1. the scan found every record, and B's CPU misses were read from disk, verified
    assert b["scanned_blocks"] == a["records"]
    assert b["lookup_hit_blocks"] > 0 and b["read_blocks"] == b["lookup_hit_blocks"]
    assert engine.stats.cpu_hit_tokens > 0  # loaded to the GPU from the CPU tier the disk filled
    assert b["corrupt_blocks"] == b["foreign_blocks"] == 0


def test_the_first_request_after_a_restart_hits(tmp_path):
    """The scan finished after start-up stopped waiting for it (`scan_wait_ms: 0`), before the first request,
    and no step has run yet: the first lookup takes it."""
    fill(tmp_path / "disk")
    wl = one_per_prefix("b", SHARED[:1], 2)  # one request
    with FakeEngine(disk_config(tmp_path / "disk", scan_wait_ms=0)) as b:
        assert b.connector.tiers["disk"].files.wait_scan(30)  # ready, not applied
        run_workload(b, wl)
        clean(b)
        assert counters(b)["lookup_hit_blocks"] > 0 and b.stats.cpu_hit_tokens > 0


def test_reset_cache_turns_the_tier_off_and_keeps_the_records(tmp_path):
    a = fill(tmp_path / "disk")
    files = record_files(tmp_path / "disk")
    with FakeEngine(disk_config(tmp_path / "disk")) as b:
        assert b.connector.tiers["disk"].wait_scan(30)
        # vLLM resets the cache after a weight update: the records may be the old weights'
        assert b.connector.reset_cache()
        run_workload(b, one_per_prefix("b", SHARED, 2))
        clean(b)
        c = counters(b)
    assert b.stats.cpu_hit_tokens == 0 and c["lookup_hit_blocks"] == 0 and c["written_blocks"] == 0
    assert record_files(tmp_path / "disk") == files and len(files) == a["records"]  # kept for a restart


def test_without_the_disk_tier_b_hits_nothing(tmp_path):
    """The control for the test above: the same B with no disk tier computes what the disk served."""
    wl = one_per_prefix("b", SHARED, 2)
    with FakeEngine(small_config(num_gpu_blocks=32, num_cpu_blocks=48)) as b:
        run_workload(b, wl)
        assert b.stats.cpu_hit_tokens == 0


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "empty"])
def test_damaged_records_are_misses(tmp_path, damage):
    fill(tmp_path / "disk")
    for path in record_files(tmp_path / "disk"):
        if damage == "flip a payload byte":
            with open(path, "r+b") as f:
                f.seek(4096 + 7)
                byte = f.read(1)[0]
                f.seek(4096 + 7)
                f.write(bytes([byte ^ 0x40]))
        else:
            os.truncate(path, 4096 + 100 if damage == "truncate" else 0)
    b, _ = restart(tmp_path / "disk")
    assert b["lookup_hit_blocks"] == 0 and b["read_blocks"] == 0
    if damage == "flip a payload byte":  # the header is fine: found at start, refused on read, dropped
        assert b["corrupt_blocks"] > 0 and b["dropped_blocks"] == b["corrupt_blocks"]
    else:  # the scan refuses them by size: never indexed
        assert b["scanned_blocks"] == 0 and b["scan_refused_files"] > 0


def test_another_models_directory_is_never_read(tmp_path):
    fill(tmp_path / "disk", engine={"head_dim": 8})  # another KV layout: another fingerprint
    b, _ = restart(tmp_path / "disk")
    assert b["scanned_blocks"] == 0 and b["lookup_hit_blocks"] == 0


def test_records_forged_without_the_auth_key_are_never_served(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    os.chmod(key, 0o600)
    fill(tmp_path / "disk")  # written without a key: a writer that does not hold it
    b, _ = restart(tmp_path / "disk", auth_key_file=str(key))
    assert b["scanned_blocks"] == 0 and b["lookup_hit_blocks"] == 0
    assert b["scan_refused_files"] > 0
    # with the key both ways, the restart hits
    signed = tmp_path / "signed"
    fill(signed, auth_key_file=str(key))
    b, _ = restart(signed, auth_key_file=str(key))
    assert b["lookup_hit_blocks"] > 0


def test_a_second_engine_on_the_same_directory_is_refused(tmp_path):
    with FakeEngine(disk_config(tmp_path / "disk")) as a:
        with pytest.raises(DiskDirError, match=f"'disk.path'.*held by the engine in process {os.getpid()}"):
            FakeEngine(disk_config(tmp_path / "disk"))
        run_workload(a, one_per_prefix("a", SHARED, 1))  # the first goes on
        clean(a)


def test_a_budget_smaller_than_the_work_evicts_the_oldest(tmp_path):
    a = fill(tmp_path / "disk", bytes=8192 * 10)  # room for 10 records of 8 KiB
    assert a["records"] == 10 and a["evicted_blocks"] == a["written_blocks"] - 10
    assert len(record_files(tmp_path / "disk")) <= 10 + a["evicted_blocks"]  # deletions may still run ...
    b, _ = restart(tmp_path / "disk", bytes=8192 * 10)
    assert b["scanned_blocks"] == 10  # ... but the restart finds only what the budget kept
    assert len(record_files(tmp_path / "disk")) <= 10 + b["written_blocks"]


def test_disk_full_during_a_run_steps_aside_and_the_engine_goes_on(tmp_path, caplog):
    root = tmp_path / "small"
    root.mkdir(mode=0o700)
    wl = one_per_prefix("a", SHARED, 1)
    with mounted("-t", "tmpfs", "-o", "size=96k,mode=0700", "tmpfs", str(root)):  # about 10 records
        # A pause longer than the run: on a slow machine a 1 s pause ends mid-run and the retry warns again.
        config = disk_config(root, breaker_backoff_ms=600_000, breaker_max_backoff_ms=600_000)
        with caplog.at_level(logging.WARNING), FakeEngine(config) as a:
            run_workload(a, wl)
            clean(a)
            assert a.outputs == reference_outputs(wl)
            c = counters(a)
        assert c["written_blocks"] > 0 and c["dropped_writes"] > 0 and c["breaker_trips"] >= 1
        warnings = [r for r in caplog.records if "disk tier" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "ENOSPC" in warnings[0].getMessage(), [w.getMessage() for w in warnings]


def test_a_filesystem_turned_read_only_mid_run_still_serves_reads(tmp_path):
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    wl = one_per_prefix("b", SHARED, 2)
    with mounted("-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(root)):
        fill(root)
        with FakeEngine(disk_config(root)) as b:
            assert b.connector.tiers["disk"].wait_scan(30)
            # the filesystem itself goes read-only under the running engine (open directories included)
            if subprocess.run(["mount", "-o", "remount,ro", str(root)], capture_output=True).returncode:
                pytest.skip("remounting read-only needs CAP_SYS_ADMIN")
            run_workload(b, wl)
            clean(b)
            c = counters(b)
        assert b.outputs == reference_outputs(wl)
    assert c["lookup_hit_blocks"] > 0 and c["errors"] > 0 and c["breaker_trips"] >= 1


@pytest.mark.parametrize(("tp", "write"), [(2, "on_store"), (1, "on_cpu_evict"), (2, "on_cpu_evict")])
def test_tensor_parallel_and_write_back_restarts(tmp_path, tp, write):
    """Each rank writes its own records; a block is on disk (a KV event, DISK) once every rank's is; with
    write-back only what the CPU tier evicted is written. A restart with the same TP size hits them."""
    path = tmp_path / "disk"
    cpu_blocks = 48 if write == "on_store" else 24
    with FakeEngine(disk_config(path, cpu_blocks, write=write), tp_size=tp) as a:
        a.connector.emit_kv_events = True
        run_workload(a, one_per_prefix("a", SHARED, 1))
        if write == "on_cpu_evict":  # push A's prefixes out of its small CPU tier
            run_workload(a, one_per_prefix("filler", prefixes(12, 8), 4))
        clean(a)
        c = counters(a)
        events = [e for e in a.connector.take_events() if e.medium == "DISK"]
    assert c["written_blocks"] == tp * c["records"] > 0 and len(events) == c["records"]
    assert all(len(list(d.iterdir())) == c["records"] for d in path.iterdir() if d.is_dir())  # per rank
    wl = one_per_prefix("b", SHARED, 2)
    with FakeEngine(disk_config(path, write=write), tp_size=tp) as b:
        assert b.connector.tiers["disk"].wait_scan(30)
        run_workload(b, wl)
        clean(b)
        cb = counters(b)
        assert b.outputs == reference_outputs(wl)
    assert cb["scanned_blocks"] == c["records"] and cb["lookup_hit_blocks"] > 0
    assert cb["read_blocks"] == tp * cb["lookup_hit_blocks"]


@pytest.mark.parametrize("shard_heads", [False, True])
def test_a_restart_with_another_tp_size_reads_nothing(tmp_path, shard_heads):
    # the disk tier keeps records per rank (one engine's directory): a TP 2 engine, even of the same
    # head-sharded model (shard_heads: the remote tier would share), misses cleanly on a TP 1 directory
    fill(tmp_path / "disk")
    wl = one_per_prefix("b", SHARED, 2)
    with FakeEngine(disk_config(tmp_path / "disk"), tp_size=2, shard_heads=shard_heads) as b:
        assert b.connector.tiers["disk"].wait_scan(30)
        run_workload(b, wl)
        clean(b)
        assert counters(b)["scanned_blocks"] == 0 and counters(b)["lookup_hit_blocks"] == 0


ENGINE_A = """
import sys
from remote_helpers import one_per_prefix, prefixes
from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload, small_config
cfg = small_config(num_gpu_blocks=32, num_cpu_blocks=48, disk={"path": sys.argv[1], "bytes": "64MiB",
                                                               "write": "on_store"})
with FakeEngine(cfg) as a:
    for round in range(1000):
        run_workload(a, one_per_prefix(f"r{round}-", prefixes(round, 6), round))
        print(round, flush=True)
"""


def test_an_engine_killed_mid_run_leaves_nothing_that_reads_wrong(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_A, str(tmp_path / "disk")], env=env,
                            stdout=subprocess.PIPE)
    for _ in range(3):
        proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    # B runs the killed engine's first rounds again: what it reads from disk is verified, or a miss
    with FakeEngine(disk_config(tmp_path / "disk")) as b:
        assert b.connector.tiers["disk"].wait_scan(30)
        for rnd in range(3):
            wl = one_per_prefix(f"b{rnd}-", prefixes(rnd, 6), 100 + rnd)
            run_workload(b, wl)
        clean(b)
        c = counters(b)
    assert c["scanned_blocks"] > 0 and c["lookup_hit_blocks"] > 0
