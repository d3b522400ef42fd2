"""The `disk:` config section: off by default, every bad value refused at load time naming the key."""

from __future__ import annotations

import os

import pytest

from offload_connector.config import ConfigError, load_config


def test_off_by_default_and_sizes_parsed():
    assert load_config({}).disk is None
    disk = load_config({"disk": {"path": "kv", "bytes": "2GiB", "max_inflight_bytes": "64MiB"}}).disk
    assert (disk.path, disk.bytes, disk.max_inflight_bytes, disk.write) == ("kv", 2 << 30, 64 << 20, "on_cpu_evict")


def key_file(tmp_path, content: bytes, mode: int = 0o600) -> str:  # noqa: ANN001
    path = tmp_path / "key"
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("section, key, words", [
    ({"bytes": "1GiB"}, "disk", "missing required field `path`"),
    ({"path": ""}, "disk.path", "non-empty directory path"),
    ({"path": "kv", "bytes": "lots"}, "disk.bytes", "malformed size"),
    ({"path": "kv", "bytes": 0}, "disk.bytes", "must be positive"),
    ({"path": "kv", "write": "sometimes"}, "disk.write", "'on_store' | 'on_cpu_evict'"),
    ({"path": "kv", "io_threads": 0}, "disk.io_threads", ">= 1"),
    ({"path": "kv", "colour": "blue"}, "disk.colour", "known keys here: path, bytes"),
    ({"path": "kv", "breaker_backoff_ms": 10, "breaker_max_backoff_ms": 5}, "disk.breaker_max_backoff_ms", ">= disk"),
    ({"path": "kv", "auth_key_file": "/no/such/key"}, "disk.auth_key_file", "No such file"),
])
def test_bad_values_name_the_key(section, key, words):
    with pytest.raises(ConfigError, match=f"'{key}'") as err:
        load_config({"disk": section})
    assert words in str(err.value)


@pytest.mark.parametrize("content, mode, words", [
    (b"short", 0o600, "5 bytes of key"),
    (b"s" * 32, 0o644, "lets others read it"),
])
def test_auth_key_files_that_are_refused(tmp_path, content, mode, words):
    with pytest.raises(ConfigError, match="'disk.auth_key_file'") as err:
        load_config({"disk": {"path": "kv", "auth_key_file": key_file(tmp_path, content, mode)}})
    assert words in str(err.value)


def test_a_good_auth_key_file_loads(tmp_path):
    path = key_file(tmp_path, os.urandom(32).hex().encode()[:48])
    assert load_config({"disk": {"path": "kv", "auth_key_file": path}}).disk.auth_key_file == path
