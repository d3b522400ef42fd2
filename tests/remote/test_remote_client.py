"""The remote tier's building blocks: the `remote:` config section, key/value format, circuit breaker, and
the client against real redis-server processes (single node, wrong password, down and back, a cluster)."""

from __future__ import annotations

import socket
import time

import pytest
from redis_servers import redis_cluster, redis_server  # noqa: F401 - fixtures

from offload_connector.config import ConfigError, load_config
from offload_connector.hashing import with_group_id
from offload_connector.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from offload_connector.remote.client import RemoteClient
from offload_connector.remote.format import (
    HEADER_BYTES,
    BlockParts,
    block_key,
    decode_value,
    encode_value,
    key_prefix,
    rank_labels,
)
from offload_connector.tier_identity import HeadSplitError, TierIdentity, rank_heads
from scheduler_side.tiers.remote.lookups import RemoteLookups

IDENTITY = TierIdentity(model="m", block_size=16, hash_algo="xxh3_128", layout="2x(2,16,2,8) float16")


def remote_cfg(url, **kw):
    return load_config({"remote": {"url": url, **kw}}).remote


# ---- config -------------------------------------------------------------------------------------------
def test_remote_is_off_by_default() -> None:
    assert load_config(None).remote is None
    assert load_config({}).remote is None


def test_remote_section_normalizes_url_and_sizes() -> None:
    cfg = remote_cfg("redis://127.0.0.1:6379/0", max_inflight_bytes="1MiB")
    assert cfg.url == ["redis://127.0.0.1:6379/0"] and cfg.max_inflight_bytes == 1 << 20
    assert remote_cfg(["redis://a:1", "redis://b:2"]).url == ["redis://a:1", "redis://b:2"]


@pytest.mark.parametrize("section, key", [
    ({"url": "http://h:1"}, "remote.url"),
    ({"url": []}, "remote.url"),
    ({"url": "redis://"}, "remote.url"),
    ({"url": ["redis://a:1", "rediss://b:2"]}, "remote.url"),
    ({"url": ["redis://a:1", "redis://b"]}, "remote.url"),  # a cluster seed without a port
    ({"url": "redis://a:1/x"}, "remote.url"),
    ({"url": "redis://a:1", "namespace": "a b"}, "remote.namespace"),
    ({"url": "redis://a:1", "timeout_ms": 0}, "remote.timeout_ms"),
    ({"url": "redis://a:1", "write": "sometimes"}, "remote.write"),
    ({"url": "redis://a:1", "max_inflight_bytes": "lots"}, "remote.max_inflight_bytes"),
    ({"url": "redis://a:1", "breaker_backoff_ms": 50, "breaker_max_backoff_ms": 10}, "remote.breaker_max_backoff_ms"),
    ({"url": "redis://a:1", "nope": 1}, "remote.nope"),
    ({}, "remote"),
])
def test_bad_remote_config_names_the_key(section, key) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"remote": section})
    assert err.value.key == key


def test_password_never_shows_in_errors() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"remote": {"url": "redis://user:hunter2@h:1/zz"}})
    assert "hunter2" not in str(err.value) and "***" in str(err.value)


# ---- format -------------------------------------------------------------------------------------------
def test_keys_separate_ranks_groups_models_and_layouts() -> None:
    prefix = key_prefix(IDENTITY, "oc")
    key = bytes(range(16)) + (3).to_bytes(4, "big")
    k = block_key(prefix, "tp1of2", key)
    assert k.startswith(b"oc:v1:") and k.endswith(b":tp1of2:g3:" + bytes(range(16)).hex().encode())
    assert block_key(prefix, "tp0of2", key) != k
    other_model = TierIdentity(model="m2", block_size=16, hash_algo="xxh3_128", layout=IDENTITY.layout)
    other_layout = TierIdentity(model="m", block_size=16, hash_algo="xxh3_128", layout="other")
    assert len({prefix, key_prefix(other_model, "oc"), key_prefix(other_layout, "oc"), key_prefix(IDENTITY, "x")}) == 4
    assert other_layout.model_fingerprint() == IDENTITY.model_fingerprint()


def test_value_round_trip_and_every_corruption_is_refused() -> None:
    payload = bytes(range(256)) * 4
    blob = encode_value(b"k1", payload)
    assert len(blob) == HEADER_BYTES + len(payload)
    got, why = decode_value(b"k1", blob, len(payload))
    assert bytes(got) == payload and why == ""
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 100] ^= 1
    assert decode_value(b"k1", bytes(flipped), len(payload)) == (None, "checksum mismatch")
    assert decode_value(b"k2", blob, len(payload))[1] == "checksum mismatch"  # a value under another key
    assert decode_value(b"k1", blob[:-1], len(payload))[0] is None  # truncated
    assert decode_value(b"k1", blob, len(payload) + 1)[0] is None  # another layout's length
    assert decode_value(b"k1", b"XXXX" + blob[4:], len(payload))[1] == "bad magic or version"
    assert decode_value(b"k1", b"", len(payload))[0] is None


# ---- breaker ------------------------------------------------------------------------------------------
def test_breaker_opens_backs_off_doubles_and_recovers() -> None:
    now = [0.0]
    b = CircuitBreaker(1.0, 4.0, clock=lambda: now[0])
    assert b.allow() and b.state == CLOSED
    b.on_failure()
    assert b.state == OPEN and not b.allow() and b.num_trips == 1 and b.num_refused == 1
    now[0] = 1.0
    assert b.state == HALF_OPEN and b.allow() and not b.allow()  # one trial call at a time
    b.on_failure()  # the trial failed: open again, twice as long
    now[0] = 2.9
    assert not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.on_failure()
    now[0] = 3.0 + 4.0  # capped at max_backoff
    assert b.allow()
    b.on_success()
    assert b.state == CLOSED and b.allow()
    b.on_failure()
    now[0] += 1.0  # the backoff was reset by the success
    assert b.allow()


def test_breaker_ignores_calls_that_started_before_it_opened() -> None:
    """Threads failing together: only the first failure opens it (and says so); a call that started before
    and succeeds late leaves it open. Before: a late success closed it, and the next failure tripped it (and
    warned) again within the backoff."""
    now = [0.0]
    b = CircuitBreaker(1.0, 4.0, clock=lambda: now[0])
    assert b.allow() and b.allow()  # two calls in flight
    assert b.on_failure() and not b.on_failure()
    b.on_success()  # a third call, started before, done late
    assert b.state == OPEN and not b.allow() and b.num_trips == 1
    now[0] = 1.0
    assert b.allow()  # the trial
    b.on_success()
    assert b.state == CLOSED


def test_breaker_refuses_bad_backoffs() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0, 1)
    with pytest.raises(ValueError):
        CircuitBreaker(2, 1)


# ---- real servers -------------------------------------------------------------------------------------
def test_client_set_nx_get_exists_on_a_real_server(redis_server) -> None:  # noqa: F811
    client = RemoteClient(remote_cfg(redis_server.url, ttl_seconds=100))
    items = [(f"k{i}".encode(), f"v{i}".encode()) for i in range(5)]
    assert client.set_nx_many(items, 100) == [True] * 5
    assert client.set_nx_many([(b"k0", b"other")], 100) == [False]  # NX: never overwritten
    assert client.get_many([b"k0", b"k4", b"missing"]) == [b"v0", b"v4", None]
    assert 0 < int(redis_server.cli("TTL", "k0")) <= 100
    assert client.exists_flags([b"k0", b"missing", b"k4"]) == [True, False, True]
    client.delete([b"k0"])
    assert client.get_many([b"k0"]) == [None]
    assert client.counters.errors == 0 and client.breaker.state == CLOSED


def test_leading_present_counts_each_list_up_to_its_first_missing_key(redis_server) -> None:  # noqa: F811
    client = RemoteClient(remote_cfg(redis_server.url))
    assert client.set_nx_many([(f"k{i}".encode(), b"v") for i in (0, 1, 2, 4)], 100) == [True] * 4
    lists = [[b"k0", b"k1", b"k2", b"k3", b"k4"], [b"k3", b"k0"], [b"k0", b"k1"], []]
    assert client.leading_present(lists) == [3, 0, 2, 0]
    assert int(redis_server.cli("SCRIPT", "EXISTS", client._script_sha)) == 1  # one command per list
    redis_server.cli("SCRIPT", "FLUSH")  # as after a restart: the server forgot the script
    assert client.leading_present(lists) == [3, 0, 2, 0]
    assert client._script_sha is not None and client.counters.errors == 0


def test_leading_present_falls_back_to_exists_when_scripts_are_refused(tmp_path) -> None:
    from redis_servers import RedisServer, require_redis
    require_redis()
    server = RedisServer(tmp_path)
    try:
        server.cli("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "+@all", "-@scripting")
        client = RemoteClient(remote_cfg(f"redis://noscripts:pw@127.0.0.1:{server.port}/0"))
        assert client.set_nx_many([(b"a", b"v"), (b"b", b"v")], 100) == [True, True]
        assert client.leading_present([[b"a", b"b", b"c"], [b"c", b"a"]]) == [2, 0]
        assert client._script_sha is None  # EXISTS from now on
        assert client.leading_present([[b"b", b"a"]]) == [2]
        assert client.counters.errors == 0 and client.breaker.state == CLOSED
    finally:
        server.stop()


def test_wrong_password_is_a_miss_and_opens_the_breaker(tmp_path) -> None:
    from redis_servers import RedisServer, require_redis
    require_redis()
    server = RedisServer(tmp_path, password="right")
    try:
        client = RemoteClient(remote_cfg(f"redis://:wrong@127.0.0.1:{server.port}/0", breaker_backoff_ms=60000,
                                         breaker_max_backoff_ms=60000))
        assert client.set_nx_many([(b"k", b"v")], 10) is None
        assert client.get_many([b"k"]) is None and client.exists_flags([b"k"]) is None
        assert client.counters.errors == 1 and client.breaker.state == OPEN and client.breaker.num_refused == 2
        good = RemoteClient(remote_cfg(server.url))
        assert good.set_nx_many([(b"k", b"v")], 10) == [True]
    finally:
        server.stop()


def test_server_down_then_back_recovers_by_itself(redis_server) -> None:  # noqa: F811
    client = RemoteClient(remote_cfg(redis_server.url, breaker_backoff_ms=50, breaker_max_backoff_ms=50))
    assert client.set_nx_many([(b"a", b"1")], 10) == [True]
    redis_server.stop()
    assert client.get_many([b"a"]) is None
    assert client.breaker.state == OPEN and client.counters.errors == 1
    redis_server.start()  # same port, empty (nothing persisted)
    deadline = time.monotonic() + 30
    while client.get_many([b"a"]) is None:  # the breaker lets a trial through after its backoff
        assert time.monotonic() < deadline, "the client never came back"
        time.sleep(0.05)
    assert client.breaker.state == CLOSED
    assert client.set_nx_many([(b"a", b"2")], 10) == [True] and client.get_many([b"a"]) == [b"2"]


def test_cluster_pipelines_span_slots(redis_cluster) -> None:  # noqa: F811
    client = RemoteClient(remote_cfg([n.url for n in redis_cluster]))
    prefix = key_prefix(IDENTITY, "oc")
    keys = [block_key(prefix, "tp0of1", bytes([i]) * 16 + b"\0\0\0\0") for i in range(40)]
    assert client.set_nx_many([(k, k[-8:]) for k in keys], 60) == [True] * 40
    assert client.get_many(keys) == [k[-8:] for k in keys]
    assert client.exists_flags(keys + [b"absent"]) == [True] * 40 + [False]
    assert client.leading_present([keys[:10] + [b"absent"] + keys[10:], keys]) == [10, 40]  # no script: EXISTS
    per_node = [int(n.cli("DBSIZE")) for n in redis_cluster]
    assert sum(per_node) == 40 and min(per_node) > 0  # the keys really spread over the three masters
    assert client.counters.errors == 0


def test_lookups_batch_questions_and_stop_at_each_ones_first_miss(redis_server) -> None:  # noqa: F811
    client = RemoteClient(remote_cfg(redis_server.url))
    lookups = RemoteLookups(client, "p", rank_labels(2))
    hashes = [bytes([i]) * 16 for i in range(150)]
    keys = [block_key("p", r, with_group_id(h, 0)) for h in hashes[:70] for r in rank_labels(2)]
    keys.append(block_key("p", "tp0of2", with_group_id(hashes[70], 0)))  # block 70: rank 1's key is missing
    keys += [block_key("p", r, with_group_id(h, 0)) for h in hashes[71:] for r in rank_labels(2)]
    assert client.set_nx_many([(k, b"v") for k in keys], 60) == [True] * len(keys)
    tickets = [lookups.submit(hashes, 0), lookups.submit(hashes[:5], 0), lookups.submit([b"\xff" * 16], 0),
               lookups.submit(hashes, 1)]  # another group: other keys
    answers: dict[int, int] = {}
    for _ in range(100_000):  # a bound on polls, not on time
        for t in tickets:
            if t not in answers and (n := lookups.take(t)) is not None:
                answers[t] = n
        if len(answers) == len(tickets):
            break
        time.sleep(0.001)
    assert [answers.get(t) for t in tickets] == [70, 5, 0, 0]
    assert lookups.take(tickets[0]) is None  # each answer is handed out once
    cancelled = lookups.submit(hashes, 0)
    lookups.cancel(cancelled)
    lookups.close()
    assert lookups.take(cancelled) is None and client.counters.errors == 0


def test_the_test_servers_start_on_another_port_when_theirs_is_taken(tmp_path, monkeypatch) -> None:
    """The CI run of 2026-11-29 lost a cluster set-up to a port taken between the check and the bind."""
    import redis_servers

    redis_servers.require_redis()
    with socket.socket() as holder:  # bound, not listening: as an outgoing connection holds a port
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        ports = iter([taken, redis_servers.free_port()])
        monkeypatch.setattr(redis_servers, "free_port", lambda: next(ports))
        server = redis_servers.RedisServer(tmp_path)
        try:
            assert server.port != taken and server.cli("PING") == "PONG"
            assert f"Failed listening on port {taken}" in (tmp_path / f"redis-{taken}.log").read_text()
        finally:
            server.stop()


# ---- the server's memory figures (capacity and occupancy gauges) ---------------------------------------
def test_server_memory_reads_used_and_max_from_the_server(redis_server) -> None:  # noqa: F811
    client = RemoteClient(remote_cfg(redis_server.url))
    used, limit = client.server_memory()
    assert 0 < used < limit
    assert limit == 64 * 2**20  # the fixture's maxmemory 64mb
    lookups = RemoteLookups(RemoteClient(remote_cfg(redis_server.url)), "p", rank_labels(1))
    try:
        for _ in range(10_000):  # the thread reads the figures at once, then every MEMORY_POLL_S
            if lookups.server_memory != (0, 0):
                break
            time.sleep(0.001)
        assert lookups.server_memory[1] == 64 * 2**20 and lookups.server_memory[0] > 0
    finally:
        lookups.close()


def test_server_memory_sums_a_clusters_primaries(redis_cluster) -> None:  # noqa: F811
    used, limit = RemoteClient(remote_cfg([n.url for n in redis_cluster])).server_memory()
    assert limit == 64 * 2**20 * len(redis_cluster) and used > 0


def test_server_memory_is_none_while_the_server_is_down_and_leaves_the_breaker_alone(redis_server) -> None:  # noqa: F811
    """A gauge's poll must not count errors or open the breaker: lookups and fetches decide on those."""
    client = RemoteClient(remote_cfg(redis_server.url))
    redis_server.stop()
    assert client.server_memory() is None
    assert client.breaker.state == CLOSED and client.counters.errors == 0
    client.breaker.on_failure()  # opened by a lookup: the poll asks nothing
    assert client.breaker.state == OPEN and client.server_memory() is None


def test_parts_per_head_are_keyed_without_the_rank_and_split_like_vllm() -> None:
    per_head = TierIdentity(model="m", block_size=16, hash_algo="xxh3_128", layout="l", kv_heads=8)
    assert BlockParts.of(per_head, 0, 1).mine == tuple(f"h{h}of8" for h in range(8))
    assert [BlockParts.of(per_head, r, 2).mine for r in range(2)] == [("h0of8", "h1of8", "h2of8", "h3of8"),
                                                                     ("h4of8", "h5of8", "h6of8", "h7of8")]
    assert all(BlockParts.of(per_head, r, t).labels == BlockParts.of(per_head, 0, 1).labels
               for t in (2, 4, 8) for r in range(t))  # the lookups check the same keys at any TP
    assert [rank_heads(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # fewer heads: replicated
    assert [rank_heads(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]  # MLA's latent: every rank, one record
    with pytest.raises(HeadSplitError):
        rank_heads(6, 0, 4)
    per_rank = TierIdentity(model="m", block_size=16, hash_algo="xxh3_128", layout="l")
    assert BlockParts.of(per_rank, 1, 2).labels == rank_labels(2) and BlockParts.of(per_rank, 1, 2).mine == ("tp1of2",)
    assert key_prefix(per_head, "oc") != key_prefix(per_rank, "oc")  # the identity's fingerprint names the split
