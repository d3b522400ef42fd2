"""What the two sides exchange each engine step. Flat msgspec Structs of ints and strings.

Direction words: *store* is GPU->CPU, *load* is CPU->GPU (never swap/spill/fetch).

- `TransferMetadata`: scheduler -> workers, once per step. All loads of a step form one load event and
  all stores one store event. `load_gpu_blocks[i]` receives `load_cpu_blocks[i]`; `store_gpu_blocks[i]`
  is copied into `store_cpu_blocks[i]`. `load_event_reqs` names the requests whose blocks the load brings
  back; they finish together. `load_req_num_blocks[k]` counts the blocks of `load_event_reqs[k]`, whose
  blocks follow those of the requests before it (so a worker can name the requests a failed block hurts:
  `WorkerReport.failed_load_reqs`; empty from a scheduler that does not fill it).
  Invariants: equal lengths per pair of lists; no GPU block appears twice in a step's loads; a store's GPU
  blocks hold KV that this step's forward has completed once it has run. With `store_after_load`, some of
  `store_cpu_blocks` are among `load_cpu_blocks` (a loaded block's slot handed to a store): the worker
  starts the store only after this step's load has read them.
  With tiers below the CPU tier (`config.LOWER_TIERS`), `tiers` holds one `TierOps` per tier with work
  this step (none without such a tier), and `store_keys[i]` is the cache key of `store_cpu_blocks[i]` when
  some tier writes this step's stored blocks (`TierOps.write_stored`); empty otherwise.
- `WorkerReport`: one worker rank -> scheduler, once per step, naming its `rank`. With tensor parallelism
  each rank reports separately; the scheduler counts a load or store complete once every rank has reported
  it once (a repeated report from the same rank is ignored), in both adapters the same way. A load the
  rank gave up on after `transfer.load_timeout_s` is reported finished with every block failed and its
  event in `expired_load_events`; the rank names the event again in `ended_load_events` once its copy
  is over, and never earlier. `tiers` holds one `TierReport` per lower tier with something to say.
- `TierOps` / `TierReport`: one lower tier's share of a step and of a report, named by `tier` (its config
  section). Ownership of the CPU blocks they name (the contract of scheduler_side/tiers/base.py and
  worker_side/tiers/base.py):
  * a fetch (`fetch_cpu_blocks[i]` receives the block whose cache key is `fetch_keys[i]`; all of a step's
    fetches of one tier form one fetch event): the scheduler holds one reference on each block, its key
    reserved (not hit-able), from the step that emits it until every rank has reported the event once in
    `completed_fetch_events`; meanwhile only that tier's I/O on each rank writes those rows, and nobody
    reads them. A block the rank lists in `failed_fetch_cpu_blocks` was not filled (a miss, a refused or
    corrupt record, an error): on any rank, it fails everywhere and the scheduler forgets it; every other
    block holds exactly the bytes once written under its key, checked by the tier.
  * a write (`write_cpu_blocks[i]` under `write_keys[i]`, and with `write_stored` this step's store event
    once it completed on the rank): the scheduler holds nothing for it. The rank's tier I/O copies the
    blocks' bytes out before the call that hands it them returns (before this step's copies start; before
    the store's completion leaves the rank); what it does with the copy afterwards is its own business.
    `written_keys` names the blocks this rank's copy of is in the tier now (written, or there already).
  * `counters`: the rank's counter changes since its previous report (non-zero ones), summed by the
    scheduler into the tier's stats.

Imports nothing from the project and no torch.
"""

from __future__ import annotations

import msgspec


class TierOps(msgspec.Struct, kw_only=True):
    """One lower tier's work for one step (scheduler -> every worker rank); see the module docstring."""

    tier: str  # the tier's name: its config section ("remote", ...)
    fetch_event: int | None = None  # tier -> host pool; event ids count per tier
    fetch_cpu_blocks: list[int] = msgspec.field(default_factory=list)
    fetch_keys: list[bytes] = msgspec.field(default_factory=list)
    write_cpu_blocks: list[int] = msgspec.field(default_factory=list)  # host pool -> tier, copied out before
    write_keys: list[bytes] = msgspec.field(default_factory=list)  # ... this step's copies and fetches start
    write_stored: bool = False  # also write this step's store (`store_cpu_blocks` under `store_keys`) once done


class TierReport(msgspec.Struct, kw_only=True):
    """One lower tier's news from one worker rank since its previous report; see the module docstring."""

    tier: str
    completed_fetch_events: list[int] = msgspec.field(default_factory=list)  # done (some blocks may fail)
    failed_fetch_cpu_blocks: list[int] = msgspec.field(default_factory=list)  # ... blocks not filled
    written_keys: list[bytes] = msgspec.field(default_factory=list)  # this rank's copy is in the tier now
    counters: dict[str, int] = msgspec.field(default_factory=dict)  # this rank's counter deltas

    @property
    def is_empty(self) -> bool:
        return not (self.completed_fetch_events or self.written_keys or self.counters)


class TransferMetadata(msgspec.Struct, kw_only=True):
    load_event: int | None = None
    load_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    load_cpu_blocks: list[int] = msgspec.field(default_factory=list)
    load_event_reqs: list[str] = msgspec.field(default_factory=list)
    load_req_num_blocks: list[int] = msgspec.field(default_factory=list)  # per load_event_reqs entry
    store_event: int | None = None
    store_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    store_cpu_blocks: list[int] = msgspec.field(default_factory=list)
    store_keys: list[bytes] = msgspec.field(default_factory=list)  # only when a tier writes stored blocks
    store_after_load: bool = False  # the store writes host blocks this step's load reads: it goes after it
    tiers: list[TierOps] = msgspec.field(default_factory=list)  # lower tiers with work this step, nearest first

    @property
    def is_empty(self) -> bool:
        return (self.load_event is None and self.store_event is None
                and all(ops.fetch_event is None for ops in self.tiers))


class WorkerReport(msgspec.Struct, kw_only=True):
    """Completions seen by one worker rank since its previous report."""

    rank: int = 0  # the tensor-parallel rank that saw them
    finished_load_reqs: list[str] = msgspec.field(default_factory=list)
    completed_store_events: list[int] = msgspec.field(default_factory=list)
    failed_store_events: list[int] = msgspec.field(default_factory=list)
    failed_load_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    # Requests of the reported loads with a failed block (all of a failed job's requests when the metadata
    # had no load_req_num_blocks). vLLM takes these, not block ids, from models with several KV-cache groups.
    failed_load_reqs: list[str] = msgspec.field(default_factory=list)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    # Load events this rank gave up on (`transfer.load_timeout_s`): their requests are in finished_load_reqs
    # with every block failed, but the copy may still run: its blocks stay quarantined until the same
    # rank lists the event in ended_load_events (its copy is over; nothing of it reported again).
    expired_load_events: list[int] = msgspec.field(default_factory=list)
    ended_load_events: list[int] = msgspec.field(default_factory=list)
    tiers: list[TierReport] = msgspec.field(default_factory=list)  # lower tiers with news (none empty)
    # Reported jobs by the copy path they took (the CUDA backend: staged, kernel, batch, per_segment, pageable)
    jobs_by_path: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """No transfer completed (a tier's counters and written keys alone do not count)."""
        return not (self.finished_load_reqs or self.completed_store_events or self.failed_store_events
                    or self.failed_load_gpu_blocks or self.expired_load_events or self.ended_load_events
                    or any(t.completed_fetch_events for t in self.tiers))


_meta_encoder = msgspec.msgpack.Encoder()
_report_decoder = msgspec.msgpack.Decoder(WorkerReport)


def encode(obj: TransferMetadata | WorkerReport) -> bytes:
    return _meta_encoder.encode(obj)


def decode_report(data: bytes) -> WorkerReport:
    return _report_decoder.decode(data)
