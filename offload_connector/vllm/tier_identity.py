"""The lower tiers' identity under vLLM: what two instances must share for their blocks to be byte-compatible.

`vllm_tier_identity(vllm_config, kv_cache_config, shape)` builds the `TierIdentity` both roles hand every
lower tier (offload_connector/tier_identity.py; the remote tier keys the server with it). Model
fingerprint: model, revision, dtype, KV-cache dtype, block size, the prefix-caching hash algorithm and the
seed of vLLM's NONE_HASH (the root of every block-hash chain). Layout
fingerprint: the KV-cache spec (class, heads, head size, dtype), the layers in registration order, vLLM's
KV-cache layout and the tensor-parallel size: a rank's block bytes are in that order in the host pool.

vLLM derives NONE_HASH from PYTHONHASHSEED; unset, it is random per process for the non-cryptographic
algorithms (xxhash), and no two instances would ever share a key: that set-up is refused here, naming the
fix. Imports no vLLM: reads the configs vLLM hands the connector.
"""

from __future__ import annotations

import os
from typing import Any

from offload_connector.tier_identity import TierIdentity
from offload_connector.vllm.engine_setup import KVCacheShape
from offload_connector.vllm.errors import UnsupportedSetupError

CRYPTO_HASHES = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-default-none-hash-seed"  # what the seed is called here when vLLM uses its fixed default


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
    layout = (f"{type(spec).__name__}(heads={spec.num_kv_heads},head_size="
              f"{spec.head_size},dtype={spec.dtype},page={spec.page_size_bytes})"
              f" layers={','.join(layers)} layout={shape.layout} tp={shape.world_size} "
              f"bytes_per_block={shape.bytes_per_block}")
    return TierIdentity(model=str(model.model), revision=str(model.revision or ""), dtype=str(model.dtype),
                          kv_cache_dtype=str(cache.cache_dtype), block_size=shape.block_size, hash_algo=algo,
                          hash_seed=seed, layout=layout)
