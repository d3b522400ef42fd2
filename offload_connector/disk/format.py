"""Records of the disk tier: one file per block per tensor-parallel rank (shared by both sides; no torch).

Where: `<disk.path>/<rank fingerprint hex>/<cache key hex>.kv`. The rank fingerprint (16 bytes) is
xxh3-128 of the model fingerprint, the layout fingerprint (`TierIdentity`: model, revision, dtypes,
block size, hash algorithm and seed, per-rank layout) and `tp<rank>of<size>`: another model, layout or
rank never even looks in this directory, and a record copied into it still fails the header check.

A record: a `HEADER_BYTES` (4096) header region, then the payload (the block's bytes for this rank in
host-pool order: `HostPool[cpu_block_id]`), then zeros up to a multiple of 4096 (so O_DIRECT can read
and write whole records). The header, little endian:
    magic b"OCDK" | version u16 | flags u16 | payload length u64 | fingerprint 16s | key length u16 |
    checksum u64 | mac 32s | key (key length bytes; the cache key: block hash + 4-byte group id)
`checksum` is xxh3-64 over the whole header region (zeros after the key) with checksum and mac zeroed,
then the payload; readers also check the padding after the payload is zero: any flipped byte is refused. With an auth key,
flag KEYED is set and `mac` is BLAKE2b-256 keyed with it over the same bytes: a record forged without the
key fails even with a valid checksum. `Verifier` checks a record against what the reader expects (key,
fingerprint, length, key or no key) and says why it refuses one; a refused record is a miss, never KV.

Writers make a record visible only complete: written under a temporary name (`.tmp`), then renamed
(atomic on POSIX); with `disk.fsync` the data is flushed before the rename.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable

import xxhash

from offload_connector.tier_identity import TierIdentity

MAGIC = b"OCDK"
VERSION = 1
KEYED = 1
HEADER_BYTES = 4096  # the payload starts on a page: O_DIRECT can move it straight into the host pool
ALIGN = 4096
_FIXED = struct.Struct("<4sHHQ16sH")  # magic, version, flags, payload length, fingerprint, key length
_CHECK = struct.Struct("<Q32s")  # checksum, mac
_KEY_AT = _FIXED.size + _CHECK.size
MAX_KEY_BYTES = 64
SUFFIX, TMP_SUFFIX = ".kv", ".tmp"


def align_up(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


def record_bytes(payload_bytes: int) -> int:
    """Bytes one record takes on disk (header region + payload + padding)."""
    return HEADER_BYTES + align_up(payload_bytes)


def rank_fingerprint(identity: TierIdentity, rank: int, world_size: int) -> bytes:
    """16 bytes naming the model, the per-rank layout and the rank: records are shared only within it."""
    text = f"{identity.model_fingerprint()}:{identity.layout_fingerprint()}:tp{rank}of{world_size}"
    return xxhash.xxh3_128_digest(text.encode())


def rank_dir_name(fingerprint: bytes) -> str:
    return fingerprint.hex()


def record_name(cache_key: bytes) -> str:
    return cache_key.hex() + SUFFIX


def key_of_name(name: str) -> bytes | None:
    """The cache key a record file name stands for, or None when the name is not a record's."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None


class Sealer:
    """Builds headers: `seal(key, segments)` hashes the payload given as segments (any buffers, in order)."""

    def __init__(self, fingerprint: bytes, auth_key: bytes | None) -> None:
        if len(fingerprint) != 16:
            raise ValueError(f"fingerprint of {len(fingerprint)} bytes; expected 16 (our bug)")
        self.fingerprint, self.auth_key = fingerprint, auth_key

    def digests(self, region: bytes | bytearray, segments: Iterable[object]) -> tuple[int, bytes]:
        """(checksum, mac) over a header region whose checksum and mac are zeroed, then the payload."""
        check = xxhash.xxh3_64(region)
        mac = hashlib.blake2b(region, key=self.auth_key, digest_size=32) if self.auth_key else None
        for seg in segments:
            check.update(seg)
            if mac is not None:
                mac.update(seg)
        return check.intdigest(), (mac.digest() if mac is not None else bytes(32))

    def seal(self, key: bytes, segments: list, payload_bytes: int) -> bytes:
        """The header region (`HEADER_BYTES` bytes) of the record of `key` with payload `segments`."""
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"cache key of {len(key)} bytes; at most {MAX_KEY_BYTES} (our bug)")
        fixed = _FIXED.pack(MAGIC, VERSION, KEYED if self.auth_key else 0, payload_bytes, self.fingerprint, len(key))
        region = bytearray(HEADER_BYTES)
        region[:_FIXED.size] = fixed
        region[_KEY_AT:_KEY_AT + len(key)] = key
        _CHECK.pack_into(region, _FIXED.size, *self.digests(region, segments))
        return bytes(region)


class Verifier(Sealer):
    """Checks records against what the reader expects; every refusal says why."""

    def check_header(self, header: bytes | memoryview, key: bytes | None, payload_bytes: int | None) -> str:
        """'' when the header is one of ours for `key` (any key when None) and `payload_bytes` (any length
        when None), else why not. Cheap (no payload): the index scan uses it; reads add `check_payload`."""
        if len(header) < _FIXED.size + _CHECK.size:
            return "shorter than a header"
        magic, version, flags, length, fingerprint, key_len = _FIXED.unpack_from(header)
        if magic != MAGIC or version != VERSION:
            return "bad magic or version"
        if fingerprint != self.fingerprint:
            return "foreign: another model, layout or rank (fingerprint)"
        if payload_bytes is not None and length != payload_bytes:
            return f"payload length {length} instead of {payload_bytes}"
        if key_len > MAX_KEY_BYTES:
            return f"key length {key_len}"
        found = bytes(header[_KEY_AT:_KEY_AT + key_len])
        if key is not None and found != key:
            return "foreign: a record of another key under this name"
        if bool(flags & KEYED) != (self.auth_key is not None):
            return "foreign: signed with a key" if flags & KEYED else "foreign: not signed (an auth key is set)"
        return ""

    @staticmethod
    def payload_length(header: bytes | memoryview) -> int:
        return _FIXED.unpack_from(header)[3]

    def check_payload(self, header: bytes | memoryview, segments: list) -> str:
        """'' when the checksum (and mac, when keyed) over the header and `segments` match; else why not.
        Call after `check_header` passed."""
        if len(header) != HEADER_BYTES:
            return f"header of {len(header)} bytes"
        check, mac = _CHECK.unpack_from(header, _FIXED.size)
        region = bytearray(header)
        region[_FIXED.size:_KEY_AT] = bytes(_CHECK.size)
        got_check, got_mac = self.digests(region, segments)
        if got_check != check:
            return "checksum mismatch"
        if self.auth_key is not None and not hmac.compare_digest(got_mac, mac):
            return "foreign: keyed hash mismatch (forged or another key)"
        return ""
