"""The cores vLLM's CPU executor keeps from the model because a KV connector is configured.

vLLM's CPU build binds each worker's OpenMP threads to cores and keeps some cores back for the engine
core (`compat_platform.cpu_cores_reserved`). Whenever any `kv_transfer_config` is set it keeps one more per rank,
for NIXL's transfer threads. This connector needs no core of its own: its copies run on threads that
sleep between jobs. On a small host that extra reservation costs the model a core. On 2 cores, vLLM
reserves both, falls back to reserving none, and the worker's second OpenMP thread shares a core with the
engine core's busy loop, which made decode 2-5x slower (docs/benchmarks.md).

`leave_cores_to_the_model(vllm_config, only_ours)`, called by the plugin once vLLM's config exists, sets
`VLLM_CPU_NUM_OF_RESERVED_CPU` to what vLLM reserves without a connector, and logs one line saying so,
when all of these hold:
- the engine runs on vLLM's CPU platform with its multiprocess executor (the one that binds threads);
- every connector of the config is ours (`only_ours`); next to another connector, which may use the core,
  the line only says what to set;
- the user has not set `VLLM_CPU_NUM_OF_RESERVED_CPU` (their value is kept, and the line says so);
- the connector raises vLLM's reservation.
The engine core process, which builds the executor, inherits the variable. Our setting is marked with
`OFFLOAD_CONNECTOR_RESERVED_CPU` (the value we set, as vLLM marks its own `OMP_NUM_THREADS`), so that the
next config built in this process, or in a process started from it, first takes it back
(`take_back_ours`) instead of mistaking it for the user's, and the connector's start-up line in the
engine's processes says it is in force (`startup_note`). Changes no state other than these two variables
(and our loggers, given vLLM's handler so the line is seen).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from offload_connector.vllm.compat_platform import RESERVED_CPU_ENV, cpu_cores_reserved, on_cpu
from offload_connector.vllm.engine_setup import adopt_vllm_logging

logger = logging.getLogger(__name__)

OURS_MARK_ENV = "OFFLOAD_CONNECTOR_RESERVED_CPU"


def take_back_ours() -> None:
    """Unset `VLLM_CPU_NUM_OF_RESERVED_CPU` if it still holds the value this module set (a value the user
    changed since is theirs, and kept); drop the mark either way."""
    ours = os.environ.pop(OURS_MARK_ENV, None)
    if ours is not None and os.environ.get(RESERVED_CPU_ENV) == ours:
        del os.environ[RESERVED_CPU_ENV]


def startup_note() -> str:
    """The clause the connector's start-up line carries while our setting is in force (inherited by the
    engine core and the workers), else ""."""
    ours = os.environ.get(OURS_MARK_ENV)
    if ours is None or os.environ.get(RESERVED_CPU_ENV) != ours:
        return ""
    return f"; {RESERVED_CPU_ENV}={ours}, as without a KV connector (set by offload-connector's vLLM plugin)"


def leave_cores_to_the_model(vllm_config: Any, only_ours: bool) -> int | None:
    """Set `VLLM_CPU_NUM_OF_RESERVED_CPU` to the cores vLLM reserves without a KV connector, under the
    conditions of the module docstring; returns the value set, None when nothing was set."""
    if not on_cpu(vllm_config) or vllm_config.parallel_config.distributed_executor_backend != "mp":
        return None
    adopt_vllm_logging()  # the line below reaches vLLM's log in this process too
    user_value = os.environ.get(RESERVED_CPU_ENV)
    if user_value is not None:
        logger.info("OffloadConnector: keeping %s=%s as set (the connector needs no reserved core)",
                    RESERVED_CPU_ENV, user_value)
        return None
    with_connector = cpu_cores_reserved(vllm_config, vllm_config.kv_transfer_config)
    without = cpu_cores_reserved(vllm_config, None)
    if with_connector is None or without is None or with_connector <= without:
        return None
    if not only_ours:
        logger.info("vLLM's CPU executor reserves %d cores for this engine with a KV connector, %d without; "
                    "OffloadConnector needs none of them: if the other connectors need none either, set %s=%d",
                    with_connector, without, RESERVED_CPU_ENV, without)
        return None
    os.environ[RESERVED_CPU_ENV] = os.environ[OURS_MARK_ENV] = str(without)
    logger.info("OffloadConnector: %s=%d, the cores vLLM's CPU executor reserves without a KV connector "
                "(%d with one, counting a core for NIXL's transfers; this connector needs none, so vLLM's warning "
                "that %s is below its minimum is expected; set %s to choose)",
                RESERVED_CPU_ENV, without, with_connector, RESERVED_CPU_ENV, RESERVED_CPU_ENV)
    return without
