"""The lower tiers' identity under vLLM: what two instances must share for their blocks to be byte-compatible.

`vllm_tier_identity(vllm_config, kv_cache_config, shape)` builds the `TierIdentity` both roles hand every
lower tier (offload_connector/tier_identity.py; the remote tier keys the server with it). Model
fingerprint: model, revision, dtype, KV-cache dtype, block size, the prefix-caching hash algorithm and the
seed of vLLM's NONE_HASH (the root of every block-hash chain). Layout
fingerprint: the KV-cache spec (class, heads, head size, dtype), the layers in registration order and vLLM's
KV-cache layout: a rank's block bytes are in that order in the host pool.

Records per KV head (`kv_heads`, TP-independent, tier_identity.py) when vLLM's layout puts each block's
heads inside its bytes (every `KVCacheLayout` but LHBNC; the worker finds them at logical dim 1 of each
layer's [B, H, N, C] view) and every KV-cache group holds attention heads alike: the fingerprint then
names the model's total KV heads, never the TP size. The total is the rank's heads times the TP size over
vLLM's `kv_tp_replicas` (ranks holding the same heads: MLA's latent is one head on every rank). Else
(no layout known, LHBNC, groups without heads such as Mamba state) records are per rank and the
fingerprint also names the TP size and the rank's bytes per block.

vLLM derives NONE_HASH from PYTHONHASHSEED; unset, it is random per process for the non-cryptographic
algorithms (xxhash), and no two instances would ever share a key: that set-up is refused here, naming the
fix. Imports no vLLM: reads the configs vLLM hands the connector.
"""

from __future__ import annotations

import os
from typing import Any

from offload_connector.tier_identity import TierIdentity
from offload_connector.vllm.compat import kv_tp_replicas, spec_kv_heads
from offload_connector.vllm.engine_setup import KVCacheShape
from offload_connector.vllm.errors import UnsupportedSetupError

CRYPTO_HASHES = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-default-none-hash-seed"  # what the seed is called here when vLLM uses its fixed default
# vLLM layouts whose per-layer view [B, H, N, C] keeps a block's heads inside its bytes (LHBNC: outside)
HEADS_IN_BLOCK = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC")


def model_kv_heads(kv_cache_config: Any, shape: KVCacheShape) -> int:
    """The model's KV heads, all ranks together, when a block's bytes split by head; 0 when they do not."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    heads = {spec_kv_heads(s) for s in specs}
    if shape.layout not in HEADS_IN_BLOCK or len(heads) != 1 or None in heads:
        return 0
    replicas = kv_tp_replicas(kv_cache_config)
    per_rank, tp = int(heads.pop()), shape.world_size
    if per_rank < 1 or (per_rank * tp) % replicas or tp % replicas:
        return 0
    return per_rank * tp // replicas


def vllm_tier_identity(vllm_config: Any, kv_cache_config: Any, shape: KVCacheShape) -> TierIdentity:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    algo = str(cache.prefix_caching_hash_algo)
    seed = os.getenv("PYTHONHASHSEED")
    if seed is None:
        if algo not in CRYPTO_HASHES:
            raise UnsupportedSetupError(
                f"a tier below the CPU tier (e.g. `remote:`) needs block hashes equal across instances: with "
                f"prefix_caching_hash_algo={algo!r} vLLM seeds them at random unless PYTHONHASHSEED is set; "
                "allowed: PYTHONHASHSEED set to the same value on every instance, or "
                f"prefix_caching_hash_algo one of {', '.join(CRYPTO_HASHES)}")
        seed = DEFAULT_SEED
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = [name for t in kv_cache_config.kv_cache_tensors for name in t.layers] or \
        list(kv_cache_config.kv_cache_groups[0].layer_names)
    kv_heads = model_kv_heads(kv_cache_config, shape)
    if kv_heads:  # the whole model's layout: the same at any TP
        layout = (f"{type(spec).__name__}(kv_heads={kv_heads},head_size={spec.head_size},dtype={spec.dtype})"
                  f" layers={','.join(layers)} layout={shape.layout}")
    else:
        layout = (f"{type(spec).__name__}(heads={spec.num_kv_heads},head_size="
                  f"{spec.head_size},dtype={spec.dtype},page={spec.page_size_bytes})"
                  f" layers={','.join(layers)} layout={shape.layout} tp={shape.world_size} "
                  f"bytes_per_block={shape.bytes_per_block}")
    return TierIdentity(model=str(model.model), revision=str(model.revision or ""), dtype=str(model.dtype),
                        kv_cache_dtype=str(cache.cache_dtype), block_size=shape.block_size, hash_algo=algo,
                        hash_seed=seed, layout=layout, kv_heads=kv_heads)
