"""The `disk:` config section: a local directory under the CPU tier (docs/configuration.md, `disk:`).

Absent (the default) means no disk tier. Present, `path` is required. `validate_disk` raises the first
problem through the `ConfigError` that `config.py` hands it (this module imports nothing from the
project). After `load_config`, `bytes` and `max_inflight_bytes` are ints. The directory itself is checked when the tier starts (`directory.open_private_dir`), never at load time:
`offload-connector check` creates nothing.

Words: *read* is disk -> host pool, *write* is host pool -> disk (store and load keep their meaning).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec

MIN_AUTH_KEY_BYTES = 16
MAX_AUTH_KEY_BYTES = 64  # BLAKE2b's key limit


class DiskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str  # the directory (created 0700 if missing); relative paths start at the working directory
    bytes: int | str = "16GiB"  # the tier's budget for this model's records, all ranks together
    # on_cpu_evict: a block is written when the CPU tier evicts it (write-back: CPU and disk hold different
    # blocks); on_store: every block stored to the CPU tier is written too (write-through). The default by
    # measurement: docs/benchmarks.md, "Disk tier"
    write: Literal["on_store", "on_cpu_evict"] = "on_cpu_evict"
    auth_key_file: str | None = None  # a file of 16-64 secret bytes: every record carries a keyed BLAKE2b
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4  # per rank: reads and writes in parallel
    direct_io: bool = True  # O_DIRECT where the pool's rows are page aligned (docs/benchmarks.md, bench_disk)
    fsync: bool = False  # fsync each record before it becomes visible (survives power loss; slower)
    max_inflight_bytes: int | str = "256MiB"  # per rank: bytes queued for writing; beyond it writes drop
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=600000)] = 2000  # a request waits this long for a read
    # start-up waits at most this long for the scan of the records on disk; the rest of it runs meanwhile
    scan_wait_ms: Annotated[int, msgspec.Meta(ge=0, le=600000)] = 2000
    max_waiting_requests: Annotated[int, msgspec.Meta(ge=1)] = 64
    breaker_backoff_ms: Annotated[int, msgspec.Meta(ge=1)] = 1000  # first pause after an I/O failure (doubles)
    breaker_max_backoff_ms: Annotated[int, msgspec.Meta(ge=1)] = 60000


def read_auth_key(path: str) -> bytes:
    """The key in `path`: raises ValueError saying why it is refused (callers name the key)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"cannot stat it: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(f"mode {stat.S_IMODE(st.st_mode):04o} lets others read it; chmod 600 it")
    if st.st_uid != os.geteuid():
        raise ValueError(f"owned by uid {st.st_uid}, not this process's user ({os.geteuid()})")
    with open(path, "rb") as f:
        key = f.read(MAX_AUTH_KEY_BYTES + 1).strip()
    if not MIN_AUTH_KEY_BYTES <= len(key) <= MAX_AUTH_KEY_BYTES:
        raise ValueError(f"{len(key)} bytes of key (after trimming whitespace)")
    return key


AUTH_ALLOWED = (f"a path to a regular file of {MIN_AUTH_KEY_BYTES}-{MAX_AUTH_KEY_BYTES} secret bytes, "
                "mode 600, owned by this user (e.g. `head -c 32 /dev/urandom > key; chmod 600 key`)")


def validate_disk(disk: DiskConfig, parse_size: Callable[[str, int | str], int], error: type[Exception]) -> None:
    """Raise `error(key, value, allowed, detail)` for the first problem; parse the sizes in place."""
    problem = check_disk(disk)
    if problem is not None:
        raise error(*problem)
    disk.bytes = parse_size("disk.bytes", disk.bytes)
    disk.max_inflight_bytes = parse_size("disk.max_inflight_bytes", disk.max_inflight_bytes)


def check_disk(disk: DiskConfig) -> tuple[str, object, str, str] | None:
    """The first problem in a parsed `disk:` section, or None (sizes are parsed by `validate_disk`)."""
    if not disk.path or "\0" in disk.path:
        return ("disk.path", disk.path, "a non-empty directory path", "")
    if disk.auth_key_file is not None:
        try:
            read_auth_key(disk.auth_key_file)
        except ValueError as exc:
            return ("disk.auth_key_file", disk.auth_key_file, AUTH_ALLOWED, str(exc))
    if disk.breaker_max_backoff_ms < disk.breaker_backoff_ms:
        return ("disk.breaker_max_backoff_ms", disk.breaker_max_backoff_ms,
                f">= disk.breaker_backoff_ms ({disk.breaker_backoff_ms})", "")
    return None
