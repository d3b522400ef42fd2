"""Chained block hashes.

A full block's hash covers its parent's hash, its tokens and its extra keys (cache salt, LoRA name,
multimodal ids), so equal hashes mean equal prefixes. Partial blocks have no hash. Hashes are bytes,
computed from a stable serialization (never Python's `hash()`), so they agree across processes.

The cache key the connector uses is a `BlockHashWithGroupId`: the block hash followed by the KV-cache
group id as 4 big-endian bytes, the same shape as vLLM's `make_block_hash_with_group_id` (group 0 for
single-group models). With vLLM, the engine's own `request.block_hashes` are used and only the group id
is appended here.

Imports nothing from the project and no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NewType

import msgspec
import xxhash

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

HASH_ALGOS = ("xxh3_128", "sha256")
_ROOT = b"offload-connector/root/v1"
_encoder = msgspec.msgpack.Encoder()


def _digest(algo: str, payload: bytes) -> bytes:
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest(payload)
    if algo == "sha256":
        return hashlib.sha256(payload).digest()
    raise ValueError(f"unknown hash_algo {algo!r}; allowed: {', '.join(HASH_ALGOS)}")


def hash_block_tokens(
    parent: BlockHash | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    algo: str = "xxh3_128",
) -> BlockHash:
    """Hash one full block: parent hash (a fixed root for the first block), tokens, extra keys."""
    payload = _encoder.encode((parent or _ROOT, list(tokens), list(extra_keys) if extra_keys else None))
    return BlockHash(_digest(algo, payload))


def hash_request_tokens(
    tokens: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    extra_keys: tuple[Any, ...] | None = None,
    algo: str = "xxh3_128",
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of `tokens`, from block index `start` on.

    `parent` must be the hash of block `start - 1` when `start > 0`. The cache salt only enters the
    first block's extra keys (as in vLLM), which is enough to separate tenants for the whole chain.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start > 0 and parent is None:
        raise ValueError(f"hash_request_tokens(start={start}) needs the parent hash of block {start - 1}")
    out: list[BlockHash] = []
    for i in range(start, len(tokens) // block_size):
        keys = extra_keys
        if i == 0 and cache_salt is not None:
            keys = (cache_salt,) + (extra_keys or ())
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], keys, algo)
        out.append(parent)
    return out


def with_group_id(block_hash: bytes, group_id: int = 0) -> BlockHashWithGroupId:
    """The connector's cache key: a block hash plus the KV-cache group id it belongs to."""
    suffix = group_suffix(group_id)
    return BlockHashWithGroupId(block_hash + suffix if type(block_hash) is bytes else bytes(block_hash) + suffix)


def group_suffix(group_id: int) -> bytes:
    """What `with_group_id` appends: per-block loops over `bytes` hashes (vLLM's and ours) inline
    `block_hash + group_suffix(group_id)` instead of calling it."""
    return _GROUP_SUFFIX[group_id] if group_id < len(_GROUP_SUFFIX) else group_id.to_bytes(4, "big")


_GROUP_SUFFIX = tuple(g.to_bytes(4, "big") for g in range(16))
