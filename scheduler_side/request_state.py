"""Per-request state of the scheduler side: one object per request, kept in one dict by request id.

Lifecycle: one explicit `Phase`, changed only through `RequestState.move_to`, which refuses any move not
in `TRANSITIONS` with a `SchedulerError` (before anything changes):

    NEW --lookup--> LOOKED_UP | PENDING_HIT --allocation--> RUNNING | LOADING --load done--> RUNNING
    (a lookup the policy defers returns to NEW; preemption returns RUNNING to NEW; a finished request is
    deleted, except while LOADING: then FINISHED until its load completes)

A pending hit pins CPU blocks (`pending_hit` is set exactly in PENDING_HIT); a load job holds GPU and CPU
blocks (`load` is set exactly in LOADING and FINISHED). Store jobs belong to
store events (`StoreEvent`, one per step), not to requests, so a request never waits for its stores to
be deleted. Transfers complete once every tensor-parallel rank reported them, each rank once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_side.admission.hints import RequestHints
from scheduler_side.errors import SchedulerError
from scheduler_side.interfaces import RequestLike
from scheduler_side.pool.free_queue import Block


class Phase(enum.Enum):
    NEW = "new"  # known, not admitted: created, deferred by the policy, or preempted
    LOOKED_UP = "looked up"  # looked up without a CPU hit: the next allocation admits it
    PENDING_HIT = "pending hit"  # looked up with CPU blocks pinned: the next allocation admits it
    LOADING = "loading"  # its load job is in flight; the request waits for it
    RUNNING = "running"  # allocated and computing
    FINISHED = "finished"  # the engine is done with it; kept only until its load completes

    # Members are singletons compared by identity: hash them in C (Enum's own hashes the name in Python,
    # and `move_to` hashes two members a call).
    __hash__ = object.__hash__


_LOOKUP = {Phase.NEW, Phase.LOOKED_UP, Phase.PENDING_HIT}
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset(_LOOKUP | {Phase.RUNNING}),  # a lookup; or an allocation with none before it
    Phase.LOOKED_UP: frozenset(_LOOKUP | {Phase.RUNNING}),
    Phase.PENDING_HIT: frozenset(_LOOKUP | {Phase.RUNNING, Phase.LOADING}),
    Phase.LOADING: frozenset({Phase.RUNNING, Phase.FINISHED}),
    Phase.RUNNING: frozenset(_LOOKUP | {Phase.RUNNING}),  # preempted (NEW) or looked up again
    Phase.FINISHED: frozenset(),  # deleted when its load completes
}


@dataclass(slots=True)
class PendingHit:
    """CPU blocks found for a request, pinned (one reference each) until allocation consumes them."""

    cpu_blocks: list[Block]
    num_computed_tokens: int  # the engine's GPU hit when we looked; the CPU run starts right after it
    slots: list[tuple[int, int]] | None = None  # several KV-cache groups: (group index, block index) of each


@dataclass(slots=True)
class LoadJob:
    """One request's blocks coming back from the CPU. Holds one reference on every CPU block listed; its
    GPU blocks are the request's own, referenced by the job only once the request finished while it was in
    flight (`holds_gpu`), so that the engine cannot hand them to another request before the copy ends."""

    gpu_block_ids: list[int]
    cpu_blocks: list[Block]
    event_id: int | None = None  # set when build_connector_meta hands it to the workers
    holds_gpu: bool = False  # one reference on every GPU block listed, taken by request_finished
    reported_ranks: set[int] = field(default_factory=set)  # ranks that reported it finished (each once)
    # CPU blocks whose slot a store of the same step took (their content forgotten, the worker writes them
    # after this load read them): the job keeps its reference on them, never their content.
    lent: set[int] = field(default_factory=set)

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
    gpu_block_ids: list[int] = field(default_factory=list)  # the request's blocks, in token order (group 0)
    # Several KV-cache groups (hybrid.py): every group's block list, [0] being `gpu_block_ids` itself; the
    # null block (0) where vLLM dropped a block outside a sliding window or holds no Mamba state. None with
    # one group.
    group_block_ids: list[list[int]] | None = None
    num_store_checked_blocks: int = 0  # store cursor: blocks before it were stored, cached or skipped
    num_computed_tokens: int = 0  # tokens whose KV is on the GPU after the last scheduled step
    num_gpu_hit_blocks: int = 0  # the engine's GPU prefix hit (blocks) at the last lookup
    phase: Phase = Phase.NEW  # change only with `move_to`
    pending_hit: PendingHit | None = None  # at most one; never together with an unfinished `load`
    load: LoadJob | None = None  # at most one load job in flight
    num_deferrals: int = 0  # lookups the store policy deferred to the next step (lazy: at most 4 in a row)
    num_store_waits: int = 0  # lookups answered "ask again" for a block being stored (bounded by config)
    num_load_waits: int = 0  # lookups answered "ask again" for another request's load of its first CPU block
    num_admitted_keys: int = 0  # block keys the admission filter has seen of this request (a cursor)
    hints: RequestHints | None = None  # its kv_transfer_params hints, read at its first admission

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def move_to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise SchedulerError(f"request {self.request_id}: {self.phase.value} -> {phase.value} is not a "
                                 f"valid move (allowed: {sorted(p.value for p in TRANSITIONS[self.phase])})")
        self.phase = phase
