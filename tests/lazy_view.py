"""A scripted `StorePolicyView` for the lazy store policy's tests: every answer the policy reads (the GPU
frontier, saved and dead keys, CPU and GPU room, store events in flight) is set by the test, so that exactly
one thing differs between two cases; and the frontiers and request states those tests build."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import FakeRequest

from offload_connector.hashing import with_group_id
from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.request_state import RequestState

BS = 4


@dataclass
class ScriptedView:
    """A `StorePolicyView` whose answers the test sets: the GPU frontier, saved and dead keys, CPU room."""

    lazy_lookahead_blocks: int | None = 1
    max_blocks_per_step: int | None = None
    block_size: int = BS
    group_id: int = 0
    frontier: list[tuple[int, bytes | None]] = field(default_factory=list)
    saved: set[bytes] = field(default_factory=set)
    outstanding: set[int] = field(default_factory=set)
    cpu_free: int = 100
    num_gpu_blocks: int = 1000
    cpu_empty: int = 100
    gpu_free: int = 1000
    dead: set[bytes] = field(default_factory=set)  # keys the admission filter refused
    dead_possible: bool = False  # `may_have_dead` also while `dead` is empty

    def is_saved(self, key: bytes) -> bool:
        return key in self.saved

    def is_dead(self, key: bytes) -> bool:
        return key in self.dead

    def may_have_dead(self) -> bool:
        return self.dead_possible or bool(self.dead)

    def saved_key_maps(self):
        return self.saved, frozenset()  # (read with `in` only)

    def is_store_outstanding(self, event_id: int) -> bool:
        return event_id in self.outstanding

    def cpu_num_free_blocks(self) -> int:
        return self.cpu_free

    def cpu_num_empty_blocks(self) -> int:
        return self.cpu_empty

    def gpu_num_free_blocks(self) -> int:
        return self.gpu_free

    def gpu_frontier(self, num: int, after: int | None = None):
        start = 0 if after is None else 1 + [gpu_id for gpu_id, _ in self.frontier].index(after)
        head = self.frontier[start:start + num]
        return [gpu_id for gpu_id, _ in head], [key for _, key in head]

    def gpu_cached_block(self, key: bytes) -> int | None:
        return next((gpu_id for gpu_id, k in self.frontier if k == key), None)

    def gpu_is_free(self, gpu_block_id: int) -> bool:
        return any(gpu_id == gpu_block_id for gpu_id, _ in self.frontier)


def key(i: int) -> bytes:
    return b"k%04d" % i


def unsaved(first_id: int, n: int) -> list[tuple[int, bytes | None]]:
    return [(first_id + i, key(first_id + i)) for i in range(n)]


def empty(first_id: int, n: int) -> list[tuple[int, bytes | None]]:
    return [(first_id + i, None) for i in range(n)]


def state_of(num_blocks: int, gpu_hit_blocks: int = 0, request_id: str = "r") -> RequestState:
    state = RequestState(FakeRequest(request_id, list(range(num_blocks * BS)), BS))
    state.num_gpu_hit_blocks = gpu_hit_blocks
    return state


def picks_per_step(policy: LazyStorePolicy, view: ScriptedView, event_id: int) -> int:
    """One step's stores under event `event_id`, left in flight: the number of blocks picked."""
    picks = policy.pick_stores()
    policy.on_stores_emitted(event_id, picks.gpu_ids)
    view.outstanding.add(event_id)
    return len(picks.gpu_ids)


def dead_key_view(frontier: list[tuple[int, bytes | None]], dead: set[bytes], cpu_free: int = 100) -> ScriptedView:
    """A view over a hand-made GPU frontier (its blocks are the free ones), some keys dead, none saved, a
    lookahead of 8: between a live key and a dead one exactly `dead` differs."""
    return ScriptedView(lazy_lookahead_blocks=8, num_gpu_blocks=100, frontier=frontier, dead=dead,
                        dead_possible=True, cpu_free=cpu_free, gpu_free=len(frontier))


def hashed_keys(n: int) -> list[bytes]:
    """`n` distinct block keys of KV-cache group 0."""
    return [with_group_id(bytes([i]) * 16) for i in range(n)]
