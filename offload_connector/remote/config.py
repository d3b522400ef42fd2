"""The `remote:` config section: a shared KV tier on a Redis-protocol server (Redis or Valkey) under the CPU tier.

Absent (the default) means no remote tier: nothing connects, nothing changes. Present, `url` is required.
`check_remote` returns the first problem as (key, value, allowed, detail) so that `config.py` raises its
`ConfigError` (this module imports only the leaf `auth_key.py` from the project: `config.py` imports it). After `load_config`,
`max_inflight_bytes` is an int and `url` a list of one URL (single node) or several (a Redis Cluster's
seed nodes).

Words: *fetch* is remote -> host pool, *write* is host pool -> remote (store and load keep their meaning).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from offload_connector.auth_key import auth_key_problem

SCHEMES = ("redis", "rediss")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class RemoteConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # `redis://[user:password@]host:port/db` or `rediss://` (TLS); a list of such URLs: a Redis Cluster
    url: str | list[str]
    namespace: str = "oc"  # first part of every key: separates deployments sharing one server
    ttl_seconds: Annotated[int, msgspec.Meta(ge=1)] = 86400  # SET ... EX: a key lives at most this long
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=60000)] = 200  # socket timeout, and how long a request waits
    max_inflight_bytes: int | str = "256MiB"  # write queue bound; writes beyond it are dropped (counted)
    # on_store: write-through, every block stored to the CPU tier; on_cpu_evict: write-back, a block when
    # the CPU tier evicts it (fewer writes; a block still on some CPU tier is not on the server)
    write: Literal["on_store", "on_cpu_evict"] = "on_store"
    max_lookup_blocks: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 512  # blocks asked about per lookup
    max_waiting_requests: Annotated[int, msgspec.Meta(ge=1)] = 64  # requests waiting on the tier at once
    breaker_backoff_ms: Annotated[int, msgspec.Meta(ge=1)] = 100  # first pause after a failure (doubles)
    breaker_max_backoff_ms: Annotated[int, msgspec.Meta(ge=1)] = 10000
    # a file of 16-64 secret bytes: every record carries a keyed BLAKE2b, and one without it is never served
    auth_key_file: str | None = None


URL_ALLOWED = ("'redis://[user:password@]host:port/db' or 'rediss://...' (TLS), or a non-empty list of "
               "such URLs (a Redis Cluster's seed nodes, db 0)")


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.hostname or ""
    return f"{parts.scheme}://{user}{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _url_problem(url: object, cluster: bool) -> str | None:
    if not isinstance(url, str) or not url:
        return "not a non-empty string"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in SCHEMES:
        return f"scheme {parts.scheme!r} is not one of {', '.join(SCHEMES)}"
    if not parts.hostname:
        return "no host"
    if port is None and cluster:
        return "a cluster seed needs host:port"
    db = parts.path.strip("/")
    if db and (not db.isdigit() or (cluster and db != "0")):
        return f"db {db!r} must be a number ({'0 in a cluster' if cluster else 'e.g. /0'})"
    if parts.query or parts.fragment:
        return "no query or fragment allowed"
    return None


def check_remote(remote: RemoteConfig) -> tuple[str, object, str, str] | None:
    """The first problem in a parsed `remote:` section, or None. Normalizes `url` to a list."""
    urls = [remote.url] if isinstance(remote.url, str) else list(remote.url)
    if not urls:
        return ("remote.url", remote.url, URL_ALLOWED, "empty list")
    for url in urls:
        problem = _url_problem(url, cluster=len(urls) > 1)
        if problem:
            return ("remote.url", redact(url) if isinstance(url, str) else url, URL_ALLOWED, problem)
    if len({urlsplit(u).scheme for u in urls}) > 1:
        return ("remote.url", [redact(u) for u in urls], URL_ALLOWED, "mixes redis:// and rediss://")
    if not _NAMESPACE_RE.match(remote.namespace):
        return ("remote.namespace", remote.namespace, "1-64 characters of A-Z a-z 0-9 _ . -", "")
    if (problem := auth_key_problem("remote.auth_key_file", remote.auth_key_file)) is not None:
        return problem
    if remote.breaker_max_backoff_ms < remote.breaker_backoff_ms:
        return ("remote.breaker_max_backoff_ms", remote.breaker_max_backoff_ms,
                f">= remote.breaker_backoff_ms ({remote.breaker_backoff_ms})", "")
    remote.url = urls
    return None


def remote_urls(remote: RemoteConfig) -> list[str]:
    """The URLs of a validated section (always a list after `load_config`)."""
    return [remote.url] if isinstance(remote.url, str) else list(remote.url)
