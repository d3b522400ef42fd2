"""The scheduler's background existence checks against the remote tier (one daemon thread).

`submit(block_hashes, group_id)` queues a question and returns a ticket at once (the scheduler thread
never waits on the network); the thread asks the server which of those blocks exist for every rank
(pipelined EXISTS, stopping at the first missing block) and files the answer; `take(ticket)` returns it
once (the number of leading blocks present), or None while it is not there. `cancel(ticket)` forgets a
question whose request stopped waiting, so answers never pile up. Keys are built on the thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence

from offload_connector.hashing import with_group_id
from offload_connector.remote_client import RemoteClient
from offload_connector.remote_format import block_key


class RemoteLookups:
    def __init__(self, client: RemoteClient, key_prefix: str, world_size: int) -> None:
        self.client, self.prefix, self.world_size = client, key_prefix, world_size
        self._tickets = itertools.count()
        self._questions: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="remote-lookup", daemon=True)
        self._thread.start()

    def submit(self, block_hashes: Sequence[bytes], group_id: int) -> int:
        ticket = next(self._tickets)
        self._questions.put((ticket, block_hashes, group_id))
        return ticket

    def take(self, ticket: int) -> int | None:
        with self._lock:
            return self._answers.pop(ticket, None)

    def cancel(self, ticket: int) -> None:
        with self._lock:
            if self._answers.pop(ticket, None) is None:
                self._cancelled.add(ticket)

    def _loop(self) -> None:
        prefix, world = self.prefix, self.world_size
        while True:
            item = self._questions.get()
            if item is None:
                return
            ticket, hashes, group = item
            with self._lock:
                if ticket in self._cancelled:
                    self._cancelled.discard(ticket)
                    continue
            keys = [[block_key(prefix, r, world, with_group_id(h, group)) for r in range(world)] for h in hashes]
            self.client.counters.lookup_blocks += len(keys)
            found = self.client.exists_run(keys)
            self.client.counters.lookup_hit_blocks += found
            with self._lock:
                if ticket in self._cancelled:
                    self._cancelled.discard(ticket)
                else:
                    self._answers[ticket] = found

    def close(self) -> None:
        self._questions.put(None)
        self._thread.join(timeout=5)
        self.client.close()
