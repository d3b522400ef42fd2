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

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from offload_connector.remote_breaker import CircuitBreaker, RemoteCounters
from offload_connector.remote_config import RemoteConfig, redact, remote_urls

logger = logging.getLogger(__name__)


def _redis() -> Any:
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the remote tier needs the `redis` package: pip install 'offload-connector[remote]'") from exc
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
        was = self.breaker.state
        self.breaker.on_failure()
        if was != "open":
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
