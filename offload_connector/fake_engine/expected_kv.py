"""The K/V every live request's known tokens must hold, computed once per token, kept in a paged arena.

The fake model checks every token a request reads and writes the tokens it computes; both need the
token's expected K/V (`kv_pattern`). `ExpectedKV` (one per fake model, i.e. per tensor-parallel rank) owns:
- `arena`: one tensor (num_layers * 2, num_pages, block_size * num_kv_heads * head_dim): pages of
  `block_size` tokens laid out per layer and K/V exactly like the GPU cache's blocks, so a page and a GPU
  block compare as one contiguous row. Token p of a request lives in page `pages[p // block_size]` at offset
  `p % block_size` (slot `page * block_size + offset` of the token view), the same mapping as its GPU
  blocks, so the GPU slots and the arena slots of a run of tokens come from one index computation
  (`TokenRuns`);
- per request, an `ExpectedState` in `req.model_state[rank]`: its pages in token order, how many of its
  known tokens (prompt and outputs so far) are filled, and the prefix seed of the last one.

`sync(requests)` fills every token the requests learned since their last sync, all requests at once: one
`kv_values` call and one `index_copy_` per `SYNC_CHUNK_TOKENS` tokens (a prompt's seeds with one
`prefix_seeds`, appended outputs with `extend_seed`). `gather_pages` and `gather_tokens` return copies,
so work queued on a compute stream keeps the values it captured at launch even after their pages are given
to another request.
`release(req)` gives a finished request's pages back. The arena never shrinks; it doubles when no page is
free.
Invariant (`check_integrity`): every page is free or owned by exactly one live request, never both.
Imports torch and numpy only, besides the fake engine's own request and K/V pattern.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from offload_connector.fake_engine import kv_pattern
from offload_connector.fake_engine.request import EngineRequest

INITIAL_PAGES = 256  # the arena doubles from here as live requests need more
SYNC_CHUNK_TOKENS = 8192  # tokens per kv_values call in `sync`: bounds its int64 temporaries


@dataclass(slots=True)
class ExpectedState:
    pages: list[int] = field(default_factory=list)  # arena pages of the known tokens, in token order
    num_known: int = 0  # tokens whose expected K/V are filled: the first num_known of all_token_ids
    last_seed: int = 0  # prefix seed of token num_known - 1 (the next token is sampled from it)


@dataclass(slots=True)
class TokenRuns:
    """Runs of consecutive tokens of several requests, in order, each located through block tables.

    `add(start, end, *tables)` appends tokens [start, end) of one request; each table lists the block (or
    page) ids of that request in token order (the GPU block ids, the arena pages). `slots()` gives, per
    table, the flat slots (id * block_size + offset) of every token of every run, in one numpy pass.
    """

    block_size: int
    num_tables: int
    tables: list[list[int]] = field(init=False)
    num_blocks: list[int] = field(default_factory=list)  # per run: blocks its tokens span
    first_offsets: list[int] = field(default_factory=list)  # per run: its first token's offset in a block
    starts: list[int] = field(default_factory=list)  # per run: its first token's position in the request
    counts: list[int] = field(default_factory=list)  # per run: tokens

    def __post_init__(self) -> None:
        self.tables = [[] for _ in range(self.num_tables)]

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def add(self, start: int, end: int, *tables: list[int]) -> None:
        if end <= start:
            return
        first, last = start // self.block_size, -(-end // self.block_size)
        for out, table in zip(self.tables, tables, strict=True):
            out.extend(table[first:last])
        self.num_blocks.append(last - first)
        self.first_offsets.append(start - first * self.block_size)
        self.starts.append(start)
        self.counts.append(end - start)

    def _token_index(self) -> np.ndarray:
        """Per token, its index among the slots of all runs' blocks laid end to end."""
        counts = np.asarray(self.counts, dtype=np.int64)
        num_blocks = np.asarray(self.num_blocks, dtype=np.int64)
        first_offsets = np.asarray(self.first_offsets, dtype=np.int64)
        run_base = (np.cumsum(num_blocks) - num_blocks) * self.block_size + first_offsets
        return np.repeat(run_base - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))

    def slots(self) -> list[torch.Tensor]:
        """int64 slots of every token, one tensor per table."""
        index = self._token_index()
        blocks, offsets = np.divmod(index, self.block_size)
        return [torch.from_numpy(np.asarray(table, dtype=np.int64)[blocks] * self.block_size + offsets)
                for table in self.tables]

    def positions(self) -> torch.Tensor:
        """int64 position (in its request) of every token."""
        counts = np.asarray(self.counts, dtype=np.int64)
        deltas = np.asarray(self.starts, dtype=np.int64) - (np.cumsum(counts) - counts)
        return torch.from_numpy(np.repeat(deltas, counts) + np.arange(int(counts.sum())))


class ExpectedKV:
    def __init__(self, shape: tuple[int, int, int, int], block_size: int, dtype: torch.dtype, rank: int,
                 heads: tuple[int, int] | None = None) -> None:
        self.shape = shape  # (num_layers, 2, num_kv_heads, head_dim)
        self.block_size = block_size
        self.dtype = dtype
        self.rank = rank  # salts the pattern: each tensor-parallel rank holds a different shard ...
        self.heads = heads  # ... unless it holds heads (first, of total) of a head-sharded model: no salt
        self.row = block_size * shape[2] * shape[3]  # elements of one page of one layer's K (or V)
        self.arena = torch.empty(shape[0] * 2, INITIAL_PAGES, self.row, dtype=dtype)
        self.free_pages: list[int] = list(range(INITIAL_PAGES - 1, -1, -1))

    @property
    def num_pages(self) -> int:
        return self.arena.shape[1]

    @property
    def _tokens(self) -> torch.Tensor:
        """The arena as (num_layers * 2, num_pages * block_size, num_kv_heads * head_dim): one row a token."""
        return self.arena.view(self.arena.shape[0], -1, self.shape[2] * self.shape[3])

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    def state(self, req: EngineRequest) -> ExpectedState:
        if req.model_state is None:
            req.model_state = {}
        st = req.model_state.get(self.rank)
        if st is None:
            st = req.model_state[self.rank] = ExpectedState()
        return st

    def _take_pages(self, st: ExpectedState, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(st.pages)
        while need > len(self.free_pages):
            old = self.num_pages
            grown = torch.empty(self.arena.shape[0], 2 * old, self.row, dtype=self.dtype)
            grown[:, :old] = self.arena
            self.arena = grown
            self.free_pages[:0] = range(2 * old - 1, old - 1, -1)  # taken last, after the old free pages
        for _ in range(max(need, 0)):
            st.pages.append(self.free_pages.pop())

    def sync(self, requests: Iterable[EngineRequest]) -> None:
        """Fill the expected K/V of every token the requests know but have not filled yet, in one batch."""
        runs = TokenRuns(self.block_size, 1)
        seeds: list[torch.Tensor] = []
        extended: list[int] = []  # seeds of appended tokens, in run order after the last tensor in `seeds`
        for req in requests:
            st = self.state(req)
            n, end = st.num_known, req.num_tokens
            if n == end:
                continue
            self._take_pages(st, end)
            if n == 0:
                if extended:
                    seeds.append(torch.from_numpy(np.asarray(extended, dtype=np.int64)))
                    extended = []
                tokens = torch.from_numpy(np.asarray(req.all_token_ids, dtype=np.int64))
                seeds.append(kv_pattern.prefix_seeds(tokens))
                st.last_seed = int(seeds[-1][-1])
            else:
                seed = st.last_seed
                for p in range(n, end):
                    seed = kv_pattern.extend_seed(seed, req.all_token_ids[p], p)
                    extended.append(seed)
                st.last_seed = seed
            runs.add(n, end, st.pages)
            st.num_known = end
        if extended:
            seeds.append(torch.from_numpy(np.asarray(extended, dtype=np.int64)))
        if not seeds:
            return
        (slots,) = runs.slots()
        all_seeds, positions, tokens = torch.cat(seeds), runs.positions(), self._tokens
        for i in range(0, len(slots), SYNC_CHUNK_TOKENS):  # bounds kv_values' int64 temporaries
            part = slice(i, i + SYNC_CHUNK_TOKENS)
            values = kv_pattern.kv_values(all_seeds[part], positions[part], self.shape, self.dtype,
                                          0 if self.heads else self.rank, self.heads)
            tokens.index_copy_(1, slots[part], values.reshape(tokens.shape[0], -1, tokens.shape[2]))

    def gather_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """A copy of these pages: (num_layers * 2, len(pages), block_size * heads * dim)."""
        return self.arena.index_select(1, pages)

    def gather_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the expected K/V at these token slots: (num_layers * 2, len(slots), heads * dim)."""
        return self._tokens.index_select(1, slots)

    def release(self, req: EngineRequest) -> None:
        """Give the request's pages back (it is done); its other ranks' states are theirs to release."""
        if req.model_state is None:
            return
        st = req.model_state.pop(self.rank, None)
        if st is not None:
            self.free_pages.extend(st.pages)
        if not req.model_state:
            req.model_state = None

    def check_integrity(self, live: Iterable[EngineRequest]) -> None:
        """Every page free or owned by exactly one live request; raises RuntimeError (our bug) otherwise."""
        owned: list[int] = []
        for req in live:
            st = req.model_state.get(self.rank) if req.model_state else None
            if st is not None:
                owned.extend(st.pages)
        free = set(self.free_pages)
        if (len(free) != len(self.free_pages) or len(set(owned)) != len(owned) or not free.isdisjoint(owned)
                or len(free) + len(owned) != self.num_pages):
            raise RuntimeError(f"expected-K/V arena (rank {self.rank}): {len(self.free_pages)} free and "
                               f"{len(owned)} owned pages of {self.num_pages}, with duplicates or pages lost "
                               f"(our bug)")
