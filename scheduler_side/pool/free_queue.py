"""An O(1) doubly-linked LRU queue of free blocks, threaded through the block objects themselves.

`Block` is re-exported from block.py (its home) for the modules that name it with the queue.

Order: the head is the least recently used block (evicted first), the tail the most recently freed.
- `popleft()` takes the head (allocation), `remove(block)` unlinks from the middle (a touch on a cached
  block), `append(block)` puts a freed block at the tail, `appendleft(block)` at the head (blocks that
  are worthless to keep, e.g. whose data failed to arrive). `popleft_n`, `append_n` and `prepend_n` do the
  same for a run of blocks with one relink at the ends (the per-step allocation and free paths).
- Sentinel head and tail nodes mean no branch on empty/ends. No allocation after construction.
- A block is in the queue iff its `prev`/`next` links are set; only this class touches those links.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler_side.pool.block import Block
from scheduler_side.pool.eviction.base import EvictionPolicy


class FreeBlockQueue(EvictionPolicy):
    """One LRU order over every free block, cached or empty (vLLM's GPU free queue: the fake engine's GPU
    pool, `BlockPool` with no `eviction`); also the list each CPU-tier policy keeps its blocks in."""

    empty_first = False
    hears_held_content = False  # its lists hold free blocks only

    def __init__(self, blocks: list[Block], history: int | None = None) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail or block is None:
            raise RuntimeError("FreeBlockQueue.popleft on an empty queue (caller must check len first)")
        nxt = block.next  # (unlinked inline: per allocated block)
        if nxt is None:
            raise RuntimeError(f"FreeBlockQueue: {block} has broken links (our bug)")
        self._head.next, nxt.prev = nxt, self._head
        block.prev = block.next = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[Block]:
        """The `n` blocks nearest the head, in queue order, unlinked."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"FreeBlockQueue.popleft_n({n}) with {self.num_free_blocks} free (caller must check)")
        out = []
        node = self._head.next
        for _ in range(n):
            out.append(node)
            nxt = node.next
            node.prev = node.next = None
            node = nxt
        self._head.next, node.prev = node, self._head
        self.num_free_blocks -= n
        return out

    def append_n(self, blocks: list[Block]) -> None:
        """Put `blocks` at the tail, in list order (the last listed ends up at the tail)."""
        if blocks:
            self._link_run(blocks, self._tail)

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put `blocks` at the head, in list order (the first listed ends up nearest the head)."""
        if blocks:
            first = self._head.next
            if first is None:
                raise RuntimeError("FreeBlockQueue: broken head sentinel (our bug)")
            self._link_run(blocks, first)

    def insert_after(self, anchor: Block, blocks: list[Block]) -> None:
        """Put `blocks` right behind `anchor` (a block in the queue), in list order."""
        nxt = anchor.next
        if nxt is None:
            raise RuntimeError(f"FreeBlockQueue.insert_after: {anchor} is not in the free queue (our bug)")
        if blocks:
            self._link_run(blocks, nxt)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next  # (unlinked inline: per touched block)
        if prev is None or nxt is None:
            raise RuntimeError(f"FreeBlockQueue.remove: {block} is not in the free queue (our bug)")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: Block) -> None:
        self._link_before(block, self._tail)

    def appendleft(self, block: Block) -> None:
        first = self._head.next
        if first is None:
            raise RuntimeError("FreeBlockQueue: broken head sentinel (our bug)")
        self._link_before(block, first)

    # One order whatever a block holds: content changes move nothing.
    def on_cached(self, block: Block, key: bytes) -> None: ...

    def on_uncached(self, block: Block) -> None: ...

    def __iter__(self) -> Iterator[Block]:
        """Blocks from the eviction frontier (head) towards the most recently freed (tail)."""
        node = self._head.next
        while node is not None and node is not self._tail:
            nxt = node.next
            yield node
            node = nxt

    def iter_after(self, block: Block | None) -> Iterator[Block]:
        """Blocks behind `block` (a block in the queue) towards the tail; from the head when None."""
        node = self._head.next if block is None else block.next
        if block is not None and node is None:
            raise RuntimeError(f"FreeBlockQueue.iter_after: {block} is not in the free queue (our bug)")
        while node is not None and node is not self._tail:
            nxt = node.next
            yield node
            node = nxt

    @staticmethod
    def contains(block: Block) -> bool:
        """`block` is in this queue (a block is in at most one: its links are set only there)."""
        return block.next is not None

    def _link_before(self, block: Block, anchor: Block) -> None:
        if block.prev is not None or block.next is not None:
            raise RuntimeError(f"FreeBlockQueue: {block} is already in the free queue (our bug)")
        prev = anchor.prev
        if prev is None:
            raise RuntimeError("FreeBlockQueue: broken sentinel links (our bug)")
        block.prev, block.next = prev, anchor
        prev.next = block
        anchor.prev = block
        self.num_free_blocks += 1

    def _link_run(self, blocks: list[Block], anchor: Block) -> None:
        """Link `blocks`, in order, just before `anchor`."""
        prev = anchor.prev
        if prev is None:
            raise RuntimeError("FreeBlockQueue: broken sentinel links (our bug)")
        for block in blocks:
            if block.prev is not None or block.next is not None:
                prev.next, anchor.prev = anchor, prev  # keep the queue consistent before raising
                raise RuntimeError(f"FreeBlockQueue: {block} is already in the free queue (our bug)")
            block.prev = prev
            prev.next = block
            prev = block
            self.num_free_blocks += 1
        prev.next, anchor.prev = anchor, prev
