"""The fake engine's GPU KV-cache manager: block allocation with prefix caching (vLLM's KVCacheManager).

It owns the GPU `BlockPool` (the scheduler_side pool: ref counts, O(1) LRU free queue, hash map) and
hands the connector a `BlockPoolGpuView` of it. Invariants:
- a request holds exactly one reference on each of its `gpu_block_ids`;
- prefix-cache keys are `with_group_id(block_hash, 0)`, equal to the connector's keys;
- full blocks are cached when scheduled (vLLM's `allocate_slots`): the forward that writes them runs
  before any later reader's, since the model runs requests in scheduling order; blocks being loaded from
  the CPU are cached only when the load completes (vLLM's delayed caching);
- `free` releases in reverse token order, so a request's tail blocks are evicted first (vLLM's order).
Hybrid mode (`groups` with a sliding-window group, vLLM's hybrid KV cache manager): one pool for all
groups; a request holds one block list per group (`EngineRequest.group_block_ids`, [0] being
`gpu_block_ids`), with the null block 0 where a sliding-window group's block lies outside the window of
the tokens computed (never allocated, or freed as the request advances: vLLM's `remove_skipped_blocks`);
prefix-cache keys carry the group id; the hit is vLLM's hybrid rule (`scheduler_side.groups`).
"""

from __future__ import annotations

from offload_connector.fake_engine.request import EngineRequest
from offload_connector.hashing import group_suffix, with_group_id
from scheduler_side import BlockPool, BlockPoolGpuView
from scheduler_side.groups import FULL_ATTENTION, NULL_GPU_BLOCK, KVGroup, hybrid_hit_end
from scheduler_side.pool.free_queue import Block


class GpuCache:
    def __init__(self, num_gpu_blocks: int, block_size: int, groups: tuple[KVGroup, ...] = FULL_ATTENTION) -> None:
        self.pool = BlockPool(num_gpu_blocks)
        self.view = BlockPoolGpuView(self.pool)
        self.block_size = block_size
        self.groups = groups
        self.hybrid = len(groups) > 1

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

    # ------------------------------------------------------------------ hybrid mode (several groups)
    def find_hit_groups(self, req: EngineRequest) -> tuple[int, list[list[Block | None]]]:
        """vLLM's hybrid hit: the longest prefix (blocks) every group can serve, and per group the cached
        blocks it takes (None: outside a window, the null block). Leaves >= 1 token to compute."""
        bs, hashes, lookup = self.block_size, req.block_hashes, self.pool.lookup
        end = min(len(hashes), (req.num_tokens - 1) // bs)
        for group in self.groups:
            if group.window is None:
                suffix = group_suffix(group.group_id)
                end = next((i for i in range(end) if lookup(hashes[i] + suffix) is None), end)
        found = [[lookup(hashes[i] + group_suffix(g.group_id)) is not None for i in range(end)] for g in self.groups]
        hit = hybrid_hit_end(self.groups, found, 0, end, bs)
        blocks: list[list[Block | None]] = []
        for group in self.groups:
            suffix, first = group_suffix(group.group_id), group.first_needed_block(hit * bs, bs)
            blocks.append([None] * first + [lookup(hashes[i] + suffix) for i in range(first, hit)])
        return hit, blocks

    def allocate_groups(self, req: EngineRequest, num_tokens: int, num_computed: int,
                        hits: list[list[Block | None]] | None = None) -> list[list[int]] | None:
        """`allocate` for several groups: first drop the window blocks the `num_computed` tokens left
        behind (even when the allocation then fails, as vLLM does), then give every group blocks up to
        `num_tokens`, the hits first; a window group's positions before its window get the null block.
        Returns each group's new block ids (hits excluded), or None with nothing allocated."""
        bs = self.block_size
        self._drop_outside_windows(req, num_computed)
        total = -(-num_tokens // bs)
        plan = []  # per group: (hit ids, nulls to append, blocks to allocate)
        num_free_hits = 0
        for g, group in enumerate(self.groups):
            held = len(req.group_block_ids[g])
            hit = hits[g] if hits else []
            num_free_hits += sum(1 for b in hit if b is not None and b.ref_cnt == 0)
            base = held + len(hit)
            nulls = max(0, min(total, group.first_needed_block(num_computed, bs)) - base)
            plan.append((hit, nulls, max(0, total - base - nulls)))
        if sum(p[2] for p in plan) > self.pool.num_free_blocks - num_free_hits:
            return None
        # Every group's hits leave the free queue before any group allocates (vLLM's allocate_slots: the
        # computed blocks of all groups, then the new ones): else one group's allocation could evict a
        # block another group of the same request is about to take as its hit, and both would write it.
        for ids, (hit, nulls, _) in zip(req.group_block_ids, plan, strict=True):
            self.pool.touch([b for b in hit if b is not None])
            ids.extend(NULL_GPU_BLOCK if b is None else b.block_id for b in hit)
            ids.extend([NULL_GPU_BLOCK] * nulls)
        new_ids: list[list[int]] = []
        for ids, (_, _, need) in zip(req.group_block_ids, plan, strict=True):
            new = [b.block_id for b in self.pool.allocate(need)] if need else []
            ids.extend(new)
            new_ids.append(new)
        if hits:
            req.num_cached_blocks = len(hits[0])
        return new_ids

    def _drop_outside_windows(self, req: EngineRequest, num_computed: int) -> None:
        for group, ids in zip(self.groups, req.group_block_ids, strict=True):
            first = min(group.first_needed_block(num_computed, self.block_size), len(ids))
            dropped = [i for i in range(first) if ids[i] != NULL_GPU_BLOCK]
            if dropped:
                self.pool.free(self.pool.blocks[ids[i]] for i in reversed(dropped))
                for i in dropped:
                    ids[i] = NULL_GPU_BLOCK

    def cache_blocks_groups(self, req: EngineRequest, num_computed_tokens: int) -> None:
        """`cache_blocks` for several groups (null blocks skipped)."""
        end = min(num_computed_tokens // self.block_size, len(req.block_hashes), len(req.gpu_block_ids))
        blocks = self.pool.blocks
        for group, ids in zip(self.groups, req.group_block_ids, strict=True):
            suffix = group_suffix(group.group_id)
            for i in range(req.num_cached_blocks, end):
                if ids[i] != NULL_GPU_BLOCK and blocks[ids[i]].block_hash is None:
                    self.pool.cache(blocks[ids[i]], req.block_hashes[i] + suffix)
        req.num_cached_blocks = max(req.num_cached_blocks, end)

    def free_groups(self, req: EngineRequest) -> None:
        """`free` for several groups: every group's blocks (not the null block), tail blocks first."""
        blocks = self.pool.blocks
        for ids in req.group_block_ids:
            self.pool.free(blocks[i] for i in reversed(ids) if i != NULL_GPU_BLOCK)
        req.group_block_ids = [[] for _ in self.groups]
        req.gpu_block_ids = req.group_block_ids[0]
        req.num_cached_blocks = 0

    def num_held(self, req: EngineRequest) -> int:
        """GPU blocks the request holds, every group (null blocks excluded)."""
        if not self.hybrid:
            return len(req.gpu_block_ids)
        return sum(1 for ids in req.group_block_ids for i in ids if i != NULL_GPU_BLOCK)
