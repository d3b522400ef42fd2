"""Keys and values of the remote tier (shared by both sides; imports only the shared
`tier_identity`, no torch).

Key, one per *part* of a block:
    <namespace>:v1:<model fingerprint>:<layout fingerprint>:<part>:g<group>:<block hash hex>
A block is on the server when every one of its parts is (`BlockParts.labels`). The parts are, by the
identity (tier_identity.py):
- per KV head (`identity.kv_heads` = H > 0): parts `h0ofH` .. `h<H-1>ofH`, one per head of the whole
  model, the part's bytes that head's slice of the block (worker_side/tiers/head_rows.py); a rank writes
  and reads the parts of its heads only, so instances of any tensor-parallel size share every block;
- per rank (`kv_heads` = 0): parts `tp<rank>of<size>`, a rank's whole block bytes in host-pool order
  (`HostPool[cpu_block_id]`); instances share only with the same TP size.
The cache key the connector uses is the block hash followed by the 4-byte group id (hashing.py), so the
chained hash (cache salt included) keeps tenants apart exactly as on the CPU tier. The fingerprints come
from the `TierIdentity` the adapter builds (tier_identity.py): instances share only byte-compatible blocks.

Why one record per head rather than one record per block written in slices (SETRANGE): a record is
complete the moment it exists, so EXISTS answers "every byte is there" with no marker, no script and no
partial record a reader must tell from a whole one; each part carries its own checksum, verified alone;
SET NX EX keeps its meaning (first writer wins, TTL set atomically); and a block half written (one rank's
heads only) is simply a missing part. The cost is one key and one pipelined command per head instead of
per rank: docs/benchmarks.md measures it.

Value: a 24-byte header, then, when flag KEYED is set, a 32-byte keyed hash, then the part's bytes:
    magic b"OCKV" | version u16 | flags u16 | payload length u64 | checksum u64   (little endian)
The checksum is xxh3-64 of the payload seeded with xxh3-64 of the key, so a value copied under another
key fails too. With an auth key (`remote.auth_key_file`) the writer sets KEYED and adds BLAKE2b-256 keyed
with it over the header, the server key (which names the namespace, the model and layout fingerprints,
the part and the block) and the payload: a value forged without the key fails even with a valid checksum,
and so does one signed with another key. A reader with a key refuses an unsigned value, and one without a
key refuses a signed value (it cannot check it). A value whose magic, version, flags, length, checksum or
keyed hash does not match is a miss (`decode_value` returns why), and the caller deletes it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import xxhash

from offload_connector.tier_identity import TierIdentity, rank_heads

MAGIC = b"OCKV"
VERSION = 1
HEADER = struct.Struct("<4sHHQQ")
HEADER_BYTES = HEADER.size  # 24
KEYED = 1  # flag: a keyed hash follows the header
MAC_BYTES = 32
_KEY_LEN = struct.Struct("<H")


def key_prefix(identity: TierIdentity, namespace: str) -> str:
    """The part of every key that names the deployment (`namespace`), the format version and the identity."""
    return f"{namespace}:v{VERSION}:{identity.model_fingerprint()}:{identity.layout_fingerprint()}"


def block_key(prefix: str, part: str, cache_key: bytes) -> bytes:
    """The server key of one part (a `BlockParts` label) of one block (`cache_key`: block hash + 4-byte
    group id)."""
    group = int.from_bytes(cache_key[-4:], "big")
    return f"{prefix}:{part}:g{group}:{cache_key[:-4].hex()}".encode()


def rank_labels(world_size: int) -> tuple[str, ...]:
    """The parts of a block stored per rank (`kv_heads` = 0)."""
    return tuple(f"tp{r}of{world_size}" for r in range(world_size))


@dataclass(frozen=True, slots=True)
class BlockParts:
    """The parts every block has on the server (`labels`, the lookups check them all) and the ones this
    rank writes and reads (`labels[first:last]`, in the order of its bytes)."""

    labels: tuple[str, ...]
    first: int
    last: int

    @classmethod
    def of(cls, identity: TierIdentity, rank: int, world_size: int) -> BlockParts:
        if identity.kv_heads:
            first, last = rank_heads(identity.kv_heads, rank, world_size)
            heads = identity.kv_heads
            return cls(tuple(f"h{h}of{heads}" for h in range(heads)), first, last)
        return cls(rank_labels(world_size), rank, rank + 1)

    @property
    def mine(self) -> tuple[str, ...]:
        return self.labels[self.first:self.last]


def checksum(key: bytes, payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(key))


def keyed_hash(auth_key: bytes, header: bytes | memoryview, key: bytes, payload: bytes | memoryview) -> bytes:
    """BLAKE2b-256 keyed with `auth_key` over the header, the server key (length first) and the payload."""
    mac = hashlib.blake2b(header, key=auth_key, digest_size=MAC_BYTES)
    mac.update(_KEY_LEN.pack(len(key)))
    mac.update(key)
    mac.update(payload)
    return mac.digest()


def encode_value(key: bytes, payload: bytes | memoryview, auth_key: bytes | None = None) -> bytes:
    """Header (+ keyed hash with `auth_key`) + payload, ready for SET."""
    header = HEADER.pack(MAGIC, VERSION, KEYED if auth_key is not None else 0, len(payload), checksum(key, payload))
    if auth_key is None:
        return b"".join((header, payload))
    return b"".join((header, keyed_hash(auth_key, header, key, payload), payload))


def decode_value(key: bytes, blob: bytes, expected_len: int,
                 auth_key: bytes | None = None) -> tuple[memoryview | None, str]:
    """(payload, "") for a valid value of `expected_len` bytes (signed with `auth_key` when given, unsigned
    when not), else (None, why it is refused)."""
    if len(blob) < HEADER_BYTES:
        return None, "shorter than the header"
    magic, version, flags, length, check = HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        return None, "bad magic or version"
    if flags & ~KEYED:
        return None, f"unknown flags {flags:#x}"
    if flags & KEYED and auth_key is None:
        return None, "signed with a key (no remote.auth_key_file here)"
    if not flags & KEYED and auth_key is not None:
        return None, "not signed (remote.auth_key_file is set)"
    start = HEADER_BYTES + (MAC_BYTES if auth_key is not None else 0)
    if length != expected_len or len(blob) != start + length:
        return None, f"length {length} (value {len(blob) - start}) instead of {expected_len}"
    payload = memoryview(blob)[start:]
    if checksum(key, payload) != check:
        return None, "checksum mismatch"
    if auth_key is not None and not hmac.compare_digest(
            keyed_hash(auth_key, memoryview(blob)[:HEADER_BYTES], key, payload), blob[HEADER_BYTES:start]):
        return None, "keyed hash mismatch (forged, or signed with another key)"
    return payload, ""
