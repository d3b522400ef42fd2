"""vLLM general plugin (entry point `vllm.general_plugins: offload_connector`).

`register()` adds the name `OffloadConnector` to vLLM's `KVConnectorFactory` registry as a *lazy* entry
(module path + class name), so `{"kv_connector": "OffloadConnector", "kv_role": "kv_both"}` works without
`kv_connector_module_path`. It imports neither our connector module nor anything heavy: the factory only
imports `offload_connector.vllm_connector` when a connector is actually created.

vLLM may call plugins several times and in several processes; registering is idempotent. A name already
taken by vLLM itself (a future built-in `OffloadConnector`) is left alone with a warning: set
`kv_connector_module_path` to pick ours explicitly.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "OffloadConnector"
MODULE_PATH = "offload_connector.vllm_connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    loader = getattr(KVConnectorFactory, "_registry", {}).get(CONNECTOR_NAME)
    if loader is None:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    elif not _is_ours(loader):
        logger.warning("vLLM already registers a connector named %s; set kv_connector_module_path=%r to "
                       "use offload-connector's", CONNECTOR_NAME, MODULE_PATH)


def _is_ours(loader: object) -> bool:
    """Whether a registry entry is the lazy loader this function registered (closure holds our path)."""
    closure = getattr(loader, "__closure__", None) or ()
    return any(getattr(cell, "cell_contents", None) == MODULE_PATH for cell in closure)
