"""EIO from a real block device under the disk tier: a read that fails is a miss (the block dropped from
the index), a write that fails is a failed store; one warning, the breaker steps aside, the engine goes on,
nothing leaks.

The tier's directory is on an ext4 filesystem ("inner") whose loop device is backed by an image file on a
second ext4 filesystem ("outer"). `FailingDisk.fail()` shuts the outer filesystem down (EXT4_IOC_SHUTDOWN,
the ioctl xfstests uses to take a device away): from then on every read and write the loop device passes to
its backing file fails, and the inner filesystem's I/O returns EIO, as a dying disk's does (the kernel logs
"Buffer I/O error on device loopN"). Nothing is mocked: the kernel's own I/O path makes each error. The
device mapper's `error` target would be the textbook way; this machine has no device mapper, and the
shutdown needs only loop devices. Needs root with CAP_SYS_ADMIN, loop devices and mkfs.ext4: without them
the tests skip, saying which is missing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from disk_helpers import fill, key, make_io, make_pool, run
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import run_workload, small_config

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2
SHARED = prefixes(7, 6)


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


class FailingDisk:
    """An ext4 filesystem on a loop device that `fail()` turns into a device answering EIO."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.outer, self.inner = base / "outer", base / "inner"
        self.path = self.inner / "kv"  # the tier's directory
        self._mounted: list[Path] = []

    def __enter__(self) -> FailingDisk:
        if os.geteuid() != 0:
            pytest.skip("a loop-device filesystem needs root")
        missing = [t for t in ("mkfs.ext4", "mount", "umount") if shutil.which(t) is None]
        if missing or not os.path.exists("/dev/loop-control"):
            pytest.skip(f"needs loop devices and {', '.join(missing) or 'mkfs.ext4'}")
        try:
            self._make(self.base / "outer.img", 64, self.outer, journal=True)
            # no journal on the inner filesystem: an I/O error cannot abort a journal and turn it read-only
            # (EROFS) before the tier sees the EIO itself
            self._make(self.outer / "inner.img", 32, self.inner, journal=False)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _make(self, image: Path, mib: int, mount_at: Path, journal: bool) -> None:
        with open(image, "wb") as f:
            f.truncate(mib << 20)
        made = _sh("mkfs.ext4", "-q", "-F", *(() if journal else ("-O", "^has_journal")), str(image))
        if made.returncode:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        mount_at.mkdir()
        self._mount(image, mount_at)

    def _mount(self, image: Path, mount_at: Path) -> None:
        done = _sh("mount", "-o", "loop,noatime", str(image), str(mount_at))
        if done.returncode:
            pytest.skip(f"cannot mount a loop device here: {done.stderr.strip()}")
        self._mounted.append(mount_at)

    def remount(self) -> None:
        """Unmount and mount the inner filesystem again: nothing of it stays in the page cache, so the
        next reads go to the device."""
        self._umount(self.inner)
        self._mount(self.outer / "inner.img", self.inner)

    def evict(self) -> None:
        """Drop the inner filesystem's file pages from the page cache (POSIX_FADV_DONTNEED, what memory
        pressure does): the next reads of their data go to the device; their inodes stay in memory."""
        for path in self.inner.rglob("*"):
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def fail(self) -> None:
        fd = os.open(self.outer, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def _umount(self, mount_at: Path) -> None:
        if _sh("umount", str(mount_at)).returncode:
            _sh("umount", "-l", str(mount_at))
        self._mounted.remove(mount_at)

    def __exit__(self, *exc: object) -> None:
        for mount_at in reversed(list(self._mounted)):
            self._umount(mount_at)


def disk_config(path, **disk):  # noqa: ANN001, ANN201
    return small_config(num_gpu_blocks=32, num_cpu_blocks=48,
                        disk={"path": str(path), "bytes": "64MiB", "write": "on_store", **disk})


def counters(engine: FakeEngine) -> dict[str, int]:
    tier = engine.connector.tiers["disk"]
    return dict(zip(tier.COUNTERS, tier.counter_values(), strict=True)) | tier.gauges()


def disk_warnings(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "disk tier" in r.getMessage()]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_eio_on_read_is_a_miss_and_the_engine_goes_on(tmp_path, caplog):
    wl = one_per_prefix("b", SHARED, 2)
    expected = reference_outputs(wl)
    with FailingDisk(tmp_path) as disk:
        with FakeEngine(disk_config(disk.path)) as a:  # engine A writes the prefixes' records
            run_workload(a, one_per_prefix("a", SHARED, 1))
            clean(a)
            records = counters(a)["records"]
        assert records > 0
        disk.remount()
        fds = open_fds()
        with caplog.at_level(logging.WARNING), FakeEngine(disk_config(disk.path)) as b:
            assert b.connector.tiers["disk"].wait_scan(30)  # the scan found them ...
            disk.evict()  # ... their data is no longer in memory ...
            disk.fail()  # ... and can no longer be read
            run_workload(b, wl)
            clean(b)
            c = counters(b)
        assert open_fds() == fds  # no descriptor left open
    assert b.outputs == expected  # the engine computed what it could not read
    assert c["scanned_blocks"] == records and c["read_blocks"] == 0 and b.stats.cpu_hit_tokens == 0
    # the index forgot each block it failed to read (B computed them, and wrote them anew)
    assert c["read_failed_blocks"] > 0 and c["dropped_blocks"] == c["read_failed_blocks"]
    warnings = disk_warnings(caplog)
    assert len(warnings) == 1 and "read failed" in warnings[0] and "EIO" in warnings[0], warnings
    assert c["errors"] >= 1 and c["breaker_trips"] == 1


def test_eio_on_write_is_a_failed_store(tmp_path, caplog):
    """The fake engine's small pool is not page aligned, so the tier writes through the page cache; with
    `fsync: true` the device's EIO reaches the write (without it a buffered write's error comes at writeback,
    after the record is in place: a later read of it is EIO or a checksum failure, a miss either way). The
    direct-I/O path, where `pwritev` itself fails, is `test_eio_in_the_tiers_io_threads`."""
    wl = one_per_prefix("a", SHARED, 1)
    with FailingDisk(tmp_path) as disk:
        fds = open_fds()
        with caplog.at_level(logging.WARNING), FakeEngine(disk_config(disk.path, fsync=True)) as a:
            disk.fail()
            run_workload(a, wl)
            clean(a)
            c = counters(a)
        assert open_fds() == fds
    assert a.outputs == reference_outputs(wl)
    assert c["written_blocks"] == 0 and c["records"] == 0 and c["dropped_writes"] > 0  # nothing became visible
    assert c["errors"] >= 1 and c["breaker_trips"] == 1
    warnings = disk_warnings(caplog)
    assert len(warnings) == 1 and "write failed" in warnings[0] and "EIO" in warnings[0], warnings


@pytest.mark.parametrize("direct_io", [True, False])
def test_eio_in_the_tiers_io_threads(tmp_path, caplog, direct_io):
    """One level down, on the tier's I/O alone with a page-aligned pool (O_DIRECT, the default, or
    buffered): a read's EIO (the file opened, its data unreadable) fails that block only and trips the read
    breaker; a write's EIO (at the write, or at the fsync for buffered I/O: without fsync a buffered write
    reaches the device later) fails the block and leaves no file; every descriptor and copy slot is back."""
    pool = make_pool(block_size=16, heads=2, head_dim=64)  # 4 KiB planes: O_DIRECT possible
    with FailingDisk(tmp_path) as disk:
        io = make_io(disk.path, pool, direct_io=direct_io, fsync=not direct_io, io_threads=2)
        assert io.direct == direct_io
        for i in (1, 2, 3):
            fill(pool, i, seed=i)
        assert run(io, "write", 0, [1, 2, 3], [key(1), key(2), key(3)]).failed_keys == []
        io.close()
        disk.remount()
        fds = open_fds()
        io = make_io(disk.path, pool, direct_io=direct_io, fsync=not direct_io, io_threads=2)
        for i in (1, 2, 3):
            os.stat(os.path.join(io.dir, f"{key(i).hex()}.kv"))  # the inodes are in memory ...
        disk.evict()  # ... the data is not
        disk.fail()
        with caplog.at_level(logging.WARNING):
            read = run(io, "read", 1, [4, 5], [key(1), key(2)])
            write = run(io, "write", 2, [3], [key(9)])
        assert sorted(read.failed_keys) == [key(1), key(2)] and read.dropped_keys == []
        assert write.failed_keys == [key(9)] and io.counters.dropped_writes == 1
        assert io.counters.read_failed_blocks == 2 and io.counters.read_blocks == 0
        assert io.counters.breaker_trips == 2 and io.read_breaker.state == io.write_breaker.state == "open"
        warnings = disk_warnings(caplog)
        assert len(warnings) == 2 and all("EIO" in w for w in warnings), warnings
        # the tier stepped aside: a further read fails at once, without touching the device
        errors = io.counters.errors
        assert run(io, "read", 3, [6], [key(3)]).failed_keys == [key(3)] and io.counters.errors == errors
        assert not any(n.endswith(".tmp") for n in os.listdir(io.dir))
        io.close()
        assert open_fds() == fds
        assert io._snapshots.num_free == io._snapshots.num_slots
