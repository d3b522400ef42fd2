"""What makes two instances' blocks byte-compatible, for every tier below the CPU tier (shared by both sides).

A lower tier outlives the process (a Redis server, a directory): a block found there is KV only if the
instance that wrote it ran the same model with the same block layout. The adapter builds one
`TierIdentity` (vLLM: offload_connector/vllm/tier_identity.py; the fake engine its own) and hands the same
one to the scheduler and to every worker rank; each tier puts `model_fingerprint()` and
`layout_fingerprint()` into its keys or records and treats anything written under other fingerprints as a
miss. Imports nothing from the project, no torch.
"""

from __future__ import annotations

import msgspec
import xxhash


class TierIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """The model and block layout one instance's blocks are made of. Built by the adapter, equal on both sides."""

    model: str  # model name or path
    revision: str = ""
    dtype: str = ""  # the model's dtype
    kv_cache_dtype: str = ""  # the KV cache's dtype ("auto" resolved when the adapter knows it)
    block_size: int  # tokens per block
    hash_algo: str  # the block-hash function (and its seed, below): equal tokens must give equal keys
    hash_seed: str = ""
    layout: str  # per-rank block layout: layers, shapes and dtypes of the KV tensors, in host-pool order

    def model_fingerprint(self) -> str:
        fields = (self.model, self.revision, self.dtype, self.kv_cache_dtype, self.block_size, self.hash_algo,
                  self.hash_seed)
        return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(fields))

    def layout_fingerprint(self) -> str:
        return xxhash.xxh3_64_hexdigest(self.layout.encode())
