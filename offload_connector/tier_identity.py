"""What makes two instances' blocks byte-compatible, for every tier below the CPU tier (shared by both sides).

A lower tier outlives the process (a Redis server, a directory): a block found there is KV only if the
instance that wrote it ran the same model with the same block layout. The adapter builds one
`TierIdentity` (vLLM: offload_connector/vllm/tier_identity.py; the fake engine its own) and hands the same
one to the scheduler and to every worker rank; each tier puts `model_fingerprint()` and
`layout_fingerprint()` into its keys or records and treats anything written under other fingerprints as a
miss.

Records per head (`kv_heads` > 0): the layout then names the whole model's KV (total KV heads, head size,
dtype, layers, block size), never the tensor-parallel size, and a block is stored as one record per KV
head, keyed without the rank: rank r of a TP t instance holds heads `rank_heads(kv_heads, r, t)` and
writes and reads exactly those records, so instances of any TP share blocks. `kv_heads` = 1 is a model
whose KV every rank holds whole (MLA's latent): one record, every rank reads it. `kv_heads` = 0: the
adapter cannot say how a rank's bytes split by head; records are per rank, keyed with the rank and size
(instances share only with the same TP). Imports nothing from the project, no torch.
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
    layout: str  # block layout: layers, shapes and dtypes of the KV tensors, in host-pool order
    # The model's KV heads, all ranks together, when records are per head (see the module docstring); 0:
    # records per rank (then `layout` also names the rank's share, e.g. the TP size).
    kv_heads: int = 0

    def model_fingerprint(self) -> str:
        fields = (self.model, self.revision, self.dtype, self.kv_cache_dtype, self.block_size, self.hash_algo,
                  self.hash_seed)
        return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(fields))

    def layout_fingerprint(self) -> str:
        text = self.layout if not self.kv_heads else f"{self.layout} kv_heads={self.kv_heads} per-head records"
        return xxhash.xxh3_64_hexdigest(text.encode())


class HeadSplitError(ValueError):
    """A rank's share of the KV heads cannot be worked out (our bug or an unsupported model)."""


def rank_heads(kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """The KV heads [first, last) tensor-parallel rank `rank` of `world_size` holds, vLLM's split: an even
    share each when `kv_heads` >= `world_size`, else each head replicated on `world_size // kv_heads`
    consecutive ranks (MLA's one latent "head" on every rank)."""
    if kv_heads <= 0 or not 0 <= rank < world_size:
        raise HeadSplitError(f"rank {rank} of {world_size} with kv_heads={kv_heads} (our bug)")
    if kv_heads >= world_size:
        if kv_heads % world_size:
            raise HeadSplitError(f"{kv_heads} KV heads do not split evenly over {world_size} ranks")
        share = kv_heads // world_size
        return rank * share, (rank + 1) * share
    if world_size % kv_heads:
        raise HeadSplitError(f"{world_size} ranks do not replicate {kv_heads} KV heads evenly")
    head = rank // (world_size // kv_heads)
    return head, head + 1
