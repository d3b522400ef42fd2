"""The disk tier's directory: private to this user, held by one engine at a time (no project imports).

`open_private_dir(path)` creates the directory 0700 when it is missing and refuses (`DiskDirError`, naming
`disk.path`, the value and what is allowed) one that is not a directory, not owned by this process's user,
writable by group or others, or not writable. `open_rank_dir` does the same for a rank's subdirectory.

One engine per directory: `DirectoryLock` takes an exclusive `flock` on `<path>/.lock` (released by the
kernel when the process dies, kill -9 included) and writes its pid there. A second engine pointed at the
same directory is refused with a `DiskDirError` naming the holder's pid: we chose refusal over sharing,
because one budget and one LRU order per directory is what lets eviction stay within `disk.bytes`. Within
one engine the scheduler holds the lock and the worker ranks (same engine) write their own subdirectories.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

LOCK_NAME = ".lock"
ALLOWED = "a directory owned by this user, not writable by group or others (created 0700 if missing)"


class DiskDirError(ValueError):
    """The disk tier cannot use its directory: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str, detail: str = "") -> None:
        self.key, self.value, self.allowed = key, value, allowed
        msg = f"invalid config key '{key}': got {value!r}; allowed: {allowed}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


def _check_private(path: str, key: str, shown: str) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskDirError(key, shown, ALLOWED, "not a directory (symbolic links are refused too)")
    if st.st_uid != os.geteuid():
        raise DiskDirError(key, shown, ALLOWED, f"owned by uid {st.st_uid}, this process runs as {os.geteuid()}")
    if st.st_mode & 0o022:
        raise DiskDirError(key, shown, ALLOWED, f"mode {stat.S_IMODE(st.st_mode):04o} lets others write in it")


def open_private_dir(path: str, key: str = "disk.path") -> str:
    """The absolute path of a private, writable directory at `path` (created 0700 when missing)."""
    full = os.path.abspath(path)
    try:
        if not os.path.lexists(full):
            os.makedirs(full, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise DiskDirError(key, path, ALLOWED, f"cannot create it: {exc.strerror}") from None
    _check_private(full, key, path)
    probe = os.path.join(full, f".probe.{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DiskDirError(key, path, ALLOWED + ", writable", f"cannot write in it: {exc.strerror}") from None
    return full


def open_rank_dir(root: str, name: str) -> str:
    """`root/name`, private (0700), created when missing."""
    path = os.path.join(root, name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise DiskDirError("disk.path", root, ALLOWED + ", writable", f"cannot create {name}: {exc.strerror}") from None
    _check_private(path, "disk.path", os.path.join(root, name))
    return path


class DirectoryLock:
    """An exclusive hold on a tier directory for this engine's lifetime (`release` or process exit)."""

    def __init__(self, root: str, shown: str) -> None:
        path = os.path.join(root, LOCK_NAME)
        # held on a read-only descriptor: no file stays open for writing (a filesystem can go read-only)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DiskDirError("disk.path", shown, "a directory no other running engine uses",
                                   f"held by the engine in process {holder}; give each engine its own") from None
            raise
        writer = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.write(writer, f"{os.getpid()}\n".encode())
        finally:
            os.close(writer)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
