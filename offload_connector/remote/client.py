"""The remote tier's client: redis-py (with hiredis when installed) behind a circuit breaker.

One `RemoteClient` per thread that talks to the server (the scheduler's lookup thread, the worker's fetch
and write threads): redis-py clients are thread-safe, but one each keeps a slow call of one from delaying
another. Every call is pipelined (one round trip per batch), has the socket timeout `timeout_ms`, and never
raises: a connection-level failure (refused, reset, timed out, wrong password, cluster down) counts an
error, opens the breaker and answers "nothing" (a miss, a dropped write); a command the server refuses
(e.g. OOM under `maxmemory` without an evictable key) counts an error and answers a miss for that key.
While the breaker is open no call reaches the server. redis-py's own retries are off: the breaker decides.

A list of URLs is a Redis Cluster (its seed nodes); pipelines then split per node (redis-py's ClusterPipeline).
`redis` is imported when a client is built: the package works without the `[remote]` extra until then.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from offload_connector.remote.breaker import CircuitBreaker, RemoteCounters
from offload_connector.remote.config import RemoteConfig, redact, remote_urls

logger = logging.getLogger(__name__)

# How many of KEYS exist before the first one that does not (`leading_present`).
# `no-writes` (Redis >= 7.0, Valkey): the server runs it under `maxmemory` too; an older server refuses to
# load it and the client falls back to EXISTS.
LEADING_SCRIPT = ("#!lua flags=no-writes\nfor i, key in ipairs(KEYS) do if redis.call('EXISTS', key) == 0 then return i - 1 end end "
                  "return #KEYS")
LEADING_SCRIPT_SHA = hashlib.sha1(LEADING_SCRIPT.encode()).hexdigest()  # noqa: S324 - Redis names scripts so


def _redis() -> Any:
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the remote tier needs the `redis` package (the [remote] extra): pip install redis hiredis") from exc
    return redis


def make_redis(remote: RemoteConfig) -> Any:
    """A redis-py client for the configured URL(s): `Redis` for one URL, `RedisCluster` for several."""
    redis = _redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeout = remote.timeout_ms / 1000
    urls = remote_urls(remote)
    common: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
    if len(urls) == 1:
        return redis.Redis.from_url(urls[0], retry=Retry(NoBackoff(), 0), **common)
    from redis.cluster import ClusterNode, RedisCluster

    first = urlsplit(urls[0])
    nodes = [ClusterNode(urlsplit(u).hostname, urlsplit(u).port) for u in urls]
    auth = dict(username=unquote(first.username) if first.username else None,
                password=unquote(first.password) if first.password else None)
    return RedisCluster(startup_nodes=nodes, ssl=first.scheme == "rediss", retry=Retry(NoBackoff(), 0),
                        **auth, **common)


class RemoteClient:
    """Pipelined EXISTS / GET / SET NX EX / DEL that never raise; see the module docstring."""

    def __init__(self, remote: RemoteConfig, counters: RemoteCounters | None = None,
                 breaker: CircuitBreaker | None = None) -> None:
        self.remote = remote
        self.counters = counters if counters is not None else RemoteCounters()
        self.breaker = breaker if breaker is not None else CircuitBreaker(
            remote.breaker_backoff_ms / 1000, remote.breaker_max_backoff_ms / 1000)
        self._where = ", ".join(redact(u) for u in remote_urls(remote))
        self._redis: Any = None  # built on first use: a cluster client connects when built
        exceptions = _redis().exceptions
        self._conn_errors = (exceptions.ConnectionError, exceptions.TimeoutError, exceptions.ClusterError,
                             exceptions.RedisClusterException, OSError)
        self._redis_error = exceptions.RedisError
        self._no_script = exceptions.NoScriptError
        self._script_sha: str | None = LEADING_SCRIPT_SHA  # None: the server refuses scripts
        self._script_loads = 0

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = make_redis(self.remote)
        return self._redis

    def _run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any] | None:
        """Send `commands` in one pipeline: replies (an exception object for a refused command), or None
        when the breaker is open or the connection failed."""
        if not commands:
            return []
        if not self.breaker.allow():
            return None
        try:
            pipe = self._client().pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            replies = pipe.execute(raise_on_error=False)
        except self._conn_errors as exc:
            self._on_connection_error(exc)
            return None
        except self._redis_error as exc:  # the whole pipeline refused (e.g. a cluster reply we cannot use)
            self.counters.errors += len(commands)
            logger.warning("remote tier %s refused a pipeline: %s", self._where, exc)
            return None
        self.breaker.on_success()
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            self.counters.errors += len(failed)
            if any(isinstance(r, self._conn_errors) for r in failed):
                self._on_connection_error(failed[0])
        return replies

    def _on_connection_error(self, exc: BaseException) -> None:
        self.counters.errors += 1
        if self.breaker.on_failure():  # (only the call that opened it warns)
            logger.warning("remote tier %s unavailable (%s: %s); pausing it", self._where, type(exc).__name__, exc)
        self._redis = _drop(self._redis)

    # ---- commands --------------------------------------------------------------------------------
    def exists_flags(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key exists (one pipeline), or None when the server cannot be asked."""
        replies = self._run([("exists", k) for k in keys])
        if replies is None:
            return None
        self.counters.lookups += 1
        return [r == 1 for r in replies]

    def leading_present(self, key_lists: Sequence[Sequence[bytes]]) -> list[int] | None:
        """For each list, how many of its keys exist before its first missing one (one round trip), or None
        when the server cannot be asked.

        On one node each list is one `EVALSHA` of `LEADING_SCRIPT` (the server stops at the first missing key):
        one command per list instead of one EXISTS per key, about 5x less of the caller's CPU for 64 keys.
        A cluster (keys of one list live on different nodes, which a script cannot span) or a server that
        refuses scripts (they can be disabled) gets the EXISTS pipeline, counted here."""
        if self._script_sha is not None and len(remote_urls(self.remote)) == 1:
            replies = self._run([("evalsha", self._script_sha, len(keys), *keys) for keys in key_lists])
            if replies is None:
                return None
            if not any(isinstance(r, self._redis_error) for r in replies):
                self.counters.lookups += 1
                self._script_loads = 0
                return [int(r) for r in replies]
            self._load_script(replies)  # loaded (a restarted server forgets scripts), or EXISTS from now on
            return self.leading_present(key_lists)
        flags = self.exists_flags([k for keys in key_lists for k in keys])
        if flags is None:
            return None
        out, i = [], 0
        for keys in key_lists:
            run = next((j for j, present in enumerate(flags[i:i + len(keys)]) if not present), len(keys))
            out.append(run)
            i += len(keys)
        return out

    def _load_script(self, replies: Sequence[Any]) -> None:
        """After a script reply that is an error: load the script (NOSCRIPT; at most 3 times in a row), or
        give up on scripts for good (refused, e.g. by an ACL or an older server)."""
        refused = next(r for r in replies if isinstance(r, self._redis_error))
        self.counters.errors -= sum(isinstance(r, Exception) for r in replies)  # not the server's fault
        if isinstance(refused, self._no_script) and self._script_loads < 3:
            self._script_loads += 1
            loaded = self._run([("script_load", LEADING_SCRIPT)])
            if loaded is None:
                return  # the server cannot be asked now: a miss, scripts kept
            if isinstance(loaded[0], str | bytes):
                self._script_sha = loaded[0].decode() if isinstance(loaded[0], bytes) else loaded[0]
                return
        logger.warning("remote tier %s refuses scripts (%s); existence checks use EXISTS", self._where, refused)
        self._script_sha = None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        """Each key's value (None: absent or refused), or None when the server cannot be asked."""
        replies = self._run([("get", k) for k in keys])
        if replies is None:
            return None
        return [r if isinstance(r, bytes) else None for r in replies]

    def set_nx_many(self, items: Sequence[tuple[bytes, bytes]], ttl_seconds: int) -> list[bool | None] | None:
        """SET key value NX EX ttl for each item: True written, False already there, None refused; or None
        when the server cannot be asked."""
        replies = self._run([("set", k, v, ttl_seconds, None, True) for k, v in items])  # ex, px, nx
        if replies is None:
            return None
        return [None if isinstance(r, Exception) else bool(r) for r in replies]

    def delete(self, keys: Sequence[bytes]) -> None:
        self._run([("delete", k) for k in keys])

    def sibling(self) -> RemoteClient:
        """A client of the same server with connections of its own, sharing this one's breaker and counters
        (a second thread's calls then never wait behind this client's)."""
        return RemoteClient(self.remote, self.counters, self.breaker)

    def server_memory(self) -> tuple[int, int] | None:
        """(used_memory, maxmemory) from INFO memory, summed over a cluster's primaries (maxmemory 0: no
        limit set), or None when the server cannot be asked. The server's figures, every namespace's. For
        gauges only: never counts an error and never moves the breaker (asks nothing while it is open)."""
        if self.breaker.state == "open":
            return None
        try:
            client = self._client()
            if len(remote_urls(self.remote)) > 1:
                reply = client.info("memory", target_nodes=client.PRIMARIES)
            else:
                reply = client.info("memory")
        except (*self._conn_errors, self._redis_error) as exc:
            logger.debug("remote tier %s: no INFO memory (%s: %s)", self._where, type(exc).__name__, exc)
            return None
        infos = [reply] if "used_memory" in reply else [v for v in reply.values() if isinstance(v, dict)]
        return sum(int(i.get("used_memory", 0)) for i in infos), sum(int(i.get("maxmemory", 0)) for i in infos)

    def close(self) -> None:
        self._redis = _drop(self._redis)


def _drop(client: Any) -> None:
    """Close a client's connections (a failed connection is rebuilt on the next call)."""
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail in many ways; nothing to do
            pass
    return None
