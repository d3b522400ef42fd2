"""Small test helpers shared by the scheduler-side tests: a request and a tiny engine-side GPU pool."""

from __future__ import annotations

from dataclasses import dataclass, field

from offload_connector.config import load_config
from offload_connector.hashing import hash_request_tokens, with_group_id
from offload_connector.metadata import TierOps, TierReport, TransferMetadata, WorkerReport
from scheduler_side import BlockPool, BlockPoolGpuView, OffloadScheduler, StepRequest
from scheduler_side.policies.lazy import LazyStorePolicy
from scheduler_side.policies.store_policy import StorePolicyView
from scheduler_side.request_state import RequestState


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    block_size: int
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.block_hashes = list(hash_request_tokens(self.tokens, self.block_size, self.cache_salt))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def generate(req: FakeRequest, output: list[int]) -> None:
    """The engine appended `output` to the request: its block hashes grow (vLLM's request does the same)."""
    req.tokens = req.tokens + output
    req.block_hashes = list(hash_request_tokens(req.tokens, req.block_size, req.cache_salt))


def free_ids(pool: BlockPool) -> list[int]:
    """The pool's free queue, eviction end first: its block ids."""
    return [b.block_id for b in pool.free_queue]


def make_scheduler(num_gpu_blocks: int = 100, num_cpu_blocks: int = 50, block_size: int = 4,
                   world_size: int = 1, **overrides) -> tuple[OffloadScheduler, BlockPool]:
    """A scheduler over a fake GPU pool; `store_policy` eager unless overridden (the stories here are told
    with eager's stores)."""
    config = load_config({"num_cpu_blocks": num_cpu_blocks, "store_policy": "eager", **overrides})
    gpu = BlockPool(num_gpu_blocks)
    sched = OffloadScheduler(config, block_size, num_cpu_blocks, BlockPoolGpuView(gpu), world_size)
    return sched, gpu


def put_under_pressure(sched: OffloadScheduler) -> None:
    """Put a fresh scheduler's lazy policy under pressure for good, as the engine would: the CPU tier evicts
    a copy, and a lookup then misses on it. The tier is left empty in its first order, no request is left
    and no step has run: lazy's frontier rules are told from there."""
    pool, bs = sched.cpu_pool, sched.block_size
    evicted = FakeRequest("evicted", list(range(10**6, 10**6 + 2 * bs)), bs)
    blocks = pool.allocate(pool.num_free_blocks)
    for i, block in enumerate(blocks):  # the evicted request's first block is the least recently used
        pool.cache(block, with_group_id(evicted.block_hashes[0], sched.group_id) if i == 0 else b"filler%d" % i)
    pool.free(blocks)
    first = pool.allocate(1)  # evicts that first block
    for block in reversed(blocks[1:]):
        pool.discard(block)  # each to the head of the empty blocks: they end up in their first order
    pool.free(first, front=True)
    if sched.get_num_new_matched_tokens(evicted, 0) != (0, False) or not sched.policy.under_pressure:
        raise RuntimeError("the lookup of an evicted copy did not put the lazy policy under pressure")
    sched.request_finished(evicted)
    sched.take_events()  # the fillers' KV events


def lazy_under_pressure(view: StorePolicyView) -> LazyStorePolicy:
    """A lazy policy over a stand-in `view`, put under pressure the way the scheduler does it: the CPU tier
    evicts a copy (`on_cpu_evicted`) and a lookup then misses on it."""
    policy = LazyStorePolicy(view)
    request = FakeRequest("evicted", list(range(10**6, 10**6 + 2 * view.block_size)), view.block_size)
    policy.on_cpu_evicted(with_group_id(request.block_hashes[0], view.group_id))
    if not policy.may_admit(RequestState(request), 0) or not policy.under_pressure:
        raise RuntimeError("the lookup of an evicted copy did not put the lazy policy under pressure")
    return policy


def admit(sched: OffloadScheduler, gpu: BlockPool, req: FakeRequest, gpu_hit_tokens: int = 0):
    """Lookup + allocate all blocks for the request's tokens (no GPU prefix caching here)."""
    hit, is_async = sched.get_num_new_matched_tokens(req, gpu_hit_tokens)
    num_blocks = -(-req.num_tokens // req.block_size)
    blocks = gpu.allocate(num_blocks)
    ids = [b.block_id for b in blocks]
    sched.update_state_after_alloc(req, ids, hit or 0)
    return hit, is_async, ids


def step_done(req_id: str, ids: list[int], num_computed: int, replace: bool = True) -> StepRequest:
    return StepRequest(req_id, ids, num_computed, replace)


def report(**kw) -> WorkerReport:
    return WorkerReport(**kw)


def tier_report(rank: int = 0, tier: str = "remote", **kw) -> WorkerReport:
    """A worker report carrying one lower tier's news only (`TierReport` fields as keywords)."""
    return WorkerReport(rank=rank, tiers=[TierReport(tier=tier, **kw)])


def tier_ops(meta: TransferMetadata, tier: str = "remote") -> TierOps:
    """One lower tier's share of a step's metadata (empty ops when the tier has nothing this step)."""
    return next((ops for ops in meta.tiers if ops.tier == tier), TierOps(tier=tier))


def finish(sched: OffloadScheduler, gpu: BlockPool, req: FakeRequest, ids: list[int]) -> None:
    """The engine's side of a finish: tell the connector, then drop the request's own references."""
    assert sched.request_finished(req) == (False, None)
    gpu.free([gpu.blocks[i] for i in reversed(ids)])


def store_and_finish(sched: OffloadScheduler, gpu: BlockPool, req: FakeRequest) -> list[int]:
    """Admit `req`, compute its whole prompt in one step, complete that step's store event, finish it.
    Returns its GPU block ids (free again, their content still cached on the CPU tier)."""
    _, _, ids = admit(sched, gpu, req)
    meta = sched.build_connector_meta([step_done(req.request_id, ids, req.num_tokens)])
    sched.update_connector_output(report(completed_store_events=[meta.store_event]))
    finish(sched, gpu, req, ids)
    return ids


def assert_idle(sched: OffloadScheduler, gpu: BlockPool) -> None:
    """Nothing in flight, every invariant holds, and no block of either tier is referenced."""
    assert sched.is_idle()
    sched.check_integrity()
    gpu.check_integrity()
    assert sched.cpu_pool.num_held_blocks() == 0 and gpu.num_held_blocks() == 0
