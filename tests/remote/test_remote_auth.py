"""`remote.auth_key_file`: signed records on a real redis-server, read by fake engines whose model verifies
every K/V byte (a wrong byte raises `IntegrityError`).

Engine A writes the prefixes' blocks (one record per KV head); engine B, with an empty CPU tier, then asks
for each prefix once, so its only source of those blocks is the server. With the same key B is served;
a record without the key (an engine without it, or a value forged with `SET` and a valid plain checksum),
or signed with another key, is a miss for B, counted in `corrupt_blocks` and deleted (B then computes the
block and writes its own). An engine without a key refuses a signed record too: it cannot check it.
"""

from __future__ import annotations

import os
import struct
import threading

import pytest
from redis_servers import redis_server  # noqa: F401 - fixture
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs, remote_config, worker_counter

from offload_connector.auth_key import AuthKeyError
from offload_connector.config import ConfigError, load_config
from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.engine import tier_identity
from offload_connector.fake_engine.model import IntegrityError
from offload_connector.fake_engine.workload import run_workload
from offload_connector.remote.format import HEADER, HEADER_BYTES, KEYED, MAC_BYTES, checksum, decode_value
from worker_side.tiers.remote_io import RemoteWorkerIO

SHARED = prefixes(31, 6)


def key_file(tmp_path, name: str, content: bytes | None = None, mode: int = 0o600) -> str:  # noqa: ANN001
    path = tmp_path / name
    path.write_bytes(os.urandom(32) if content is None else content)
    os.chmod(path, mode)
    return str(path)


def write_a(url: str, key: str | None) -> int:
    """Engine A computes the shared prefixes; its blocks are written to the server (signed with `key`)."""
    with FakeEngine(remote_config(url, auth_key_file=key)) as a:
        run_workload(a, one_per_prefix("a", SHARED, 1))
        clean(a)
        return worker_counter(a, "written_blocks")


def read_b(url: str, key: str | None, tag: str = "b", seed: int = 2) -> dict:
    """Engine B asks for each prefix once; every byte it reads is verified."""
    wl = one_per_prefix(tag, SHARED, seed)
    with FakeEngine(remote_config(url, auth_key_file=key)) as b:
        run_workload(b, wl)
        clean(b)
        out = {name: worker_counter(b, name) for name in ("fetched_blocks", "corrupt_blocks", "written_blocks")}
        out["hit_blocks"] = b.connector.tiers["remote"].counters.lookup_hit_blocks
        assert b.outputs == reference_outputs(wl)
    return out


def server_values(server) -> dict[bytes, bytes]:  # noqa: ANN001
    redis = pytest.importorskip("redis")
    client = redis.Redis(port=server.port)
    return {k: client.get(k) for k in client.scan_iter(count=1000)}


def test_same_key_is_served_and_every_record_is_signed(redis_server, tmp_path) -> None:  # noqa: F811
    key = key_file(tmp_path, "key")
    assert write_a(redis_server.url, key) > 0
    values = server_values(redis_server)
    part_bytes = len(next(iter(values.values()))) - HEADER_BYTES - MAC_BYTES
    secret = open(key, "rb").read().strip()
    for k, v in values.items():  # every head's record: flag, keyed hash, and valid only with the key
        assert HEADER.unpack_from(v)[2] == KEYED
        assert decode_value(k, v, part_bytes, secret)[1] == ""
        assert decode_value(k, v, part_bytes, b"x" * 32)[1].startswith("keyed hash mismatch")
    b = read_b(redis_server.url, key)
    assert b["hit_blocks"] > 0 and b["fetched_blocks"] == b["hit_blocks"] and b["corrupt_blocks"] == 0


@pytest.mark.parametrize("writer, reader", [
    (None, "key"),  # written by an engine without the key: a valid plain checksum, no keyed hash
    ("other", "key"),  # signed with another key
    ("key", None),  # signed, read by an engine without a key: it cannot check the hash, so a miss
])
def test_records_not_signed_with_the_readers_key_are_misses(redis_server, tmp_path, writer, reader) -> None:  # noqa: F811
    keys = {"key": key_file(tmp_path, "key"), "other": key_file(tmp_path, "other"), None: None}
    assert write_a(redis_server.url, keys[writer]) > 0
    b = read_b(redis_server.url, keys[reader])  # verified: no wrong byte, outputs as without the tier
    assert b["fetched_blocks"] == 0 and b["corrupt_blocks"] > 0
    # the refused records were deleted and B wrote its own blocks: the server now serves B's kind
    again = read_b(redis_server.url, keys[reader], "c", 3)
    assert again["fetched_blocks"] > 0 and again["corrupt_blocks"] == 0


def forge(server, how: str) -> int:  # noqa: ANN001
    """Replace every value on the server with other bytes under a valid plain checksum, as someone with
    write access to the server but without the key could: `plain` drops the keyed hash, `keep_hash` keeps
    the flag and the old hash. Returns how many values were forged."""
    redis = pytest.importorskip("redis")
    client = redis.Redis(port=server.port)
    values = server_values(server)
    for k, v in values.items():
        _, _, flags, length, _ = HEADER.unpack_from(v)
        start = len(v) - length
        payload = bytes(b ^ 0x5A for b in v[start:])  # other KV bytes
        check = checksum(k, payload)
        if how == "plain":
            value = HEADER.pack(b"OCKV", 1, 0, length, check) + payload
        else:
            value = HEADER.pack(b"OCKV", 1, flags, length, check) + v[HEADER_BYTES:start] + payload
        client.set(k, value)
    return len(values)


def test_a_forged_plain_record_would_be_wrong_bytes_without_the_key(redis_server, tmp_path) -> None:  # noqa: F811
    """The control for the test below: the forgery is a valid plain record carrying wrong K/V."""
    assert write_a(redis_server.url, None) > 0
    assert forge(redis_server, "plain") > 0
    with pytest.raises(IntegrityError):
        read_b(redis_server.url, None)


@pytest.mark.parametrize("how", ["plain", "keep_hash"])
def test_records_forged_with_set_are_misses_with_the_key(redis_server, tmp_path, how) -> None:  # noqa: F811
    key = key_file(tmp_path, "key")
    assert write_a(redis_server.url, key) > 0
    assert forge(redis_server, how) > 0
    b = read_b(redis_server.url, key)  # never a wrong byte: the model would raise IntegrityError
    assert b["fetched_blocks"] == 0 and b["corrupt_blocks"] > 0


# ---- config ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, mode, words", [
    (b"short", 0o600, "5 bytes of key"),
    (b"s" * 65, 0o600, "65 bytes of key"),
    (b"s" * 32, 0o644, "lets others read it"),
    (b"s" * 32, 0o640, "lets others read it"),
    (None, 0o600, "No such file"),
])
def test_bad_key_files_are_refused_at_load_naming_the_key(tmp_path, content, mode, words) -> None:
    path = key_file(tmp_path, "key", content, mode) if content is not None else str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="'remote.auth_key_file'") as err:
        load_config({"remote": {"url": "redis://127.0.0.1:6379/0", "auth_key_file": path}})
    assert words in str(err.value) and "16-64 secret bytes" in str(err.value)


def test_a_directory_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="'remote.auth_key_file'.*not a regular file"):
        load_config({"remote": {"url": "redis://127.0.0.1:6379/0", "auth_key_file": str(tmp_path)}})


def test_a_good_key_file_loads_and_trims_whitespace(tmp_path) -> None:
    path = key_file(tmp_path, "key", os.urandom(24).hex().encode() + b"\n")
    assert load_config({"remote": {"url": "redis://127.0.0.1:6379/0", "auth_key_file": path}}).remote.auth_key_file == path


def test_a_key_file_gone_when_the_tier_starts_raises_naming_the_key(tmp_path) -> None:
    path = key_file(tmp_path, "key")
    cfg = remote_config("redis://127.0.0.1:1/0", auth_key_file=path)  # never connected: it raises first
    os.chmod(path, 0o644)
    threads = threading.active_count()
    with pytest.raises(AuthKeyError, match="'remote.auth_key_file'.*lets others read it"):
        RemoteWorkerIO.create(cfg.remote, tier_identity(cfg), 0, 1, pool=None)  # type: ignore[arg-type]
    assert threading.active_count() == threads  # no I/O thread started


def test_keyed_hash_covers_header_and_key() -> None:
    """A signed value moved under another key, or with its header changed, fails the keyed hash too."""
    from offload_connector.remote.format import encode_value

    secret, payload = b"k" * 32, os.urandom(512)
    blob = encode_value(b"key-1", payload, secret)
    assert len(blob) == HEADER_BYTES + MAC_BYTES + len(payload)
    assert decode_value(b"key-1", blob, len(payload), secret) == (memoryview(payload), "")
    # another key: the seeded checksum fails first; recompute it and the keyed hash still fails
    moved = bytearray(blob)
    struct.pack_into("<Q", moved, 16, checksum(b"key-2", payload))
    assert decode_value(b"key-2", bytes(moved), len(payload), secret)[1].startswith("keyed hash mismatch")
    assert decode_value(b"key-1", blob, len(payload), None)[1].startswith("signed with a key")
    assert decode_value(b"key-1", encode_value(b"key-1", payload), len(payload), secret)[1].startswith("not signed")
    assert decode_value(b"key-1", blob[:4] + b"\x01\x00\x03\x00" + blob[8:], len(payload), secret)[1].startswith(
        "unknown flags")
