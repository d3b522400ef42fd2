"""`EvictionPolicy`: the interface between a `BlockPool` and the order in which it gives up free blocks.

A policy holds exactly the pool's free blocks (ref_cnt 0; cached ones are evictable, hit-able content) and
decides which of them allocation takes next; the pool owns everything else (ref counts, the cache map,
reservations) and tells the policy what happens to its blocks. The model is vLLM's `CachePolicy`
(kv_offload/cpu/policies/base.py), adapted to a pool whose free blocks are threaded through linked lists:

- Atomic failure: `popleft_n(n)` with `n > num_free_blocks` raises before changing anything (the pool
  checks first, so `BlockPool.allocate` answers None and changes nothing); every other call either
  completes or raises a `RuntimeError` naming our bug, leaving each block linked exactly once.
- Empty first (`empty_first`): a policy for the CPU tier takes every free block holding nothing hit-able
  before any cached one, so content is evicted only once the tier is full; "the eviction end" for a
  cached block (`appendleft`, `prepend_n`) is then behind every empty block. `BlockPool.check_integrity`
  verifies the order through `__iter__`.
- O(1) per block on every call (the per-step allocation and free paths run through here).
- Hints (`note_reuse`, `note_miss`): what requests did with content, for policies that learn from it
  (ARC). A policy without `wants_hints` ignores them, and the scheduler skips the loops that make them.
- Per-block state a policy needs lives on its own `block_type` (a subclass of `Block` the pool creates
  its blocks as), never on the generic `Block`.

A new policy is one module under `scheduler_side/pool/eviction/` with a subclass of this class, and one
entry in `registry.py` (plus its name in the config's `eviction` choices, which a test keeps in step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

from scheduler_side.pool.block import Block


class EvictionPolicy(ABC):
    """The free blocks of one pool, in the order allocation takes them (the head is evicted first)."""

    block_type: ClassVar[type[Block]] = Block  # what the pool creates its blocks as (per-block policy state)
    empty_first: ClassVar[bool] = True  # free empty blocks are taken before any cached one
    wants_hints: ClassVar[bool] = False  # `note_reuse` / `note_miss` change something
    # `on_cached` / `on_uncached` change something for a block outside the policy (held); False: the pool
    # tells it only of its free blocks' content (per block on the store and eviction paths)
    hears_held_content: ClassVar[bool] = True

    @abstractmethod
    def __init__(self, blocks: list[Block], history: int | None = None) -> None:
        """Start with `blocks` (all free, none cached; the pool's null block excluded). `history`: how many
        keys of content no longer in the pool the policy may remember (a bound, for policies that do)."""

    num_free_blocks: int  # blocks in the policy now (a property or a plain attribute)

    def __len__(self) -> int:
        return self.num_free_blocks

    @abstractmethod
    def __iter__(self) -> Iterator[Block]:
        """Every free block, in the order allocation would take them (O(free blocks): tests, checks)."""

    @abstractmethod
    def popleft_n(self, n: int) -> list[Block]:
        """Take the `n` blocks allocation takes next, in that order (the pool then drops a taken block's
        content: an eviction). Raises `RuntimeError`, changing nothing, when fewer than `n` are free."""

    @abstractmethod
    def append_n(self, blocks: list[Block]) -> None:
        """Blocks freed by their last holder: the most recently used, the last listed most recent."""

    @abstractmethod
    def prepend_n(self, blocks: list[Block]) -> None:
        """Blocks freed to be taken first (worthless content, or empty), the first listed first."""

    @abstractmethod
    def appendleft(self, block: Block) -> None:
        """One block to the eviction end (with `empty_first`, a cached one behind every empty one)."""

    @abstractmethod
    def remove(self, block: Block) -> None:
        """A free block leaves the policy: a holder took a reference on it, or the pool moves it."""

    @abstractmethod
    def on_cached(self, block: Block, key: bytes) -> None:
        """`block` (free or held) now holds the content `key`."""

    @abstractmethod
    def on_uncached(self, block: Block) -> None:
        """`block` (free or held) no longer holds content (forgotten or evicted)."""

    def note_reuse(self, key: bytes, block: Block | None) -> None:
        """A request hit `key` on any tier; `block` is the pool's copy of it, if any."""
        del key, block  # a policy without `wants_hints` learns nothing from requests

    def note_miss(self, key: bytes, adapt: bool) -> None:
        """A request wanted `key` and the pool did not hold it (`adapt`: the lookup's first miss)."""
        del key, adapt

    def popleft(self) -> Block:
        """The one block allocation takes next (see `popleft_n`)."""
        return self.popleft_n(1)[0]

    def append(self, block: Block) -> None:
        """One block freed by its last holder (see `append_n`)."""
        self.append_n([block])
