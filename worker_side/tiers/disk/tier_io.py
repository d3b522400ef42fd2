"""`DiskTierIO`: one rank's disk tier behind the tier I/O interface (worker_side/tiers/base.py).

A thin face over `DiskWorkerIO` (io.py): `submit_fetch` is a read job (event id = the fetch event),
`write` a write job (its rows copied before it returns), and `take_report` turns finished jobs into the
`TierReport` (fetch events with their failed CPU blocks, keys now on disk, counter deltas). Holds, per
fetch event in flight, its keys' CPU block ids (to name the failed blocks), dropped when reported.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_connector.auth_key import load_auth_key
from offload_connector.disk.config import DiskConfig
from offload_connector.disk.directory import open_private_dir
from offload_connector.disk.format import rank_fingerprint
from offload_connector.metadata import TierReport
from offload_connector.tier_identity import TierIdentity
from worker_side.host_pool import HostPool
from worker_side.tiers.base import TierIO
from worker_side.tiers.disk.io import DiskWorkerIO
from worker_side.tiers.disk.records import PoolSegments


class DiskTierIO(TierIO):
    name = "disk"

    def __init__(self, io: DiskWorkerIO) -> None:
        self.io = io
        self._fetch_ids: dict[int, dict[bytes, int]] = {}  # fetch event -> key -> CPU block id
        self._next_write = 0

    @classmethod
    def create(cls, section: DiskConfig, identity: TierIdentity, rank: int, world_size: int,
               pool: HostPool) -> DiskTierIO:
        root = open_private_dir(section.path)
        auth = load_auth_key("disk.auth_key_file", section.auth_key_file)
        return cls(DiskWorkerIO(section, root, rank_fingerprint(identity, rank, world_size),
                                PoolSegments.from_pool(pool), auth))

    def submit_fetch(self, event_id: int, cpu_block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        self._fetch_ids[event_id] = dict(zip(keys, cpu_block_ids, strict=True))
        self.io.submit_read(event_id, cpu_block_ids, keys)

    def write(self, cpu_block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        if len(cpu_block_ids):
            self.io.submit_write(self._next_write, cpu_block_ids, keys)
            self._next_write += 1

    def take_report(self) -> TierReport:
        report = TierReport(tier=self.name)
        for result in self.io.poll():
            if result.kind == "read":
                ids = self._fetch_ids.pop(result.event_id)
                report.completed_fetch_events.append(result.event_id)
                report.failed_fetch_cpu_blocks.extend(ids[k] for k in result.failed_keys)
            else:
                failed = set(result.failed_keys)
                report.written_keys.extend(k for k in result.keys if k not in failed)
        report.counters = self.io.take_counter_deltas()
        return report

    @property
    def num_fetches_in_flight(self) -> int:
        return self.io.num_reads_in_flight

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.io.wait_idle(timeout)

    def close(self) -> None:
        self.io.close()
