"""Session hints for `vllm.LLM` users: tag requests with a session, and close a session.

    from offload_connector.vllm.sessions import close_session, session_params
    params = SamplingParams(max_tokens=64, extra_args={"kv_transfer_params": session_params("task-7")})
    ... the session's requests ...
    close_session(llm, "task-7")   # or session_params("task-7", close=True) on its last request

`session_params` builds the `kv_transfer_params` the connector reads (scheduler_side/admission/hints.py).
`close_session` calls the connector's scheduler side directly, so it needs vLLM's engine core in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); otherwise it raises `SessionCloseError` saying to send the
close on a request instead (the only way over the OpenAI server: `"kv_transfer_params": {"session": "task-7",
"close_session": true}` in the body of the session's last request). Imports vLLM only through `llm`.
"""

from __future__ import annotations

from typing import Any

from scheduler_side.admission.hints import session_params

__all__ = ["SessionCloseError", "close_session", "session_params"]


class SessionCloseError(ValueError):
    """`close_session` cannot reach the connector: the message says why and what to do instead."""


def close_session(llm: Any, session: str) -> int:
    """Close `session` now in the in-process engine of `llm`; returns how many CPU copies were demoted."""
    if not isinstance(session, str) or not session:
        raise SessionCloseError(f"session: got {session!r}; allowed: a non-empty string")
    core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        raise SessionCloseError("close_session needs vLLM's engine core in this process "
                                "(VLLM_ENABLE_V1_MULTIPROCESSING=0); otherwise pass "
                                "session_params(session, close=True) as the kv_transfer_params of the "
                                "session's last request")
    connector = getattr(scheduler, "connector", None)
    offload = getattr(connector, "offload", None)
    if offload is None:
        raise SessionCloseError("this engine does not run OffloadConnector (kv_transfer_config "
                                "kv_connector='OffloadConnector') on its scheduler side")
    return offload.close_session(session)
