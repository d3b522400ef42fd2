"""`eviction: lru`: the CPU tier's O(1) LRU policy: empty blocks first, then cached ones in LRU order.

An `EvictionPolicy` (base.py); the fake engine's GPU pool keeps one plain LRU order instead, as vLLM's does
(`FreeBlockQueue`). Free blocks live in two lists:
- `empty`: blocks holding nothing hit-able (never stored, forgotten, a failed store's); always taken first;
- `lru`: cached blocks, the least recently used at the head.
So a cached block is never evicted while an empty block is free: "evicted first" (`appendleft`,
`prepend_n`: a copy given up after a load, a closed session's copies) means before older *content*, never
ahead of free room. `ArcEviction` keeps the same rule with its own `empty` list.
Which list a free block is in is `LruBlock.seg` (0 when held); only this class sets it. No allocation
after construction but the lists of `popleft_n`.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler_side.pool.block import Block
from scheduler_side.pool.eviction.base import EvictionPolicy
from scheduler_side.pool.free_queue import FreeBlockQueue

HELD, EMPTY, CACHED = 0, 1, 2


class LruBlock(Block):
    """A block of an LRU pool: `seg` says which list it is in (HELD: none)."""

    __slots__ = ("seg",)

    def __init__(self, block_id: int) -> None:
        super().__init__(block_id)
        self.seg = HELD


class LruEviction(EvictionPolicy):
    block_type = LruBlock
    hears_held_content = False  # its lists hold free blocks only

    def __init__(self, blocks: list[LruBlock], history: int | None = None) -> None:
        self._lists = (None, FreeBlockQueue([]), FreeBlockQueue([]))
        self.empty, self.lru = self._lists[EMPTY], self._lists[CACHED]
        for block in blocks:
            self.append(block)

    @property
    def num_free_blocks(self) -> int:
        return self.empty.num_free_blocks + self.lru.num_free_blocks

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> LruBlock:
        if self.empty.num_free_blocks:
            block = self.empty.popleft()
        elif self.lru.num_free_blocks:
            block = self.lru.popleft()
        else:
            raise RuntimeError("LruEviction.popleft on an empty queue (caller must check len first)")
        block.seg = HELD
        return block

    def popleft_n(self, n: int) -> list[LruBlock]:
        """`n` blocks: every empty one it needs, then the least recently used cached ones."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"LruEviction.popleft_n({n}) with {self.num_free_blocks} free (caller must check)")
        out = self.empty.popleft_n(min(n, self.empty.num_free_blocks))
        if n > len(out):
            out.extend(self.lru.popleft_n(n - len(out)))
        for block in out:
            block.seg = HELD
        return out

    def append(self, block: LruBlock) -> None:
        seg = EMPTY if block.block_hash is None else CACHED
        self._lists[seg].append(block)
        block.seg = seg

    def appendleft(self, block: LruBlock) -> None:
        """To the eviction end of its list: a cached block goes after every empty one."""
        seg = EMPTY if block.block_hash is None else CACHED
        self._lists[seg].appendleft(block)
        block.seg = seg

    def append_n(self, blocks: list[LruBlock]) -> None:
        empty: list[LruBlock] = []
        cached: list[LruBlock] = []
        for block in blocks:
            if block.block_hash is None:
                block.seg = EMPTY
                empty.append(block)
            else:
                block.seg = CACHED
                cached.append(block)
        if empty:
            self.empty.append_n(empty)
        if cached:
            self.lru.append_n(cached)

    def prepend_n(self, blocks: list[LruBlock]) -> None:
        """Each at the eviction end of its list, the first listed nearest it."""
        empty = [block for block in blocks if block.block_hash is None]
        cached = [block for block in blocks if block.block_hash is not None] if len(empty) < len(blocks) else []
        for seg, run in ((EMPTY, empty), (CACHED, cached)):
            if run:
                self._lists[seg].prepend_n(run)
                for block in run:
                    block.seg = seg

    def remove(self, block: LruBlock) -> None:
        seg = block.seg
        if seg == HELD:
            raise RuntimeError(f"LruEviction.remove: {block} is not in the free queue (our bug)")
        self._lists[seg].remove(block)
        block.seg = HELD

    def __iter__(self) -> Iterator[LruBlock]:
        """Every free block in eviction order: the empty ones, then the cached ones from the LRU head."""
        yield from self.empty
        yield from self.lru

    # LRU needs only to keep each free block in the list its content says (no hints).
    def on_cached(self, block: LruBlock, key: bytes) -> None:
        if block.seg == EMPTY:  # cached while free: it joins the cached blocks as most recently used
            self.empty.remove(block)
            self.lru.append(block)
            block.seg = CACHED

    def on_uncached(self, block: LruBlock) -> None:
        if block.seg == CACHED:  # forgotten while free: free room, taken before any cached block
            self.lru.remove(block)
            self.empty.appendleft(block)
            block.seg = EMPTY
