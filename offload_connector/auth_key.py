"""Auth keys of the lower tiers (`disk.auth_key_file`, `remote.auth_key_file`): reading and checking the file.

A key is 16-64 bytes (BLAKE2b's key limit), read from a regular file of this process's user that nobody
else may read (mode 600 or stricter); surrounding whitespace is trimmed, so a hex line works. The config
sections check it at load time (`auth_key_problem`: nothing allocated yet); the tiers read it again when
they start (`load_auth_key`). Imports nothing from the project (config sections import it).
"""

from __future__ import annotations

import os
import stat

MIN_AUTH_KEY_BYTES = 16
MAX_AUTH_KEY_BYTES = 64  # BLAKE2b's key limit
AUTH_ALLOWED = (f"a path to a regular file of {MIN_AUTH_KEY_BYTES}-{MAX_AUTH_KEY_BYTES} secret bytes, "
                "mode 600, owned by this user (e.g. `head -c 32 /dev/urandom > key; chmod 600 key`)")


class AuthKeyError(ValueError):
    """An auth key file refused when a tier starts: names the config key, the path and why."""


def read_auth_key(path: str) -> bytes:
    """The key in `path`: raises ValueError saying why it is refused (callers name the config key)."""
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
    try:
        with open(path, "rb") as f:
            key = f.read(MAX_AUTH_KEY_BYTES + 1).strip()
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror}") from None
    if not MIN_AUTH_KEY_BYTES <= len(key) <= MAX_AUTH_KEY_BYTES:
        raise ValueError(f"{len(key)} bytes of key (after trimming whitespace)")
    return key


def auth_key_problem(config_key: str, path: str | None) -> tuple[str, object, str, str] | None:
    """(config key, path, allowed, why) when the key file at `path` is refused; None when it is fine or unset."""
    if path is None:
        return None
    try:
        read_auth_key(path)
    except ValueError as exc:
        return (config_key, path, AUTH_ALLOWED, str(exc))
    return None


def load_auth_key(config_key: str, path: str | None) -> bytes | None:
    """The key at `path` (None when unset), for a tier starting; `AuthKeyError` naming `config_key` when the
    file changed since the config was loaded and is refused now."""
    if path is None:
        return None
    try:
        return read_auth_key(path)
    except ValueError as exc:
        raise AuthKeyError(f"invalid config key '{config_key}': got {path!r}; allowed: {AUTH_ALLOWED} ({exc})") from None
