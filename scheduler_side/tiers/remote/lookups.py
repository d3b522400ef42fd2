"""The scheduler's background existence checks against the remote tier (one daemon thread, and one more for
the server's memory gauges).

`submit(block_hashes, group_id)` queues a question and returns a ticket at once (the scheduler thread
never waits on the network); the thread asks the server how many of those blocks exist for every rank,
from the first (a block is there when every one of its parts' keys is, remote/format.py
`BlockParts`; `RemoteClient.leading_present`: the server stops at the first missing block), and files
the answer. Questions waiting together are asked in one round trip per batch, not per request (redis-py's
per-command cost was most of the thread's CPU time); `take(ticket)` returns it once (the number of leading
blocks present), or None while it is not there. `cancel(ticket)` forgets a question whose request stopped
waiting, so answers never pile up. Keys are built on the thread. A second thread, with a client and a
connection of its own, reads the server's memory figures every `MEMORY_POLL_S` seconds (`server_memory`: used
and max bytes, for the capacity and occupancy gauges; (0, 0) until first read): a slow or stalled INFO never
delays a lookup (it did when one thread did both: a question waiting behind it timed out unasked).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence

from offload_connector.hashing import with_group_id
from offload_connector.remote.client import RemoteClient
from offload_connector.remote.format import block_key

logger = logging.getLogger(__name__)

MAX_QUESTIONS_PER_ROUND = 256  # questions answered together (one pipeline per round trip)
BLOCKS_PER_ROUND = 64  # blocks of one question asked per round trip
MEMORY_POLL_S = 10.0  # how often the server's INFO memory is read (gauges only)


class RemoteLookups:
    def __init__(self, client: RemoteClient, key_prefix: str, parts: Sequence[str]) -> None:
        """`parts`: the labels of every part a block has on the server (`BlockParts.labels`)."""
        if not parts:
            raise ValueError("RemoteLookups needs the labels of a block's parts (our bug)")
        self.client, self.prefix, self.parts = client, key_prefix, tuple(parts)
        self._tickets = itertools.count()
        self._questions: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.cpu_seconds = 0.0  # the thread's CPU time (benchmarks: it is the scheduler process's too)
        self.server_memory: tuple[int, int] = (0, 0)  # (used, max) bytes, replaced whole by the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="remote-lookup", daemon=True)
        self._thread.start()
        self._memory_thread = threading.Thread(target=self._poll_memory, name="remote-memory", daemon=True)
        self._memory_thread.start()

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
        while True:
            item = self._questions.get()
            batch = [item]
            while item is not None and len(batch) < MAX_QUESTIONS_PER_ROUND:
                try:
                    batch.append(self._questions.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            started = time.thread_time()
            questions = [q for q in batch if q is not None and not self._drop_cancelled(q[0])]
            try:
                self._answer_all(questions)
            except Exception:  # noqa: BLE001 - our bug; unanswered questions time out, the thread lives on
                logger.exception("remote lookup of %d requests failed", len(questions))
                self.client.counters.errors += 1
            self.cpu_seconds += time.thread_time() - started
            if stop:
                return

    def _poll_memory(self) -> None:
        """The memory thread: at once, then every `MEMORY_POLL_S` seconds until `close`. Its own client (a
        connection of its own) shares the lookups' breaker only to ask nothing while it is open."""
        client = self.client.sibling()
        try:
            while True:
                try:
                    memory = client.server_memory()
                except Exception:  # noqa: BLE001 - our bug; gauges only: the thread lives on
                    logger.exception("reading the remote tier's memory figures failed")
                    memory = None
                if memory is not None:
                    self.server_memory = memory
                if self._stop.wait(MEMORY_POLL_S):
                    return
        finally:
            client.close()

    def _drop_cancelled(self, ticket: int) -> bool:
        with self._lock:
            if ticket in self._cancelled:
                self._cancelled.discard(ticket)
                return True
        return False

    def _answer_all(self, questions: list[tuple[int, Sequence[bytes], int]]) -> None:
        """Answer every question, `BLOCKS_PER_ROUND` blocks of each per pipelined round trip, asking a
        question's next blocks only while all of its blocks so far exist."""
        prefix, parts, client = self.prefix, self.parts, self.client
        found = dict.fromkeys((t for t, _, _ in questions), 0)
        open_ = list(questions)
        while open_:
            spans, key_lists = [], []
            for ticket, hashes, group in open_:
                start = found[ticket]
                chunk = hashes[start:start + BLOCKS_PER_ROUND]
                spans.append((ticket, len(chunk)))
                key_lists.append([block_key(prefix, part, with_group_id(h, group))
                                  for h in chunk for part in parts])
            present = client.leading_present(key_lists)
            still_open = []
            for i, ((ticket, n), question) in enumerate(zip(spans, open_, strict=True)):
                client.counters.lookup_blocks += n
                if present is None:
                    continue
                run = present[i] // len(parts)  # a block counts when every part's key exists
                found[ticket] += run
                if run == n == BLOCKS_PER_ROUND and found[ticket] < len(question[1]):
                    still_open.append(question)
            open_ = still_open
        with self._lock:
            for ticket, n in found.items():
                self.client.counters.lookup_hit_blocks += n
                if ticket in self._cancelled:
                    self._cancelled.discard(ticket)
                else:
                    self._answers[ticket] = n

    def close(self) -> None:
        self._stop.set()
        self._questions.put(None)
        self._thread.join(timeout=5)
        self.client.close()
