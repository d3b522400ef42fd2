"""The remote tier's lookup thread (scheduler_side/tiers/remote/lookups.py) against a stand-in client: batching,
rounds (a question answered in full takes one), cancellation, error and block accounting, the thread's
CPU-time figure, a close that never hangs on a stalled server, and the gauges' memory poll apart from it.
The real client and server: test_remote_client.py.

The stand-in can hold the thread inside a call (`gate`), so that questions submitted meanwhile are asked
together in the next round, which makes every batch deterministic."""

from __future__ import annotations

import threading
import time

import pytest

from offload_connector.remote.breaker import RemoteCounters
from offload_connector.remote.format import rank_labels
from scheduler_side.tiers.remote.lookups import BLOCKS_PER_ROUND, MAX_QUESTIONS_PER_ROUND, RemoteLookups

pytest.importorskip("redis", reason="the remote tier's client needs the `redis` package")

WAIT_S = 30.0  # a generous bound on a thread's progress: a hang fails the test instead of blocking it


class StandInClient:
    """Answers `leading_present` with every key present (or None, or an exception), recording each call."""

    def __init__(self) -> None:
        self.counters = RemoteCounters()
        self.calls: list[list[list[bytes]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.answer_none = False
        self.failures = 0
        self.busy_s = 0.0  # the thread's CPU time spent inside the calls
        self.burn = 0  # iterations of busy work per call
        self.on_call = None  # called at the start of each call (in the lookup thread)
        self.gate_timeout: float | None = WAIT_S  # None: a stalled server that never answers

    def leading_present(self, key_lists):
        if self.on_call is not None:
            self.on_call()
        self.entered.set()
        if not self.gate.wait(self.gate_timeout):
            raise RuntimeError("stand-in gate never opened")
        start = time.thread_time()
        x = 0
        for i in range(self.burn):
            x += i * i
        self.busy_s += time.thread_time() - start
        self.calls.append([list(keys) for keys in key_lists])
        if self.failures:
            self.failures -= 1
            raise RuntimeError("stand-in failure")
        return None if self.answer_none else [len(keys) for keys in key_lists]

    def server_memory(self):
        return None  # a server that does not say (the gauges keep their last figures)

    def sibling(self):
        return self

    def close(self) -> None:
        pass


def hashes(seed: int, n: int) -> list[bytes]:
    return [bytes([seed, i]) * 8 for i in range(n)]


def answer(lookups: RemoteLookups, ticket: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = lookups.take(ticket)
        if found is not None:
            return found
        time.sleep(0.001)
    raise AssertionError(f"ticket {ticket} never answered")


@pytest.fixture
def client():
    return StandInClient()


@pytest.fixture
def lookups(client):
    lk = RemoteLookups(client, "ns:v1:m:l", rank_labels(1))
    yield lk
    client.gate.set()
    lk.close()


def hold_the_thread(client: StandInClient, lookups: RemoteLookups) -> int:
    """Park the thread inside a call; questions submitted until `client.gate.set()` wait for one round."""
    client.gate.clear()
    client.entered.clear()
    ticket = lookups.submit(hashes(0, 1), 0)
    assert client.entered.wait(WAIT_S)
    return ticket


def test_the_thread_is_a_daemon(lookups) -> None:
    """A forgotten close() must not keep the process alive at exit.

    Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    assert lookups._thread.daemon is True


def test_questions_waiting_together_are_asked_together_up_to_the_round_limit(client, lookups) -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    first = hold_the_thread(client, lookups)
    tickets = [lookups.submit(hashes(1, 1), 0) for _ in range(MAX_QUESTIONS_PER_ROUND + 44)]
    client.gate.set()
    assert answer(lookups, first) == 1 and [answer(lookups, t) for t in tickets] == [1] * len(tickets)
    assert [len(call) for call in client.calls] == [1, MAX_QUESTIONS_PER_ROUND, 44]


def test_a_question_cancelled_before_its_round_is_never_asked(client, lookups) -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    first = hold_the_thread(client, lookups)
    dropped, kept = lookups.submit(hashes(2, 3), 0), lookups.submit(hashes(3, 2), 0)
    lookups.cancel(dropped)
    client.gate.set()
    assert answer(lookups, first) == 1 and answer(lookups, kept) == 2
    assert [len(keys) for keys in client.calls[1]] == [2]  # only `kept` was asked
    assert lookups.take(dropped) is None and not lookups._cancelled


def test_cancelling_an_answered_question_forgets_its_answer(client) -> None:
    """`cancel` of a question already answered drops the answer (it is never taken) and keeps nothing.

    Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    lookups = RemoteLookups(client, "p", rank_labels(1))
    ticket = lookups.submit(hashes(14, 2), 0)
    lookups.close()  # the thread answers everything queued before it stops
    lookups.cancel(ticket)
    assert lookups.take(ticket) is None
    assert not lookups._cancelled  # noqa: SLF001 - nothing waits for an answer that will never come


def test_each_failed_round_counts_one_error_and_the_thread_lives_on(client, lookups) -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    client.failures = 2
    for seed in (4, 5):
        lookups.submit(hashes(seed, 1), 0)  # unanswered: its request times out
        deadline = time.monotonic() + WAIT_S
        while len(client.calls) < seed - 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert answer(lookups, lookups.submit(hashes(6, 2), 0)) == 2  # both failures handled by now
    assert client.counters.errors == 2


def test_blocks_asked_are_counted_for_every_question_of_a_round(client, lookups) -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    first = hold_the_thread(client, lookups)
    a, b = lookups.submit(hashes(7, 3), 0), lookups.submit(hashes(8, 2), 0)
    client.gate.set()
    assert (answer(lookups, first), answer(lookups, a), answer(lookups, b)) == (1, 3, 2)
    assert client.counters.lookup_blocks == 1 + 3 + 2 and client.counters.lookup_hit_blocks == 6


def test_a_round_the_server_cannot_answer_still_counts_every_question(client, lookups) -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    first = hold_the_thread(client, lookups)
    client.answer_none = True
    a, b = lookups.submit(hashes(9, 3), 0), lookups.submit(hashes(10, 2), 0)
    client.gate.set()
    assert (answer(lookups, first), answer(lookups, a), answer(lookups, b)) == (0, 0, 0)
    assert client.counters.lookup_blocks == 1 + 3 + 2 and client.counters.lookup_hit_blocks == 0


def test_the_thread_cpu_time_adds_up_over_rounds(client, lookups) -> None:
    """`cpu_seconds` (a benchmark figure) is the thread's CPU time spent on rounds: at least what the calls
    inside them took, at most all the CPU time the thread used so far.

    Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    client.burn = 200_000
    for seed in (11, 12):
        assert answer(lookups, lookups.submit(hashes(seed, 1), 0)) == 1
    seen = {}

    def look() -> None:  # at the start of the third round, in the thread: rounds 1 and 2 are accounted
        seen.update(cpu=lookups.cpu_seconds, thread=time.thread_time(), busy=client.busy_s)

    client.on_call = look
    assert answer(lookups, lookups.submit(hashes(13, 1), 0)) == 1
    assert 0 < seen["busy"] <= seen["cpu"] <= seen["thread"]


def test_a_question_answered_in_full_takes_no_extra_round() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    client = StandInClient()
    lookups = RemoteLookups(client, "ns", rank_labels(1))
    try:
        assert answer(lookups, lookups.submit(hashes(1, BLOCKS_PER_ROUND), 0)) == BLOCKS_PER_ROUND
        assert [len(call) for call in client.calls] == [1]
    finally:
        lookups.close()


def test_a_question_cancelled_during_its_round_leaves_nothing_behind() -> None:
    """Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    client = StandInClient()
    lookups = RemoteLookups(client, "ns", rank_labels(1))
    try:
        client.gate.clear()
        ticket = lookups.submit(hashes(2, 2), 0)
        assert client.entered.wait(30)
        lookups.cancel(ticket)  # no answer yet: remembered as cancelled until the round files it
        client.gate.set()
        assert answer(lookups, lookups.submit(hashes(3, 1), 0)) == 1  # that round is over
        assert lookups.take(ticket) is None and not lookups._cancelled and not lookups._answers
    finally:
        lookups.close()


def test_close_returns_while_the_server_does_not_answer() -> None:
    """A stalled server (the thread stuck in a round trip) must not hang the engine's shutdown.

    Found by mutation testing of scheduler_side/tiers/remote/lookups.py (docs/mutation.md)."""
    client = StandInClient()
    client.gate.clear()
    client.gate_timeout = None  # stalled until the test lets it go
    lookups = RemoteLookups(client, "ns", rank_labels(1))
    lookups.submit(hashes(4, 1), 0)
    assert client.entered.wait(30)
    closer = threading.Thread(target=lookups.close)
    closer.start()
    closer.join(60)  # a hang detector, not a speed bound: close() waits at most 5 s for the thread
    stuck = closer.is_alive()
    client.gate.set()  # let the thread go, whatever happened
    closer.join()
    assert not stuck


class StalledMemory(StandInClient):
    """Lookups answered at once; its sibling's INFO memory (the gauges' client) hangs until released."""

    def __init__(self) -> None:
        super().__init__()
        self.memory_gate = threading.Event()
        self.memory_asked = threading.Event()

    def sibling(self):
        outer = self

        class Sibling(StandInClient):
            def server_memory(self):
                outer.memory_asked.set()
                outer.memory_gate.wait(WAIT_S)
                return (1, 2)

        return Sibling()

    def server_memory(self):  # asked on the lookup client itself: the same hang
        return self.sibling().server_memory()


def test_a_stalled_memory_poll_never_delays_a_lookup() -> None:
    """The gauges' INFO memory has a connection and a thread of its own: while it hangs on a stalled server,
    questions are still asked and answered (with one thread, they waited behind it and timed out unasked)."""
    client = StalledMemory()
    lookups = RemoteLookups(client, "oc", rank_labels(1))
    try:
        assert client.memory_asked.wait(WAIT_S)  # the poll is hanging now
        assert answer(lookups, lookups.submit(hashes(1, 3), 0)) == 3
        assert lookups.server_memory == (0, 0)
        client.memory_gate.set()
        deadline = time.monotonic() + WAIT_S
        while lookups.server_memory != (1, 2) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lookups.server_memory == (1, 2)
    finally:
        client.memory_gate.set()
        lookups.close()
