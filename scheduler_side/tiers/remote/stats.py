"""The remote tier's counters and gauges: names (exported as `remote_<name>`) and what each means.

Counters are running totals, the scheduler's lookups and every rank's fetches and writes summed
(`RemoteTier.counter_values`, in `REMOTE_COUNTERS` order); gauges are read when stats are taken.
"""

from __future__ import annotations

from offload_connector.remote.breaker import RemoteCounters

REMOTE_COUNTERS = tuple(RemoteCounters.__dataclass_fields__) + ("breaker_trips",)
GAUGES = ("breaker_open", "waiting_requests", "server_used_bytes", "server_max_bytes")
DESCRIPTIONS = {
    "lookups": "pipelined existence checks sent",
    "lookup_blocks": "blocks asked about",
    "lookup_hit_blocks": "blocks found on the server (every part's key)",
    "lookup_timeouts": "requests that stopped waiting after timeout_ms",
    "lookups_skipped": "CPU misses not asked about (breaker open or too many waiting)",
    "fetched_blocks": "blocks fetched into the CPU tier and verified (all ranks)",
    "fetched_bytes": "bytes fetched (all ranks)",
    "fetch_miss_blocks": "blocks gone between lookup and fetch (all ranks)",
    "corrupt_blocks": "values refused by their checks (length, checksum, keyed hash), deleted (all ranks)",
    "written_blocks": "blocks written (SET NX accepted; all ranks)",
    "write_exists": "writes of keys already on the server (all ranks)",
    "written_bytes": "bytes written (all ranks)",
    "dropped_writes": "blocks not written: queue full, breaker open or refused (all ranks)",
    "errors": "failed commands (connection, timeout, server errors)",
    "breaker_trips": "times the circuit breaker opened (worker ranks)",
    "breaker_open": "1 while the scheduler's circuit breaker is open",
    "waiting_requests": "requests waiting on a lookup or fetch",
    "server_used_bytes": "the server's used_memory (INFO memory; all namespaces, all nodes)",
    "server_max_bytes": "the server's maxmemory (0: no limit set; all nodes)",
}
