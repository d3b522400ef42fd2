"""`TierIO`: one rank's traffic with a tier below the CPU tier, between the tier and the host pool.

The worker (worker.py) holds one `TierIO` per configured lower tier (built by name from registry.py with
the host pool, once the KV caches are registered), hands each the step's `TierOps` named after it, and
puts each one's `TierReport` into its `WorkerReport`. It never moves a byte of a tier itself, and checks
the ops before handing them over (`WorkerInvariantError` on a scheduler bug: fetch blocks distinct, in
`[1, num_cpu_blocks)`, one per key; an op for a tier this rank does not have).

Calls, per step, in this order (all on the engine's thread; none may block on the tier's I/O: run it on
threads of your own and report what finished):
1. `write(cpu_block_ids, keys)` for the CPU blocks the scheduler evicted this step (`TierOps.write_*`),
   before the step's loads, stores and fetches start.
2. `submit_fetch(event_id, cpu_block_ids, keys)`: fill each host-pool row `cpu_block_ids[i]` with the
   block stored under cache key `keys[i]` (this rank's part of it).
3. `write(cpu_block_ids, keys)` again, at `get_finished`, for a completed store whose `TierOps` had
   `write_stored`, before the report naming that store leaves the rank.
4. `take_report()` at every `get_finished`: the fetch events finished since the previous call, each once,
   with the blocks that were not filled; the keys whose copy from this rank is in the tier now; counter
   deltas. An empty report (`TierReport.is_empty`) is dropped by the worker.

Ownership of host-pool rows (the scheduler's side of it: scheduler_side/tiers/base.py):
- a fetch's rows are the tier I/O's alone from `submit_fetch` until its event appears in a report: the
  scheduler holds them and no load, store or other fetch touches them. Write only those rows. A row not
  listed in `failed_fetch_cpu_blocks` must hold exactly this rank's bytes of the block once written under
  its key (by this rank, or by the ranks of any instance holding the same heads: records per KV head),
  verified (length, checksum, the identity's fingerprints): anything else is a failed block, never KV. Every submitted event is reported exactly once, also when the tier failed (then every block failed).
- a write owns nothing: `write` must copy the rows' bytes before it returns (the scheduler reuses the
  blocks right after); writing them to the tier later, or dropping them (full, broken), is the tier's
  business, counted in its counters.
`host_rows.HostRows` reads and writes a whole block of the host pool as bytes, in host-pool order;
`head_rows.HeadRows` reads and writes it as one part per KV head, the same bytes at any TP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from offload_connector.metadata import TierReport
from offload_connector.tier_identity import TierIdentity
from worker_side.host_pool import HostPool


class TierIO(ABC):
    name: ClassVar[str]  # its config section, as in `TierOps.tier` and `TierReport.tier`

    @classmethod
    @abstractmethod
    def create(cls, section: Any, identity: TierIdentity, rank: int, world_size: int, pool: HostPool) -> TierIO:
        """This rank's I/O for the tier's config section, over `pool` (its threads may start here)."""

    @abstractmethod
    def submit_fetch(self, event_id: int, cpu_block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Start filling `cpu_block_ids[i]` with the block under cache key `keys[i]`; returns at once."""

    @abstractmethod
    def write(self, cpu_block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Copy these rows' bytes now and write them to the tier under their keys (later, or never)."""

    @abstractmethod
    def take_report(self) -> TierReport:
        """What finished since the previous call (`TierReport.tier` = `name`)."""

    @property
    @abstractmethod
    def num_fetches_in_flight(self) -> int:
        """Fetch events submitted whose I/O is still running (finished ones wait for `take_report`)."""

    @abstractmethod
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no fetch runs and every queued write is done or dropped; False on timeout."""

    @abstractmethod
    def close(self) -> None:
        """Stop the threads and close the connections; fetches not done are abandoned."""
