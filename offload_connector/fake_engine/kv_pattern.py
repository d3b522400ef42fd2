"""The fake model's K/V contents: a deterministic function of (token prefix, position, layer, K/V, head, dim).

- `prefix_seeds(tokens)`: one seed per position p, a polynomial hash of tokens[0..p] mod the Mersenne prime
  P = 2^31 - 1 (sum of (t_j + 1) * R^j), computed with one cumulative sum, so it is vectorized and extends by
  one token in O(1) (`extend_seed`).
- `kv_values(seeds, positions, shape, dtype, salt)`: mixes each seed with its position, the `salt` (the
  tensor-parallel rank: each rank's shard differs, so a block copied to the wrong rank is caught) and the
  index of each value in (layer, K/V, head, dim) (with `heads` = (first, total): the index in the whole
  model's heads, so a rank holding heads first.. of a head-sharded model holds exactly those heads' values
  of an unsharded one), then maps 8 of its bits to a multiple of 1/8 in [-16, 15.875]: exact in
  float32, float16 and bfloat16, so equality checks are exact after any copy.
- `next_token(seed, position)`: the token a request generates after that prefix (outputs are therefore
  identical with and without the connector).
All arithmetic stays below 2^63 in int64. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

P = 2**31 - 1
R = 1_000_003
_VOCAB = 32000
_powers = torch.ones(1, dtype=torch.int64)


def _powers_upto(n: int) -> torch.Tensor:
    """R^j mod P for j < n (grown by doubling and cached)."""
    global _powers
    while _powers.numel() < n:
        m = _powers.numel()
        step = pow(R, m, P)
        _powers = torch.cat([_powers, (_powers * step) % P])
    return _powers[:n]


def prefix_seeds(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """int64 seeds, one per position: seeds[p] identifies tokens[0..p] (and hence the position)."""
    t = torch.as_tensor(tokens, dtype=torch.int64) % P
    terms = ((t + 1) * _powers_upto(t.numel())) % P
    return torch.cumsum(terms, 0) % P


def extend_seed(prev_seed: int, token: int, position: int) -> int:
    """The seed of position `position` given the seed of `position - 1` (0 for position 0)."""
    return (prev_seed + ((token % P) + 1) * pow(R, position, P)) % P


@cache
def _value_keys(num_values: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value index j: its odd multiplier and its offset (rows of shape (1, num_values); read-only)."""
    j = torch.arange(num_values, dtype=torch.int64)
    return ((j * 2_654_435_761 + 97) % P | 1).unsqueeze(0), ((j * 40_503 + 12_345) % P).unsqueeze(0)


@cache
def _head_columns(shape: tuple[int, int, int, int], first: int, total: int) -> torch.Tensor:
    """Indices, in a model of `total` heads, of the values of heads first..first+shape[2] (read-only)."""
    num_layers, two, heads, dim = shape
    j = torch.arange(num_layers * two * total * dim, dtype=torch.int64).view(num_layers, two, total, dim)
    return j[:, :, first:first + heads].reshape(-1)


def kv_values(seeds: torch.Tensor, positions: torch.Tensor, shape: tuple[int, int, int, int],
              dtype: torch.dtype, salt: int = 0, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Expected K/V for the given tokens, shaped (num_layers, 2, num_tokens, num_kv_heads, head_dim).

    `shape` is (num_layers, 2, num_kv_heads, head_dim); `seeds` and `positions` are int64 vectors.
    `heads` = (first, total): these are heads first.. of a model of `total` heads (None: all of them).
    """
    num_layers, two, num_heads, dim = shape
    if heads is None or (heads[0] == 0 and heads[1] == num_heads):
        mult, add = _value_keys(num_layers * two * num_heads * dim)
    else:
        columns = _head_columns(shape, *heads)
        mult, add = (k[:, columns] for k in _value_keys(num_layers * two * heads[1] * dim))
    mixed = (seeds * 31 + positions * 1_000_033 + 7 + salt * 104_729) % P
    v = torch.addcmul(add, mixed.unsqueeze(1), mult)  # < 2^63
    # bits 23..30 as a byte b (the uint8 cast keeps the low 8 bits), then b - 128 as an int8: b ^ 128
    v = v.bitwise_right_shift_(23).to(torch.uint8).bitwise_xor_(128).view(torch.int8)
    v = v.to(dtype).mul_(0.125)
    return v.view(-1, num_layers, two, num_heads, dim).permute(1, 2, 0, 3, 4)


def next_token(seed: int, position: int) -> int:
    return (seed * 48_271 + position * 69_621 + 11) % P % _VOCAB
