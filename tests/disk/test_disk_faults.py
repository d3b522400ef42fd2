"""Faults of the disk tier on real filesystems: each is one warning and a miss or a dropped write, the
tier steps aside (its breaker), nothing is left behind, and it comes back when the fault is gone.

Disk full is a real tmpfs of a few KiB when this process may mount one (root with CAP_SYS_ADMIN), and a
file-size limit (RLIMIT_FSIZE, the same short write then error) everywhere. Read-only is a read-only bind
mount (root ignores chmod), or chmod 0500 for a user that is not root. EIO from a real failing block
device: test_disk_eio.py."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import time

import pytest
from disk_helpers import block, fill, key, make_io, make_pool, mounted, run

from offload_connector.disk.directory import DiskDirError, open_private_dir
from offload_connector.disk.format import record_bytes


def wait_breaker_allows(io, what: str) -> None:  # noqa: ANN001
    breaker = io.write_breaker if what == "write" else io.read_breaker
    deadline = time.monotonic() + 30
    while breaker.state == "open" and time.monotonic() < deadline:
        time.sleep(0.01)


def warnings_of(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "disk tier" in r.getMessage()]


def test_disk_full_on_a_tiny_tmpfs(tmp_path, caplog):
    pool = make_pool()
    root = tmp_path / "small"
    root.mkdir(mode=0o700)
    with mounted("-t", "tmpfs", "-o", f"size={6 * record_bytes(pool.bytes_per_block)},mode=0700", "tmpfs", str(root)):
        io = make_io(root, pool, breaker_backoff_ms=20, breaker_max_backoff_ms=20, io_threads=1)
        data = {i: fill(pool, i, seed=i) for i in range(1, 13)}
        # 1. twelve blocks into room for fewer: some written, the rest dropped; one warning; breaker open
        with caplog.at_level(logging.WARNING):
            result = run(io, "write", 0, list(range(1, 13)), [key(i) for i in range(1, 13)])
        written = [i for i in range(1, 13) if key(i) not in result.failed_keys]
        assert 0 < len(written) < 12 and io.counters.dropped_writes == 12 - len(written)
        assert io.counters.errors >= 1 and io.counters.breaker_trips == 1
        assert len(warnings_of(caplog)) == 1 and "ENOSPC" in warnings_of(caplog)[0]
        assert all(n.endswith(".kv") for n in os.listdir(io.dir))  # no temporary left behind
        # 2. what was written still reads back
        assert run(io, "read", 1, [14], [key(written[0])]).failed_keys == [] and block(pool, 14) == data[written[0]]
        # 3. space freed: after the backoff, writes go through again
        for i in written:
            os.unlink(os.path.join(io.dir, key(i).hex() + ".kv"))
        wait_breaker_allows(io, "write")
        assert run(io, "write", 2, [1], [key(1)]).failed_keys == []
        io.close()


def test_a_file_size_limit_is_a_dropped_write_and_no_leftover(tmp_path, caplog):
    """RLIMIT_FSIZE below one record: every write fails part way (EFBIG), as on a full disk."""
    pool = make_pool()
    fds = len(os.listdir("/proc/self/fd"))
    io = make_io(tmp_path / "disk", pool, io_threads=2)
    fill(pool, 1, seed=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (record_bytes(pool.bytes_per_block) - 100, hard))
    try:
        with caplog.at_level(logging.WARNING):
            result = run(io, "write", 0, [1, 2, 3], [key(1), key(2), key(3)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert sorted(result.failed_keys) == [key(1), key(2), key(3)] and io.counters.dropped_writes == 3
    assert io.counters.breaker_trips == 1 and len(warnings_of(caplog)) == 1 and "EFBIG" in warnings_of(caplog)[0]
    assert os.listdir(io.dir) == []
    # reads of what is not there stay misses; the read side is untouched
    assert run(io, "read", 1, [4], [key(1)]).failed_keys == [key(1)] and io.read_breaker.state == "closed"
    io.close()
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open
    assert io._snapshots.num_free == io._snapshots.num_slots  # every copy slot back


def test_a_read_only_filesystem_still_serves_reads(tmp_path, caplog):
    pool = make_pool()
    root = tmp_path / "disk"
    io = make_io(root, pool)
    data = fill(pool, 1, seed=1)
    run(io, "write", 0, [1], [key(1)])
    if os.geteuid() == 0:
        with mounted("--bind", str(root), str(root)):
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(root)], capture_output=True).returncode:
                pytest.skip("remounting read-only needs CAP_SYS_ADMIN")
            io2 = make_io_on_existing(root, pool)
            _check_read_only(io2, pool, data, caplog)
            io2.close()
    else:
        os.chmod(io.dir, 0o500)
        try:
            _check_read_only(io, pool, data, caplog)
        finally:
            os.chmod(io.dir, 0o700)
    io.close()


def make_io_on_existing(root, pool):  # noqa: ANN001, ANN201
    """The tier's I/O on a directory that exists already (open_private_dir's write probe would fail on a
    read-only mount: the rank directory is opened directly)."""
    from disk_helpers import IDENTITY, disk_config

    from offload_connector.disk.format import rank_fingerprint
    from worker_side.tiers.disk.io import DiskWorkerIO
    from worker_side.tiers.disk.records import PoolSegments
    return DiskWorkerIO(disk_config(root), str(root), rank_fingerprint(IDENTITY, 0, 1), PoolSegments.from_pool(pool))


def _check_read_only(io, pool, data, caplog) -> None:  # noqa: ANN001
    fill(pool, 2, seed=2)
    with caplog.at_level(logging.WARNING):
        result = run(io, "write", 10, [2, 3], [key(2), key(3)])
    assert sorted(result.failed_keys) == [key(2), key(3)] and io.counters.breaker_trips == 1
    assert len(warnings_of(caplog)) == 1
    # the tier stepped aside for writes; reads still come back verified
    assert run(io, "read", 11, [5], [key(1)]).failed_keys == [] and block(pool, 5) == data


def test_open_private_dir_refuses_what_is_not_private(tmp_path):
    # 1. missing: created 0700
    assert os.stat(open_private_dir(str(tmp_path / "new" / "tier"))).st_mode & 0o777 == 0o700
    # 2. a file, a symbolic link, a group-writable directory
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskDirError, match=r"'disk.path'.*not a directory"):
        open_private_dir(str(tmp_path / "file"))
    os.symlink(tmp_path / "new", tmp_path / "link")
    with pytest.raises(DiskDirError, match="symbolic links are refused"):
        open_private_dir(str(tmp_path / "link"))
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o777)
    with pytest.raises(DiskDirError, match="lets others write in it"):
        open_private_dir(str(tmp_path / "shared"))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    (tmp_path / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "theirs", 12345, 12345)
    with pytest.raises(DiskDirError, match="owned by uid 12345"):
        open_private_dir(str(tmp_path / "theirs"))
