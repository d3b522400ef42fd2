"""Per-request hints a client passes in vLLM's `kv_transfer_params` (the fake engine: the request's
`kv_transfer_params` too), read once per request.

Keys (others are left alone: they belong to other connectors, e.g. a disaggregated-prefill one):
- `store` (bool, default true): false: the blocks this request computes are not stored in the CPU tier
  (they are born dead in the admission filter; a later request that asks for them revives them);
- `session` (a non-empty string of at most `MAX_SESSION_CHARS` characters): the client session (an agent
  task, a conversation) the request belongs to;
- `close_session` (bool, default false; needs `session`): once this request finishes, the session is
  closed: the CPU blocks only that session used go to the eviction end and are not stored again unless
  requested again (scheduler_side/admission/filter.py).
A malformed hint never fails the request: `parse_hints` returns the defaults with a message saying what
was wrong, and the scheduler counts it (`num_bad_hints`) and logs it. Imports nothing from the project.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SESSION_CHARS = 256
HINT_KEYS = ("store", "session", "close_session")


@dataclass(slots=True, frozen=True)
class RequestHints:
    store: bool = True
    session: str | None = None
    close_session: bool = False


NO_HINTS = RequestHints()


def parse_hints(params: Any) -> tuple[RequestHints, str | None]:
    """(hints, None) for valid or absent hints; (NO_HINTS, what was wrong) for a malformed one."""
    if params is None:
        return NO_HINTS, None
    if not isinstance(params, Mapping):
        return NO_HINTS, f"kv_transfer_params must be a mapping, got {type(params).__name__}"
    if not any(key in params for key in HINT_KEYS):
        return NO_HINTS, None
    store, session, close = params.get("store", True), params.get("session"), params.get("close_session", False)
    if not isinstance(store, bool):
        return NO_HINTS, f"kv_transfer_params 'store': got {store!r}; allowed: true or false"
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS):
        return NO_HINTS, (f"kv_transfer_params 'session': got {str(session)[:40]!r}; allowed: a non-empty string "
                          f"of at most {MAX_SESSION_CHARS} characters")
    if not isinstance(close, bool):
        return NO_HINTS, f"kv_transfer_params 'close_session': got {close!r}; allowed: true or false"
    if close and session is None:
        return NO_HINTS, "kv_transfer_params 'close_session': true needs a 'session'"
    return RequestHints(store, session, close), None


def session_params(session: str, *, close: bool = False, store: bool = True) -> dict[str, Any]:
    """The `kv_transfer_params` for a request of `session` (close: the session ends with this request).
    For vllm.LLM: `SamplingParams(..., extra_args={"kv_transfer_params": session_params("task-1")})`."""
    params: dict[str, Any] = {"session": session}
    if close:
        params["close_session"] = True
    if not store:
        params["store"] = False
    return params
