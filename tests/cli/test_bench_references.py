"""The hit-ratio benchmark's references over a trace's block stream: LRU, MIN and LRU + session close."""

from __future__ import annotations

import random

import msgspec

from benchmarks.bench_hit_ratio import lru_close_reference, lru_reference, min_reference
from offload_connector.cli.trace import TRACE_BLOCK_TOKENS, TraceRequest


def req(ids: list[int], session: str | None = None) -> TraceRequest:
    """A request of whole trace blocks plus one token (so every block may hit)."""
    return TraceRequest(timestamp=0, input_length=len(ids) * TRACE_BLOCK_TOKENS + 1, output_length=1,
                        hash_ids=ids + [10_000 + len(ids)], session=session)


def test_without_closes_two_exclusive_tiers_are_one_lru_of_their_sum():
    rng = random.Random(7)
    prefixes = [[100 * p + i for i in range(rng.randrange(1, 12))] for p in range(12)]
    requests = [req(prefixes[rng.randrange(12)][:rng.randrange(1, 12)] + [5000 + k], f"s{k % 3}")
                for k in range(300)]
    no_sessions = [msgspec.structs.replace(r, session=None) for r in requests]
    for gpu, cpu in ((2, 6), (5, 5), (8, 3)):
        assert lru_close_reference(no_sessions, gpu, cpu) == lru_reference(requests, gpu + cpu)


def test_a_closed_sessions_blocks_make_room_for_a_live_one():
    # Y's 4 blocks, X twice (X closes after its second request), Z's 4 new blocks, Y again; tiers of 2 + 6.
    # One LRU of 8 lets Z evict Y's blocks 4, 3, 2 (Y then hits block 1 only); with the close X's blocks
    # are not admitted or go first, and Y hits all four (as MIN does: it bypasses Z's blocks).
    requests = [req([1, 2, 3, 4], "Y"), req([11, 12, 13], "X"), req([11, 12, 13], "X"),
                req([21, 22, 23, 24], "Z"), req([1, 2, 3, 4], "Y")]
    tokens = 65 + 49 + 49 + 65 + 65  # each: its blocks x 16 tokens + its one-token tail
    assert lru_reference(requests, 8) == (48 + 16) / tokens
    assert lru_close_reference(requests, 2, 6) == (48 + 64) / tokens == min_reference(requests, 8)


def test_a_block_two_sessions_used_is_never_closed():
    # A and B share blocks 1-4; B closes after its own blocks 11-13: only those die, so A hits 1-4 again.
    requests = [req([1, 2, 3, 4], "A"), req([1, 2, 3, 4], "B"), req([11, 12, 13], "B"),
                req([21, 22, 23, 24], "C"), req([1, 2, 3, 4], "A")]
    tokens = 65 + 65 + 49 + 65 + 65
    assert lru_close_reference(requests, 2, 6) == (64 + 64) / tokens
