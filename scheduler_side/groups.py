"""KV-cache groups of a hybrid model: what each group needs of a prefix, and the request's hit over all.

A hybrid model (vLLM's hybrid KV cache manager, "HMA") keeps one KV-cache group per attention kind, e.g.
the sliding-window layers and the full-attention layers of Gemma 2/3 or gpt-oss, or the Mamba (SSM) layers
and the attention layers of NemotronH, Granite 4 or Falcon-H1. vLLM shares one GPU block pool across the
groups: a block id belongs to one group at a time and stands for that group's pages in every layer, so a
CPU block holds one GPU block's pages whatever its group. Keys carry the group id
(`hashing.group_suffix`), so the groups' copies of one prefix never collide.

The window rule (vLLM 0.32's `SlidingWindowManager.get_num_skipped_tokens`): after `n` computed tokens,
the next token of a sliding-window group attends to tokens from `n - window + 1 - extra_retained` on, so
blocks before `first_needed_block(n)` are outside its window; vLLM drops them (the null block, id 0) and
so do we. A full-attention group needs every block.

The state rule (a Mamba/SSM group in vLLM's `mamba_cache_mode="align"`, vLLM 0.32's `MambaManager`): block
`i` of such a group holds the layers' recurrent state after the first `(i + 1) * block_size` tokens, not
per-token KV; a prefix of `n` tokens needs only the state block ending at it, block `(n - 1) //
block_size` (vLLM's `get_num_skipped_tokens` is `n - 1`). A block holds its boundary's state only when a
forward step ended exactly on that boundary (vLLM keeps the running state in the block of the step's last
token), so only such blocks are stored (`KVGroup.stores_block`).

`hybrid_hit_end` is the request's hit: the longest prefix, in blocks, that every group can serve from the
CPU tier (vLLM's hybrid prefix-cache rule), given what each group found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL_GPU_BLOCK = 0  # vLLM's null block: a block outside a sliding window (nothing to store or load)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group: its id in cache keys, and its kind: full attention (no window, not `state`), a
    sliding window, or a Mamba/SSM state group (`state`: one state block per block boundary)."""

    group_id: int
    window: int | None = None  # tokens the next token attends to (vLLM's sliding_window)
    extra_retained: int = 0  # vLLM's extra_retained_tokens: kept below the window (multi-token prediction)
    state: bool = False  # a Mamba/SSM group in align mode (see the module docstring); no window then

    def __post_init__(self) -> None:
        if (self.group_id < 0 or (self.window is not None and self.window <= 0) or self.extra_retained < 0
                or (self.state and (self.window is not None or self.extra_retained))):
            raise ValueError(f"KVGroup(group_id={self.group_id}, window={self.window}, extra_retained="
                             f"{self.extra_retained}, state={self.state}): group_id >= 0, window > 0 or None, "
                             "extra_retained >= 0, a state group without window or extra_retained")

    @property
    def needs_every_block(self) -> bool:
        """Full attention: a prefix needs every one of its blocks from this group."""
        return self.window is None and not self.state

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the token after `num_computed_tokens` computed tokens reads (0: all)."""
        if self.state:
            return max(0, num_computed_tokens - 1) // block_size
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1 - self.extra_retained) // block_size

    def stores_block(self, block: int, num_computed_tokens: int, block_size: int) -> bool:
        """Whether block `block`, completed by a forward step that ended after `num_computed_tokens` tokens,
        holds what its key promises: always for attention; for a state group only the block ending exactly
        where the step ended (vLLM's other state blocks of that step are scratch or null)."""
        return not self.state or (num_computed_tokens % block_size == 0
                                  and block == num_computed_tokens // block_size - 1)


FULL_ATTENTION = (KVGroup(0),)  # a model with one full-attention group (the common case)


def hybrid_hit_end(groups: Sequence[KVGroup], found: Sequence[Sequence[bool]], first: int, end: int,
                   block_size: int) -> int:
    """The largest `e` in [first, end] such that every group has every block it needs for a prefix of `e`
    blocks: a full-attention group blocks [first, e), a sliding-window group blocks
    [max(first, first_needed_block(e * block_size)), e), a state group block e - 1. `first` is where the
    GPU hit ends (the GPU holds what each group needs before it); `found[g][i - first]` says whether group
    g's block i is on the CPU, for i in [first, end). Returns `first` when no longer prefix can be served.
    O(groups * blocks)."""
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
