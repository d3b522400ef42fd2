"""`scan_frontier`: the lazy policy's walk along the GPU eviction frontier, in Python steps per candidate.

The rule (lazy.py, `pick_stores`) goes block by block from the head of the GPU free queue while its budget
is positive: an unsaved block (a *candidate*: hashed, not on the CPU tier, not dead) is picked while the
CPU tier has room and its key was not picked already, and costs `pick_cost`; every other block costs 1.
Here the caller reads a prefix of the queue once (C-level list building, `GpuPool.frontier`) and names its
candidates; this module charges each run of non-candidates in one subtraction and visits only the
candidates, so the Python work per step is O(candidates), not O(blocks scanned).

Exactness: the runs are charged with the same floating-point results as one-by-one. While the budget `b`
is positive, `b - 1` is exact for `b >= 0.5` (Sterbenz for `b < 2`; for `2 <= b < 2**53` both `b` and 1 are
multiples of `b`'s ulp), and for `0 < b < 0.5` the result is negative, ending the walk whatever its
rounding. So `k` subtractions of 1 that leave the budget positive equal `b - k`, exactly, and a run stops
after `ceil(b)` blocks when it is at least that long. Holds no state; changes only the `picked` set given.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import ceil


def scan_frontier(keys: Sequence[bytes | None], candidates: Sequence[int], budget: float, pick_cost: float,
                  room: int, picked: set[bytes]) -> tuple[int, list[int], bool]:
    """Walk `keys` (the queue's first blocks, head first) with `budget`; `candidates`: ascending positions of
    its unsaved blocks. Returns (blocks scanned, positions picked, ran out of `keys` with budget left).
    Adds each picked key to `picked`. O(len(candidates))."""
    pos = 0
    positions: list[int] = []
    for i in candidates:
        run = i - pos  # non-candidates before it, 1 each
        if run >= budget:  # the budget runs out within the run (or was out): block i is not scanned
            return pos + max(0, ceil(budget)), positions, False
        budget -= run
        key = keys[i]
        if room > 0 and key not in picked:
            picked.add(key)  # type: ignore[arg-type]  # (a candidate is hashed)
            positions.append(i)
            room -= 1
            budget -= pick_cost
        else:
            budget -= 1
        pos = i + 1
    run = len(keys) - pos
    if run >= budget:
        return pos + max(0, ceil(budget)), positions, False
    return len(keys), positions, True
