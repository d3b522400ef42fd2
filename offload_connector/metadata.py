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
  With the remote tier (remote/config.py): `fetch_cpu_blocks[i]` receives the block whose cache key is
  `fetch_keys[i]` from the server (all of a step's fetches form one fetch event), and `store_keys[i]` is
  the cache key of `store_cpu_blocks[i]`, written to the server once the store completed (`write: on_store`);
  `write_cpu_blocks[i]`, evicted this step, holds `write_keys[i]` until this step's copies and fetches
  start: the worker copies it out first (`write: on_cpu_evict`). All empty without the tier.
- `WorkerReport`: one worker rank -> scheduler, once per step, naming its `rank`. With tensor parallelism
  each rank reports separately; the scheduler counts a load or store complete once every rank has reported
  it once (a repeated report from the same rank is ignored), in both adapters the same way. A load the
  rank gave up on after `transfer.load_timeout_s` is reported finished with every block failed and its
  event in `expired_load_events`; the rank names the event again in `ended_load_events` once its copy
  is over, and never earlier.

Imports nothing from the project and no torch.
"""

from __future__ import annotations

import msgspec


class TransferMetadata(msgspec.Struct, kw_only=True):
    load_event: int | None = None
    load_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    load_cpu_blocks: list[int] = msgspec.field(default_factory=list)
    load_event_reqs: list[str] = msgspec.field(default_factory=list)
    load_req_num_blocks: list[int] = msgspec.field(default_factory=list)  # per load_event_reqs entry
    store_event: int | None = None
    store_gpu_blocks: list[int] = msgspec.field(default_factory=list)
    store_cpu_blocks: list[int] = msgspec.field(default_factory=list)
    store_keys: list[bytes] = msgspec.field(default_factory=list)  # remote tier only (write after store)
    store_after_load: bool = False  # the store writes host blocks this step's load reads: it goes after it
    fetch_event: int | None = None  # remote tier only: server -> host pool
    fetch_cpu_blocks: list[int] = msgspec.field(default_factory=list)
    fetch_keys: list[bytes] = msgspec.field(default_factory=list)
    write_cpu_blocks: list[int] = msgspec.field(default_factory=list)  # remote tier, on_cpu_evict: blocks evicted
    write_keys: list[bytes] = msgspec.field(default_factory=list)  # ... this step; written before reuse

    @property
    def is_empty(self) -> bool:
        return self.load_event is None and self.store_event is None and self.fetch_event is None


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
    completed_fetch_events: list[int] = msgspec.field(default_factory=list)  # remote tier: done (some may fail)
    failed_fetch_cpu_blocks: list[int] = msgspec.field(default_factory=list)  # ... blocks not fetched (miss)
    remote_counters: dict[str, int] = msgspec.field(default_factory=dict)  # remote tier: this rank's deltas
    remote_written_keys: list[bytes] = msgspec.field(default_factory=list)  # ... cache keys of blocks whose
    # copy from this rank is on the server now (written, or there already), since the previous report
    # Load events this rank gave up on (`transfer.load_timeout_s`): their requests are in finished_load_reqs
    # with every block failed, but the copy may still run: its blocks stay quarantined until the same
    # rank lists the event in ended_load_events (its copy is over; nothing of it reported again).
    expired_load_events: list[int] = msgspec.field(default_factory=list)
    ended_load_events: list[int] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_load_reqs or self.completed_store_events or self.failed_store_events
                    or self.failed_load_gpu_blocks or self.completed_fetch_events or self.expired_load_events
                    or self.ended_load_events)


_meta_encoder = msgspec.msgpack.Encoder()
_report_decoder = msgspec.msgpack.Decoder(WorkerReport)


def encode(obj: TransferMetadata | WorkerReport) -> bytes:
    return _meta_encoder.encode(obj)


def decode_report(data: bytes) -> WorkerReport:
    return _report_decoder.decode(data)
