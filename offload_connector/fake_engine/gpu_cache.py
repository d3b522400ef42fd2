"""The fake engine's GPU KV-cache manager: block allocation with prefix caching (vLLM's KVCacheManager).

It owns the GPU `BlockPool` (the scheduler_side pool: ref counts, O(1) LRU free queue, hash map) and
hands the connector a `BlockPoolGpuView` of it. Invariants:
- a request holds exactly one reference on each of its `gpu_block_ids`;
- prefix-cache keys are `with_group_id(block_hash, 0)`, equal to the connector's keys;
- full blocks are cached when scheduled (vLLM's `allocate_slots`): the forward that writes them runs
  before any later reader's, since the model runs requests in scheduling order; blocks being loaded from
  the CPU are cached only when the load completes (vLLM's delayed caching);
- `free` releases in reverse token order, so a request's tail blocks are evicted first (vLLM's order).
"""

from __future__ import annotations

from offload_connector.fake_engine.request import EngineRequest
from offload_connector.hashing import with_group_id
from scheduler_side import BlockPool, BlockPoolGpuView
from scheduler_side.free_queue import Block


class GpuCache:
    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_gpu_blocks)
        self.view = BlockPoolGpuView(self.pool)
        self.block_size = block_size

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def find_hit(self, req: EngineRequest) -> list[Block]:
        """Longest run of cached blocks from the start, leaving at least one token to compute."""
        max_blocks = min(len(req.block_hashes), (req.num_tokens - 1) // self.block_size)
        hits: list[Block] = []
        for i in range(max_blocks):
            block = self.pool.lookup(with_group_id(req.block_hashes[i], 0))
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, req: EngineRequest, num_tokens: int, hit_blocks: list[Block] = ()) -> list[int] | None:
        """Give `req` blocks for its first `num_tokens` tokens, taking `hit_blocks` first.

        Returns the newly allocated block ids (hit blocks excluded), or None with nothing changed.
        """
        need = -(-num_tokens // self.block_size) - len(req.gpu_block_ids) - len(hit_blocks)
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - num_free_hits:
            return None
        if hit_blocks:
            self.pool.touch(hit_blocks)
            req.gpu_block_ids.extend(b.block_id for b in hit_blocks)
            req.num_cached_blocks = len(req.gpu_block_ids)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        if new is None:
            raise RuntimeError(f"GPU pool: {need} blocks were free a moment ago (our bug)")
        new_ids = [b.block_id for b in new]
        req.gpu_block_ids.extend(new_ids)
        return new_ids

    def cache_blocks(self, req: EngineRequest, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first `num_computed_tokens` tokens in the prefix cache."""
        end = min(num_computed_tokens // self.block_size, len(req.block_hashes), len(req.gpu_block_ids))
        blocks = self.pool.blocks
        for i in range(req.num_cached_blocks, end):
            block = blocks[req.gpu_block_ids[i]]
            if block.block_hash is None:
                self.pool.cache(block, with_group_id(req.block_hashes[i], 0))
        req.num_cached_blocks = max(req.num_cached_blocks, end)

    def free(self, req: EngineRequest) -> None:
        """Drop the request's references, tail blocks first into the free queue (evicted first)."""
        blocks = self.pool.blocks
        self.pool.free(blocks[i] for i in reversed(req.gpu_block_ids))
        req.gpu_block_ids = []
        req.num_cached_blocks = 0
