"""Session hints for `vllm.LLM` users: tag requests with a session, and close a session.

    from offload_connector.vllm.sessions import close_session, session_params
    params = SamplingParams(max_tokens=64, extra_args={"kv_transfer_params": session_params("task-7")})
    ... the session's requests ...
    close_session(llm, "task-7")   # or session_params("task-7", close=True) on its last request

`session_params` builds the `kv_transfer_params` the connector reads (scheduler_side/admission/hints.py).
`close_session` calls the connector's scheduler side directly, so it needs vLLM's engine core in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); otherwise it raises `SessionCloseError` saying to send the
close on a request instead (the only way over the OpenAI server: `"kv_transfer_params": {"session": "task-7",
"close_session": true}` in the body of the session's last request). Reaches the engine through compat.py;
imports vLLM only when `close_session` is called.
"""

from __future__ import annotations

from typing import Any

from offload_connector.vllm.compat import in_process_connector, in_process_scheduler
from scheduler_side.admission.hints import session_params

__all__ = ["SessionCloseError", "close_session", "session_params"]


class SessionCloseError(ValueError):
    """`close_session` cannot reach the connector: the message says why and what to do instead."""


def close_session(llm: Any, session: str) -> int:
    """Close `session` now in the in-process engine of `llm`; returns how many CPU copies were demoted."""
    if not isinstance(session, str) or not session:
        raise SessionCloseError(f"session: got {session!r}; allowed: a non-empty string")
    if in_process_scheduler(llm) is None:
        raise SessionCloseError("close_session needs vLLM's engine core in this process "
                                "(VLLM_ENABLE_V1_MULTIPROCESSING=0); otherwise pass "
                                "session_params(session, close=True) as the kv_transfer_params of the "
                                "session's last request")
    from offload_connector.vllm.connector import OffloadConnector

    connector = in_process_connector(llm)
    offload = connector.offload if isinstance(connector, OffloadConnector) else None
    if offload is None:
        raise SessionCloseError("this engine does not run OffloadConnector (kv_transfer_config "
                                "kv_connector='OffloadConnector') on its scheduler side")
    return offload.close_session(session)
