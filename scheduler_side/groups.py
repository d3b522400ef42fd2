"""KV-cache groups of a hybrid model: what each group needs of a prefix, and the request's hit over all.

A hybrid model (vLLM's hybrid KV cache manager, "HMA") keeps one KV-cache group per attention kind, e.g.
the sliding-window layers and the full-attention layers of Gemma 2/3 or gpt-oss. vLLM shares one GPU block
pool across the groups: a block id belongs to one group at a time and stands for that group's pages in
every layer, so a CPU block holds one GPU block's pages whatever its group. Keys carry the group id
(`hashing.group_suffix`), so the groups' copies of one prefix never collide.

The window rule (vLLM 0.32's `SlidingWindowManager.get_num_skipped_tokens`): after `n` computed tokens,
the next token of a sliding-window group attends to tokens from `n - window + 1 - extra_retained` on, so
blocks before `first_needed_block(n)` are outside its window; vLLM drops them (the null block, id 0) and
so do we. A full-attention group needs every block.

`hybrid_hit_end` is the request's hit: the longest prefix, in blocks, that every group can serve from the
CPU tier (vLLM's hybrid prefix-cache rule), given what each group found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL_GPU_BLOCK = 0  # vLLM's null block: a block outside a sliding window (nothing to store or load)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group: its id in cache keys, and its sliding window (None: full attention)."""

    group_id: int
    window: int | None = None  # tokens the next token attends to (vLLM's sliding_window)
    extra_retained: int = 0  # vLLM's extra_retained_tokens: kept below the window (multi-token prediction)

    def __post_init__(self) -> None:
        if self.group_id < 0 or (self.window is not None and self.window <= 0) or self.extra_retained < 0:
            raise ValueError(f"KVGroup(group_id={self.group_id}, window={self.window}, extra_retained="
                             f"{self.extra_retained}): group_id >= 0, window > 0 or None, extra_retained >= 0")

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the token after `num_computed_tokens` computed tokens attends to (0: all)."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1 - self.extra_retained) // block_size


FULL_ATTENTION = (KVGroup(0),)  # a model with one full-attention group (the common case)


def hybrid_hit_end(groups: Sequence[KVGroup], found: Sequence[Sequence[bool]], first: int, end: int,
                   block_size: int) -> int:
    """The largest `e` in [first, end] such that every group has every block it needs for a prefix of `e`
    blocks: a full-attention group blocks [first, e), a sliding-window group blocks
    [max(first, first_needed_block(e * block_size)), e). `first` is where the GPU hit ends (the GPU holds
    what each group needs before it); `found[g][i - first]` says whether group g's block i is on the CPU,
    for i in [first, end). Returns `first` when no longer prefix can be served. O(groups * blocks)."""
    last_miss: list[list[int]] = []  # per group: the last missing index <= j (relative), -1 if none
    for row in found:
        misses, last = [], -1
        for j in range(end - first):
            if not row[j]:
                last = j
            misses.append(last)
        last_miss.append(misses)
    for e in range(end, first, -1):
        if all(misses[e - first - 1] < max(first, group.first_needed_block(e * block_size, block_size)) - first
               for group, misses in zip(groups, last_miss, strict=True)):
            return e
    return first
