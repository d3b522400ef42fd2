"""The `disk:` config section: a local directory under the CPU tier (docs/configuration.md, `disk:`).

Absent (the default) means no disk tier. Present, `path` is required. `validate_disk` raises the first
problem through the `ConfigError` that `config.py` hands it (this module imports only the leaf
`auth_key.py` from the project). After `load_config`, `bytes` and `max_inflight_bytes` are ints. The directory itself is checked when the tier starts (`directory.open_private_dir`), never at load time:
`offload-connector check` creates nothing.

Words: *read* is disk -> host pool, *write* is host pool -> disk (store and load keep their meaning).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import msgspec

from offload_connector.auth_key import auth_key_problem


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
    if (problem := auth_key_problem("disk.auth_key_file", disk.auth_key_file)) is not None:
        return problem
    if disk.breaker_max_backoff_ms < disk.breaker_backoff_ms:
        return ("disk.breaker_max_backoff_ms", disk.breaker_max_backoff_ms,
                f">= disk.breaker_backoff_ms ({disk.breaker_backoff_ms})", "")
    return None
