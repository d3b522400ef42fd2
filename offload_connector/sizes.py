"""Sizes in a config (`cpu_bytes`, `disk.bytes`, ...): an int of bytes, or a number with one of the units
docs/configuration.md documents, in its case. `parse_size` returns a `Size`, an int that remembers how the
user wrote it, so that a later refusal (too small for two blocks, too large for the host) echoes `'8B'` and
not `8`. Imports nothing from the project but `ConfigError`.
"""

from __future__ import annotations

import re

from offload_connector.config_errors import ConfigError


class Size(int):
    """A size in bytes that remembers how it was written (`8`, `"8B"`, `"64MiB"`): messages echo that."""

    written: int | str

    def __new__(cls, size: int, written: int | str) -> Size:
        out = super().__new__(cls, size)
        out.written = written
        return out


def written(size: int | str) -> int | str:
    """What the user wrote for a size (a `Size`), or the value itself."""
    return size.written if isinstance(size, Size) else size


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)?\s*$", re.ASCII)
MAX_SIZE = 1 << 60  # 1 EiB: anything larger is a typo, not a machine
# The units docs/configuration.md documents, in its case: "64mb" or "8gib" is refused, never guessed.
SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
SIZE_ALLOWED = ('a positive int (bytes) or a number with a unit, written in this case: B, KB, MB, GB, TB (powers of 10) '
                'or KiB, MiB, GiB, TiB (powers of 2), e.g. "512MiB", "8GiB", "1.5GiB"')


def parse_size(key: str, value: int | str) -> Size:
    """Parse a size (int bytes, or a number and one of `SIZE_UNITS` as documented) into a positive `Size`
    that remembers `value`, or raise ConfigError echoing `value`."""
    if isinstance(value, bool):
        raise ConfigError(key, value, SIZE_ALLOWED)
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(value)
        if m is None:
            raise ConfigError(key, value, SIZE_ALLOWED, "malformed size string")
        unit = m.group(2) or "B"
        if unit not in SIZE_UNITS:
            raise ConfigError(key, value, SIZE_ALLOWED, f"unknown unit {unit!r}", guess=_unit_guess(m.group(1), unit))
        number = float(m.group(1))
        if number * SIZE_UNITS[unit] > MAX_SIZE:  # float: inf for absurd digit strings
            raise ConfigError(key, value, SIZE_ALLOWED + " up to 1 EiB", "size too large")
        size = int(number * SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(key, value, SIZE_ALLOWED, "size must be positive")
    if size > MAX_SIZE:
        raise ConfigError(key, value, SIZE_ALLOWED + " up to 1 EiB", "size too large")
    return Size(size, value)


def _unit_guess(number: str, unit: str) -> str:
    """The documented units `unit` differs from only in case, an "i" or a "B" ("mb", "G"), as '64MiB' or '64MB'."""
    def fold(u: str) -> str:
        return u.lower().replace("i", "").removesuffix("b")

    close = [u for u in SIZE_UNITS if fold(u) == fold(unit) and u != "B"]
    return " or ".join(repr(f"{number}{u}") for u in sorted(close, key=lambda u: "i" not in u))
