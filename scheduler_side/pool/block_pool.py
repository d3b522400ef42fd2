"""A pool of KV blocks of one tier with ref counts, a free queue ordered by an eviction policy and a
prefix-cache map.

Used for our CPU tier (`eviction`: a policy from `eviction/registry.py`, e.g. "lru" or "arc") and, in the
fake engine, as the engine's GPU pool (no `eviction`: one LRU order over every free block, as vLLM's).

Invariants (checked by `check_integrity()`):
- block 0 is the reserved null block: never handed out, never freed, never in the free queue;
- every other block is either in the free queue (ref_cnt == 0) or held (ref_cnt > 0), never both;
- `cached` maps a hash to the block holding that content, and that block's `block_hash` equals the key;
  a cached block may be free (evictable, hit-able) or held;
- `reserved` maps a hash to the held block its content is being written into (a store in flight): its
  `block_hash` equals the key, it is not hit-able, and it never sits in `cached` too. `commit` turns a
  reservation into a cached entry, `abort` forgets it; the key lives in the pool alone meanwhile;
- allocation takes the blocks the eviction policy gives up first (`EvictionPolicy.popleft_n`) and, if a
  taken block was cached, drops it from `cached` first (`on_evict`, or `on_evict_keys` once for the call,
  hears of the drops after the call dropped them all);
- with an `eviction` policy (the CPU tier: every policy there is `empty_first`) no cached block is evicted
  while an empty block is free: "the head" for a cached block (`free(front=True)`, `demote`) is the
  eviction end of the cached blocks, behind every empty one. Without one (the fake engine's GPU pool) one
  LRU order holds every free block, as in vLLM.

A failed `allocate` changes nothing. Only the owner of a reference may `free` it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from scheduler_side.pool.block import Block
from scheduler_side.pool.eviction.base import EvictionPolicy
from scheduler_side.pool.eviction.registry import eviction_policy
from scheduler_side.pool.free_queue import FreeBlockQueue


class PoolError(RuntimeError):
    """Misuse of a block pool (double free, touching the null block): always a caller bug."""


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[bytes, bool], None] | None = None,
                 eviction: str | None = None, history: int | None = None) -> None:
        """`eviction`: the CPU tier's policy by name (registry.py); None: one LRU order (an engine's GPU
        pool). `history`: how many keys of content gone from the pool the policy may remember (ARC:
        recently reused keys; default `num_blocks`)."""
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        policy = FreeBlockQueue if eviction is None else eviction_policy(eviction)
        self.num_blocks = num_blocks
        self.blocks = [policy.block_type(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently held, so it can never enter the free queue
        self.eviction = eviction
        self.free_queue: EvictionPolicy = policy(self.blocks[1:], history)
        self.empty_first = policy.empty_first
        self._tell_held = policy.hears_held_content  # False: held blocks' content changes go untold
        self.cached: dict[bytes, Block] = {}
        self.reserved: dict[bytes, Block] = {}  # content on its way into a held block (not hit-able yet)
        self.on_evict = on_evict  # (key, evicted) for every cached block dropped; evicted: by allocation (LRU)
        # If set, hears the keys an `allocate` evicted, once per call in eviction order, instead of `on_evict`
        # hearing each (the hook is told after the call dropped them all).
        self.on_evict_keys: Callable[[list[bytes]], None] | None = None
        self.on_evict_block: Callable[[Block], None] | None = None  # an evicted block, its hash still set
        self.num_evictions = 0  # cached blocks dropped because their block was reallocated (LRU)

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks currently held (not in the free queue)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    # --- replacement hints (for policies with `wants_hints`, e.g. ARC; no-ops otherwise) -------------
    def note_reuse(self, block_hash: bytes) -> None:
        """A request hit `block_hash` on either tier."""
        self.free_queue.note_reuse(block_hash, self.cached.get(block_hash))

    def note_miss(self, block_hash: bytes, adapt: bool = True) -> None:
        """A request wanted `block_hash` and this tier did not hold it."""
        self.free_queue.note_miss(block_hash, adapt)

    # --- state changes -------------------------------------------------------------------------
    def allocate(self, num: int) -> list[Block] | None:
        """Take `num` blocks the eviction policy gives up first (ref_cnt 1, no hash), evicting cached ones
        (with `empty_first`, only once no empty block is left); None, changing nothing, if short."""
        if num > self.free_queue.num_free_blocks:
            return None
        out = self.free_queue.popleft_n(num)
        on_evict_block, cached, evicted = self.on_evict_block, self.cached, []
        on_uncached = self.free_queue.on_uncached if self._tell_held else None
        for block in out:
            h = block.block_hash
            if h is not None:  # `_drop_hash(block, evicted=True, held=True)`, inlined (per block)
                if on_evict_block is not None:
                    on_evict_block(block)
                block.block_hash = None
                if on_uncached is not None:
                    on_uncached(block)
                if cached.get(h) is block:
                    del cached[h]
                    evicted.append(h)
            block.ref_cnt = 1
        if evicted:
            self.num_evictions += len(evicted)
            if self.on_evict_keys is not None:
                self.on_evict_keys(evicted)
            elif self.on_evict is not None:
                for h in evicted:
                    self.on_evict(h, True)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block, removing it from the free queue if it was free."""
        null_block, remove = self.null_block, self.free_queue.remove
        for block in blocks:
            if block is null_block:
                raise PoolError("touch of the null block 0 (caller bug)")
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block], front: bool = False, after: Block | None = None) -> None:
        """Drop one reference on each block; blocks reaching zero enter the free queue.

        By default at the tail (most recently used); with `front=True` at the head (evicted first), the
        first listed block ending up nearest the head (with `empty_first`, a cached block: before older
        cached blocks, never ahead of empty ones); with `after` (a free block; a pool without eviction
        policy: the engine's GPU pool) right behind it, the first listed nearest it.
        """
        queue = self.free_queue
        if after is not None and not (isinstance(queue, FreeBlockQueue) and queue.contains(after)):
            raise PoolError(f"free(after={after}) on a pool with {type(queue).__name__}, or behind a block "
                            "that is not free (caller bug)")
        null_block = self.null_block
        released = []
        try:
            for block in blocks:
                if block is null_block:
                    raise PoolError("free of the null block 0 (caller bug)")
                ref_cnt = block.ref_cnt
                if ref_cnt <= 0:
                    raise PoolError(f"double free of {block} (caller bug)")
                block.ref_cnt = ref_cnt - 1
                if ref_cnt == 1:
                    released.append(block)
        finally:  # blocks already released enter the queue even when a later one is a caller bug
            if after is not None:
                queue.insert_after(after, released)  # type: ignore[attr-defined]  # (checked above)
            elif front:
                self.free_queue.prepend_n(released)
            else:
                self.free_queue.append_n(released)

    def make_recent(self, blocks: Sequence[Block]) -> None:
        """Move the free ones among `blocks` to the tail (most recently used), the first listed least recent
        among them, keeping their content; held blocks stay where they are (a touch and a free each)."""
        self.touch(blocks)
        self.free(blocks)

    def discard(self, block: Block) -> bool:
        """Forget a free cached block's content and move it to the head of the free queue.

        Held blocks are left alone (False): someone is still copying from or to them.
        """
        if block.ref_cnt != 0:
            return False
        queue = self.free_queue
        if self._tell_held:
            self._drop_hash(block)
            queue.remove(block)
        else:  # (out of the queue first: a policy that keeps free blocks only need not move it in between)
            queue.remove(block)
            self._drop_hash(block, held=True)
        queue.appendleft(block)
        return True

    def demote(self, block: Block) -> bool:
        """Move a free cached block to the head of the free queue (evicted first), keeping its content
        (still hit-able until then). Held blocks are left alone (False). With `empty_first`: the head
        of its list, so it still goes after every empty block."""
        if block.ref_cnt != 0:
            return False
        self.free_queue.remove(block)
        self.free_queue.appendleft(block)
        return True

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Register `block` as holding `block_hash`. False (no change) if another block already does."""
        current = self.cached.get(block_hash)
        if current is not None and current is not block:
            return False
        if block.block_hash is not None and block.block_hash != block_hash:
            self._drop_hash(block)
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.free_queue.on_cached(block, block_hash)
        return True

    def reserve(self, blocks: Sequence[Block], keys: Sequence[bytes]) -> None:
        """Mark held, empty blocks as receiving these keys' content. Raises (changing nothing) on a block
        that is free or holds content, or on a key already cached or reserved: caller bugs."""
        for block, key in zip(blocks, keys, strict=True):
            if block.ref_cnt <= 0 or block.block_hash is not None or key in self.reserved or key in self.cached:
                raise PoolError(f"reserve of {block} for key {key.hex()[:8]}: the block must be held and empty, "
                                "the key neither cached nor reserved (caller bug)")
        for block, key in zip(blocks, keys, strict=True):
            block.block_hash = key
            self.reserved[key] = block

    def commit(self, blocks: Iterable[Block]) -> list[bytes]:
        """The reserved contents arrived: cache them. Returns the keys now hit-able (a key another block
        caches meanwhile stays with that block: its reservation is dropped and nothing is cached here)."""
        committed = []
        cached, reserved, on_cached, tell_held = self.cached, self.reserved, self.free_queue.on_cached, self._tell_held
        for block in blocks:
            key = block.block_hash  # _unreserve, inlined (per block)
            if key is None or reserved.get(key) is not block:
                raise PoolError(f"commit of {block}, which holds no reservation (caller bug)")
            del reserved[key]
            if key not in cached:
                cached[key] = block
                if tell_held or block.ref_cnt == 0:
                    on_cached(block, key)
                committed.append(key)
            else:
                block.block_hash = None
        return committed

    def abort(self, blocks: Iterable[Block]) -> None:
        """The reserved contents will not arrive (a failed copy): forget the reservations."""
        for block in blocks:
            self._unreserve(block)

    def _unreserve(self, block: Block) -> bytes:
        key = block.block_hash
        if key is None or self.reserved.get(key) is not block:
            raise PoolError(f"commit or abort of {block}, which holds no reservation (caller bug)")
        del self.reserved[key]
        block.block_hash = None
        return key

    def uncache(self, block: Block) -> None:
        """Forget `block`'s content (it will not be hit again)."""
        self._drop_hash(block)

    def _drop_hash(self, block: Block, evicted: bool = False, held: bool = False) -> None:
        """Forget the block's content; `on_evict` hears of every drop, `num_evictions` counts only LRU ones.
        `held`: the block is out of the free queue (the policy hears only if it wants held blocks' news)."""
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self._tell_held or not (held or block.ref_cnt):
            self.free_queue.on_uncached(block)
        if self.cached.get(h) is block:
            del self.cached[h]
            if evicted:
                self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(h, evicted)

    # --- checks --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise if any invariant in the module docstring is broken. O(num_blocks): tests and idle only."""
        in_queue = set()
        cached_before = None  # with empty_first: a cached block met before an empty one in eviction order
        for block in self.free_queue:
            if block.ref_cnt != 0:
                raise PoolError(f"{block} is in the free queue with ref_cnt {block.ref_cnt}")
            if block.block_hash is not None:
                cached_before = cached_before or block
            elif self.empty_first and cached_before is not None:
                raise PoolError(f"cached {cached_before} would be evicted before the empty {block}")
            if block.block_id in in_queue:
                raise PoolError(f"{block} appears twice in the free queue")
            in_queue.add(block.block_id)
        if len(in_queue) != self.free_queue.num_free_blocks:
            raise PoolError(f"free queue holds {len(in_queue)} blocks but counts {self.num_free_blocks}")
        if 0 in in_queue or self.null_block.ref_cnt != 1:
            raise PoolError("the null block 0 was handed out or freed")
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise PoolError(f"{block} has a negative ref count")
            if block.ref_cnt == 0 and block.block_id not in in_queue:
                raise PoolError(f"{block} is neither free nor held (leaked)")
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise PoolError(f"cache map entry for {block} does not match its hash")
        for h, block in self.reserved.items():
            if block.block_hash != h or block.ref_cnt <= 0 or self.cached.get(h) is block:
                raise PoolError(f"reservation of {block}: its hash must match, it must be held and not cached")

    def num_held_blocks(self) -> int:
        """Blocks (other than the null block) with ref_cnt > 0."""
        return self.num_blocks - 1 - self.num_free_blocks
