"""Warm restart, crashes and the one-engine lock of the disk tier, with real files and real processes.

A new process with the same directory finds the blocks again (the start-up scan), a writer killed with
SIGKILL mid-write leaves nothing that reads as KV, and a second engine on a held directory is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from disk_helpers import IDENTITY, block, fill, key, make_io, make_pool, rank_dir, run, verifier

from offload_connector.disk.directory import DirectoryLock, DiskDirError, open_private_dir
from offload_connector.disk.format import record_name
from scheduler_side.tiers.disk.files import FileWorker, scan_rank_dirs
from scheduler_side.tiers.disk.index import DiskIndex

TESTS = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}


def scan(root, pool, before=None, world_size=1):  # noqa: ANN001, ANN201
    dirs = [rank_dir(root, rank=r, world_size=world_size) for r in range(world_size)]
    verifiers = [verifier(rank=r, world_size=world_size) for r in range(world_size)]
    return scan_rank_dirs(dirs, verifiers, pool.bytes_per_block, time.time() + 1 if before is None else before)


def test_a_new_process_finds_the_blocks_in_lru_order(tmp_path):
    pool = make_pool()
    io = make_io(tmp_path / "disk", pool)
    data = {}
    for i in (3, 1, 2):  # written in this order: 3 is the oldest
        data[i] = fill(pool, i, seed=i)
        run(io, "write", i, [i], [key(i)])
        os.utime(os.path.join(io.dir, record_name(key(i))), (1000 + len(data), 1000 + len(data)))
    io.close()
    # 1. "restart": a fresh scan of the directory (no state but the files) finds every block, oldest first
    result = scan(tmp_path / "disk", pool)
    assert result.keys == [key(3), key(1), key(2)] and result.refused_files == 0
    # 2. an index of 2 blocks keeps the two most recent and evicts the oldest
    index = DiskIndex(2)
    assert index.add_found(result.keys) == [key(3)]
    assert key(1) in index and key(2) in index and key(3) not in index
    # 3. a new I/O engine reads them back bit exact
    fresh = make_pool()
    io2 = make_io(tmp_path / "disk", fresh)
    assert run(io2, "read", 0, [5, 6], [key(1), key(2)]).failed_keys == []
    assert block(fresh, 5) == data[1] and block(fresh, 6) == data[2]
    io2.close()


def test_the_scan_needs_every_ranks_record_and_removes_leftovers(tmp_path):
    pool = make_pool()
    ranks = [make_io(tmp_path / "disk", pool, rank=r, world_size=2) for r in range(2)]
    fill(pool, 1, seed=1)
    for r, io in enumerate(ranks):
        run(io, "write", 0, [1], [key(1)])  # complete on both ranks
        if r == 0:
            run(io, "write", 1, [1], [key(2)])  # rank 1 never wrote key 2
    Path(ranks[0].dir, record_name(key(7)) + ".123.tmp").write_bytes(b"half a record")  # a killed writer's
    Path(ranks[1].dir, record_name(key(8))).write_bytes(b"not a record")
    Path(ranks[1].dir, "notes.txt").write_text("someone's file")
    for io in ranks:
        io.close()
    result = scan(tmp_path / "disk", pool, world_size=2)
    assert result.keys == [key(1)]
    assert sorted(os.listdir(ranks[0].dir)) == [record_name(key(1))]  # partial key 2 and the temporary gone
    assert sorted(os.listdir(ranks[1].dir)) == [record_name(key(1))]


def test_files_newer_than_the_start_are_left_to_their_writers(tmp_path):
    pool = make_pool()
    io = make_io(tmp_path / "disk", pool)
    tmp = Path(io.dir, record_name(key(7)) + ".1.tmp")
    tmp.write_bytes(b"being written")
    io.close()
    assert scan(tmp_path / "disk", pool, before=time.time() - 60).keys == [] and tmp.exists()


WRITER = """
import sys, time
from disk_helpers import fill, key, make_io, make_pool
pool = make_pool(num_blocks=9, block_size=256, heads=8, head_dim=64)  # 1 MiB blocks: writes take a while
io = make_io(sys.argv[1], pool, io_threads=4)
for i in range(1, 9):
    fill(pool, i, seed=i)
n = 0
while True:
    ids = list(range(1, 9))
    io.submit_write(n, ids, [key(1000 * (n + 1) + i) for i in ids])
    io.wait_idle()
    io.poll()
    n += 1
    print(n, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_only_whole_records(tmp_path):
    """SIGKILL to a busy writer (four threads mid-write): every record the scan finds reads back bit exact, every
    other file is gone after the scan, and nothing a reader gets is torn."""
    root = tmp_path / "disk"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], env=ENV, stdout=subprocess.PIPE)
    for _ in range(3):
        proc.stdout.readline()  # a few batches done; four threads are writing the next one
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    pool = make_pool(num_blocks=9, block_size=256, heads=8, head_dim=64)
    expected = {i: fill(pool, i, seed=i) for i in range(1, 9)}
    result = scan(root, pool)
    assert result.keys, "the writer finished no record before it was killed"
    names = os.listdir(rank_dir(root))
    assert all(n.endswith(".kv") for n in names) and len(names) == len(result.keys)
    io = make_io(root, pool)
    for k in result.keys:
        fill(pool, 1, seed=99)
        res = run(io, "read", 0, [1], [k])
        assert res.failed_keys == [], f"record {k.hex()} found by the scan does not read back"
        assert block(pool, 1) == expected[int.from_bytes(k[:16], "big") % 1000]
    io.close()


def test_a_second_engine_on_a_held_directory_is_refused(tmp_path):
    root = open_private_dir(str(tmp_path / "disk"))
    held = DirectoryLock(root, "disk")
    # 1. in the same process (two engines in one process, as tests and replays run)
    with pytest.raises(DiskDirError, match=rf"disk.path.*held by the engine in process {os.getpid()}"):
        DirectoryLock(root, "disk")
    # 2. from another process
    code = ("import sys\nfrom offload_connector.disk.directory import DirectoryLock, DiskDirError\n"
            "try:\n    DirectoryLock(sys.argv[1], 'disk')\nexcept DiskDirError as e:\n    print(e); sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code, root], env=ENV, capture_output=True, text=True)
    assert out.returncode == 3 and f"process {os.getpid()}" in out.stdout
    # 3. released (or its holder killed), the directory is free again
    held.release()
    DirectoryLock(root, "disk").release()


def test_a_lock_holder_killed_with_sigkill_frees_the_directory(tmp_path):
    root = open_private_dir(str(tmp_path / "disk"))
    code = ("import sys, time\nfrom offload_connector.disk.directory import DirectoryLock\n"
            "DirectoryLock(sys.argv[1], 'disk'); print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, root], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(DiskDirError):
        DirectoryLock(root, "disk")
    proc.kill()
    proc.wait()
    proc.stdout.close()
    DirectoryLock(root, "disk").release()


def test_the_file_worker_scans_then_deletes(tmp_path):
    pool = make_pool()
    io = make_io(tmp_path / "disk", pool)
    run(io, "write", 0, [1, 2], [key(1), key(2)])
    io.close()
    files = FileWorker([rank_dir(tmp_path / "disk")], [verifier()], pool.bytes_per_block)
    deadline = time.monotonic() + 30
    scan_result = None
    while scan_result is None and time.monotonic() < deadline:
        scan_result, _ = files.poll()
        time.sleep(0.01)
    assert sorted(scan_result.keys) == [key(1), key(2)] and files.scan_done
    files.delete([key(1)])
    deleted: list[bytes] = []
    while not deleted and time.monotonic() < deadline:
        deleted += files.poll()[1]
        time.sleep(0.01)
    assert deleted == [key(1)] and os.listdir(rank_dir(tmp_path / "disk")) == [record_name(key(2))]
    files.close()


def test_identity_changes_the_directory(tmp_path):
    assert rank_dir(tmp_path, IDENTITY, 0, 1) != rank_dir(tmp_path, IDENTITY, 0, 2) != rank_dir(tmp_path, IDENTITY, 1, 2)
