"""Keys and values of the remote tier (shared by both sides; imports only the shared
`tier_identity`, no torch).

Key, one per block per tensor-parallel rank:
    <namespace>:v1:<model fingerprint>:<layout fingerprint>:tp<rank>of<size>:g<group>:<block hash hex>
The cache key the connector uses is the block hash followed by the 4-byte group id (hashing.py), so the
chained hash (cache salt included) keeps tenants apart exactly as on the CPU tier. The fingerprints come
from the `TierIdentity` the adapter builds (tier_identity.py): instances share only byte-compatible blocks.

Value: a 24-byte header, then the block's bytes for that rank (host-pool order: `HostPool[cpu_block_id]`):
    magic b"OCKV" | version u16 | reserved u16 | payload length u64 | checksum u64   (little endian)
The checksum is xxh3-64 of the payload seeded with xxh3-64 of the key, so a value copied under another
key fails too. A value whose magic, version, length or checksum does not match is a miss (`decode_value`
returns why), and the caller deletes it.
"""

from __future__ import annotations

import struct

import xxhash

from offload_connector.tier_identity import TierIdentity

MAGIC = b"OCKV"
VERSION = 1
HEADER = struct.Struct("<4sHHQQ")
HEADER_BYTES = HEADER.size  # 24


def key_prefix(identity: TierIdentity, namespace: str) -> str:
    """The part of every key that names the deployment (`namespace`), the format version and the identity."""
    return f"{namespace}:v{VERSION}:{identity.model_fingerprint()}:{identity.layout_fingerprint()}"


def block_key(prefix: str, rank: int, world_size: int, cache_key: bytes) -> bytes:
    """The server key of one block (`cache_key`: block hash + 4-byte group id) for one rank."""
    group = int.from_bytes(cache_key[-4:], "big")
    return f"{prefix}:tp{rank}of{world_size}:g{group}:{cache_key[:-4].hex()}".encode()


def checksum(key: bytes, payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(key))


def encode_value(key: bytes, payload: bytes | memoryview) -> bytes:
    """Header + payload, ready for SET."""
    return HEADER.pack(MAGIC, VERSION, 0, len(payload), checksum(key, payload)) + bytes(payload)


def decode_value(key: bytes, blob: bytes, expected_len: int) -> tuple[memoryview | None, str]:
    """(payload, "") for a valid value of `expected_len` bytes, else (None, why it is refused)."""
    if len(blob) < HEADER_BYTES:
        return None, "shorter than the header"
    magic, version, _, length, check = HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        return None, "bad magic or version"
    if length != expected_len or len(blob) != HEADER_BYTES + length:
        return None, f"length {length} (value {len(blob) - HEADER_BYTES}) instead of {expected_len}"
    payload = memoryview(blob)[HEADER_BYTES:]
    if checksum(key, payload) != check:
        return None, "checksum mismatch"
    return payload, ""
