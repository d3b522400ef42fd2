"""The CPU tier's O(1) LRU free queue (`eviction: lru`): empty blocks first, then cached ones in LRU order.

Same interface as `FreeBlockQueue`, so `BlockPool` uses either (`BlockPool(..., empty_first=True)`; the
fake engine's GPU pool keeps one plain LRU order, as vLLM's does). Free blocks live in two lists:
- `empty`: blocks holding nothing hit-able (never stored, forgotten, a failed store's); always taken first;
- `lru`: cached blocks, the least recently used at the head.
So a cached block is never evicted while an empty block is free: "evicted first" (`appendleft`,
`prepend_n`: a copy given up after a load, a closed session's copies) means before older *content*, never
ahead of free room. `ArcFreeQueue` keeps the same rule with its own `empty` list.
Which list a free block is in is `Block.seg` (0 when held); only this class sets it. No allocation after
construction but the lists of `popleft_n`.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler_side.pool.free_queue import Block, FreeBlockQueue

HELD, EMPTY, CACHED = 0, 1, 2


class LruFreeQueue:
    def __init__(self, blocks: list[Block]) -> None:
        self._lists = (None, FreeBlockQueue([]), FreeBlockQueue([]))
        self.empty, self.lru = self._lists[EMPTY], self._lists[CACHED]
        for block in blocks:
            self.append(block)

    @property
    def num_free_blocks(self) -> int:
        return self.empty.num_free_blocks + self.lru.num_free_blocks

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> Block:
        if self.empty.num_free_blocks:
            block = self.empty.popleft()
        elif self.lru.num_free_blocks:
            block = self.lru.popleft()
        else:
            raise RuntimeError("LruFreeQueue.popleft on an empty queue (caller must check len first)")
        block.seg = HELD
        return block

    def popleft_n(self, n: int) -> list[Block]:
        """`n` blocks: every empty one it needs, then the least recently used cached ones."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"LruFreeQueue.popleft_n({n}) with {self.num_free_blocks} free (caller must check)")
        out = self.empty.popleft_n(min(n, self.empty.num_free_blocks))
        if n > len(out):
            out.extend(self.lru.popleft_n(n - len(out)))
        for block in out:
            block.seg = HELD
        return out

    def append(self, block: Block) -> None:
        seg = EMPTY if block.block_hash is None else CACHED
        self._lists[seg].append(block)
        block.seg = seg

    def appendleft(self, block: Block) -> None:
        """To the eviction end of its list: a cached block goes after every empty one."""
        seg = EMPTY if block.block_hash is None else CACHED
        self._lists[seg].appendleft(block)
        block.seg = seg

    def append_n(self, blocks: list[Block]) -> None:
        empty: list[Block] = []
        cached: list[Block] = []
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

    def prepend_n(self, blocks: list[Block]) -> None:
        """Each at the eviction end of its list, the first listed nearest it."""
        for block in reversed(blocks):
            self.appendleft(block)

    def remove(self, block: Block) -> None:
        lst = self._lists[block.seg] if block.seg != HELD else None
        if lst is None:
            raise RuntimeError(f"LruFreeQueue.remove: {block} is not in the free queue (our bug)")
        lst.remove(block)
        block.seg = HELD

    def __iter__(self) -> Iterator[Block]:
        """Every free block in eviction order: the empty ones, then the cached ones from the LRU head."""
        yield from self.empty
        yield from self.lru

    # Replacement hooks: LRU needs only to keep each free block in the list its content says.
    def note_reuse(self, key: bytes, block: Block | None) -> None: ...

    def note_miss(self, key: bytes, adapt: bool) -> None: ...

    def on_cached(self, block: Block, key: bytes) -> None:
        if block.seg == EMPTY:  # cached while free: it joins the cached blocks as most recently used
            self.empty.remove(block)
            self.lru.append(block)
            block.seg = CACHED

    def on_uncached(self, block: Block) -> None:
        if block.seg == CACHED:  # forgotten while free: free room, taken before any cached block
            self.lru.remove(block)
            self.empty.appendleft(block)
            block.seg = EMPTY
