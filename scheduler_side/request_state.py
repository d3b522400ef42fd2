"""Per-request state of the scheduler side: one object per request, kept in one dict by request id.

Lifecycle: created at the first lookup (`get_num_new_matched_tokens`); a pending hit pins CPU blocks
until `update_state_after_alloc` turns it into a load job (or drops it); `request_finished` marks the
request finished, and the state is deleted once no load job of it is in flight. Store jobs belong to
store events (`StoreEvent`, one per step), not to requests, so a request never waits for its stores to
be deleted. Transfers complete once every tensor-parallel rank reported them, each rank once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_side.free_queue import Block
from scheduler_side.interfaces import RequestLike


@dataclass(slots=True)
class PendingHit:
    """CPU blocks found for a request, pinned (one reference each) until allocation consumes them."""

    cpu_blocks: list[Block]
    num_computed_tokens: int  # the engine's GPU hit when we looked; the CPU run starts right after it


@dataclass(slots=True)
class LoadJob:
    """One request's blocks coming back from the CPU. Holds one reference on every block listed."""

    gpu_block_ids: list[int]
    cpu_blocks: list[Block]
    event_id: int | None = None  # set when build_connector_meta hands it to the workers
    reported_ranks: set[int] = field(default_factory=set)  # ranks that reported it finished (each once)

    def __post_init__(self) -> None:
        if len(self.gpu_block_ids) != len(self.cpu_blocks):
            raise RuntimeError(
                f"LoadJob pairs {len(self.gpu_block_ids)} GPU blocks with {len(self.cpu_blocks)} CPU blocks"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_block_ids)


@dataclass(slots=True)
class StoreEvent:
    """One step's stores. Holds one reference on every GPU and CPU block listed until complete; the CPU
    blocks' keys are reservations in the CPU pool (`BlockPool.reserve`) until then."""

    event_id: int
    gpu_block_ids: list[int]
    cpu_blocks: list[Block]
    reported_ranks: set[int] = field(default_factory=set)  # ranks that reported it (each counts once)
    failed: bool = False


@dataclass(slots=True)
class RequestState:
    request: RequestLike
    gpu_block_ids: list[int] = field(default_factory=list)  # the request's blocks, in token order
    num_store_checked_blocks: int = 0  # store cursor: blocks before it were stored, cached or skipped
    num_computed_tokens: int = 0  # tokens whose KV is on the GPU after the last scheduled step
    num_gpu_hit_blocks: int = 0  # the engine's GPU prefix hit (blocks) at the last lookup
    lookup_pending: bool = False  # looked up, not allocated since (the next allocation admits it)
    pending_hit: PendingHit | None = None  # at most one; never together with an unfinished `load`
    load: LoadJob | None = None  # at most one load job in flight
    num_deferrals: int = 0  # lookups the store policy deferred to the next step (lazy: at most one)
    finished: bool = False  # the engine is done with the request; delete once `load` is None

    @property
    def request_id(self) -> str:
        return self.request.request_id
