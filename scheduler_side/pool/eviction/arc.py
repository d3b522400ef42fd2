"""An O(1) free queue with ARC replacement (Megiddo & Modha, FAST 2003) for the CPU tier (`eviction: arc`).

An `EvictionPolicy` (base.py). Free blocks live in three LRU lists:
- `empty`: blocks holding nothing hit-able; always taken first;
- `t1`: cached blocks seen once (stored, never reused while we knew of them);
- `t2`: cached blocks reused: hit on the GPU or the CPU, or wanted again soon after leaving the CPU.
Allocation takes `empty`, then the head of `t1` while `t1` holds more than the target `p` blocks (or `t2`
is empty), else the head of `t2`. Evicted keys are remembered without data in the ghost lists `b1`/`b2`
(at most `capacity` keys each). A request that misses a key found in `b1` raises `p` (seen-once blocks
deserved more room), one found in `b2` lowers it: ARC's adaptation. So a burst of blocks used once (a
request's unique tail) cannot flush the prefixes that requests keep coming back to, and with room to
spare `p` grows until the tier behaves like plain LRU.

`recent` is a bounded LRU set of keys reused lately whose blocks are not necessarily on the CPU (a GPU hit,
a ghost hit, a CPU hit whose copy was then dropped): a block cached under such a key goes to `t2`.
Per block (`ArcBlock`, the blocks an ARC pool is made of): which list it is in, `seg` (0 when held), and
whether its content was reused, `reused`; only this class sets them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator

from scheduler_side.pool.block import Block
from scheduler_side.pool.eviction.base import EvictionPolicy
from scheduler_side.pool.free_queue import FreeBlockQueue

HELD, EMPTY, T1, T2 = 0, 1, 2, 3


class ArcBlock(Block):
    """A block of an ARC pool: the list it is in (`seg`, HELD: none), and whether its content was reused."""

    __slots__ = ("seg", "reused")

    def __init__(self, block_id: int) -> None:
        super().__init__(block_id)
        self.seg = HELD
        self.reused = False


class ArcEviction(EvictionPolicy):
    block_type = ArcBlock
    wants_hints = True

    def __init__(self, blocks: list[ArcBlock], history: int | None = None) -> None:
        self.capacity = max(1, len(blocks))
        self._lists = (None, FreeBlockQueue([]), FreeBlockQueue([]), FreeBlockQueue([]))
        self.empty, self.t1, self.t2 = self._lists[EMPTY], self._lists[T1], self._lists[T2]
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.recent: OrderedDict[bytes, None] = OrderedDict()
        self.history = max(self.capacity, history or 0)
        self.p = 0.0  # target number of free seen-once blocks
        for block in blocks:
            self.append(block)

    # --- EvictionPolicy interface ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.empty.num_free_blocks + self.t1.num_free_blocks + self.t2.num_free_blocks

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> ArcBlock:
        if self.empty.num_free_blocks:
            block = self.empty.popleft()
        else:
            t1, t2 = self.t1.num_free_blocks, self.t2.num_free_blocks
            if not t1 and not t2:
                raise RuntimeError("ArcEviction.popleft on an empty queue (caller must check len first)")
            if t1 and (t1 > self.p or not t2):
                block = self.t1.popleft()
                self._ghost(self.b1, block.block_hash)
            else:
                block = self.t2.popleft()
                self._ghost(self.b2, block.block_hash)
        block.seg = HELD
        return block

    def popleft_n(self, n: int) -> list[ArcBlock]:
        """`n` blocks, as `n` calls of `popleft` would take them, moved in at most four runs."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"ArcEviction.popleft_n({n}) with {self.num_free_blocks} free (caller must check)")
        out = self.empty.popleft_n(min(n, self.empty.num_free_blocks))
        n -= len(out)
        if n:
            t1 = self.t1.num_free_blocks
            from_t1 = min(n, t1, max(0, t1 - math.floor(self.p)))  # popleft takes t1 while t1 > p
            from_t2 = min(n - from_t1, self.t2.num_free_blocks)
            rest = n - from_t1 - from_t2  # t2 ran out: the rest from t1
            for lst, ghosts, k in ((self.t1, self.b1, from_t1), (self.t2, self.b2, from_t2),
                                   (self.t1, self.b1, rest)):
                if k:
                    run = lst.popleft_n(k)
                    for block in run:
                        self._ghost(ghosts, block.block_hash)
                    out.extend(run)
        for block in out:
            block.seg = HELD
        return out

    def append(self, block: ArcBlock) -> None:
        seg = self._segment(block)
        self._lists[seg].append(block)
        block.seg = seg

    def appendleft(self, block: ArcBlock) -> None:
        seg = self._segment(block)
        self._lists[seg].appendleft(block)
        block.seg = seg

    def append_n(self, blocks: list[ArcBlock]) -> None:
        runs: tuple[list[ArcBlock], list[ArcBlock], list[ArcBlock], list[ArcBlock]] = ([], [], [], [])
        for block in blocks:
            seg = self._segment(block)
            block.seg = seg
            runs[seg].append(block)
        for seg in (EMPTY, T1, T2):
            if runs[seg]:
                self._lists[seg].append_n(runs[seg])

    def prepend_n(self, blocks: list[ArcBlock]) -> None:
        for block in reversed(blocks):
            self.appendleft(block)

    def remove(self, block: ArcBlock) -> None:
        lst = self._lists[block.seg] if block.seg != HELD else None
        if lst is None:
            raise RuntimeError(f"ArcEviction.remove: {block} is not in the free queue (our bug)")
        lst.remove(block)
        block.seg = HELD

    def __iter__(self) -> Iterator[ArcBlock]:
        """Every free block: empty ones, then seen-once, then reused (each list head first)."""
        yield from self.empty
        yield from self.t1
        yield from self.t2

    # --- ARC bookkeeping --------------------------------------------------------------------------
    def note_reuse(self, key: bytes, block: ArcBlock | None) -> None:
        """`key` was used again (a hit on either tier). Its CPU block, if any, moves to `t2`."""
        self._remember(key)
        if block is None:
            return
        block.reused = True
        if block.seg == T1:
            self.t1.remove(block)
            self.t2.append(block)
            block.seg = T2

    def note_miss(self, key: bytes, adapt: bool) -> None:
        """A request wanted `key` and the CPU did not have it: a ghost hit marks it reused and, with
        `adapt`, moves the target `p` (only for the first miss of a lookup, ARC's one reference)."""
        if key in self.b1:
            del self.b1[key]
            if adapt:
                self.p = min(float(self.capacity), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
        elif key in self.b2:
            del self.b2[key]
            if adapt:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
        else:
            return
        self._remember(key)

    def on_cached(self, block: ArcBlock, key: bytes) -> None:
        """`block` now holds `key` (normally held: stores cache blocks before releasing them). A ghost of the
        key is dropped without counting as reuse: a lazy tier stores a block again when the GPU frees it
        again, which says nothing of requests (those count at lookup and allocation)."""
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        block.reused = key in self.recent
        if block.seg != HELD:  # cached while free: file it under its new list
            self.remove(block)
            self.append(block)

    def on_uncached(self, block: ArcBlock) -> None:
        block.reused = False
        if block.seg in (T1, T2):
            self.remove(block)
            self.append(block)

    def _segment(self, block: ArcBlock) -> int:
        if block.block_hash is None:
            return EMPTY
        return T2 if block.reused else T1

    def _ghost(self, ghosts: OrderedDict[bytes, None], key: bytes | None) -> None:
        if key is None:
            return
        ghosts[key] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def _remember(self, key: bytes) -> None:
        recent = self.recent
        recent[key] = None
        recent.move_to_end(key)
        if len(recent) > self.history:
            recent.popitem(last=False)
