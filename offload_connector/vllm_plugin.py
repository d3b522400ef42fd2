"""vLLM general plugin (entry point `vllm.general_plugins: offload_connector`).

`register()` does two things, in every process where vLLM loads its plugins:

- It adds the name `OffloadConnector` to vLLM's `KVConnectorFactory` registry as a *lazy* entry (module
  path + class name), so `{"kv_connector": "OffloadConnector", "kv_role": "kv_both"}` works without
  `kv_connector_module_path`. The factory imports `offload_connector.vllm_connector` only when a
  connector class is looked up. A name already taken by vLLM itself (a future built-in
  `OffloadConnector`) is left alone with a warning: set `kv_connector_module_path` to pick ours.
- It wraps `EngineArgs.create_engine_config`, which every vLLM entry point (`LLM`, the OpenAI server,
  `vllm serve`) calls to build its `VllmConfig`, in the process the user started, so that our config is
  checked as soon as vLLM's config exists (ours alone or as a child of `MultiConnector`):
  `check_engine_config` checks the installed vLLM's version
  (`UnsupportedSetupError` outside the supported range), parses `kv_connector_extra_config` (and
  the YAML file it names) and raises our `ConfigError` there, before the engine core, the workers, the
  model or any cache exist. vLLM loads plugins before that call (`EngineArgs.__post_init__`). The only
  connector hook vLLM calls with our config earlier is `requires_piecewise_for_cudagraph`, inside
  `VllmConfig.__post_init__` and only on GPUs with CUDA graphs; it checks too, and the wrapper re-raises
  our `ConfigError` from the pydantic `ValidationError` that wraps it there. Without the plugin the
  connector still checks when vLLM creates it, after the model is loaded.

Registering and wrapping are idempotent (vLLM may call plugins several times). Imports vLLM only inside
the functions, and never imports our connector module itself (vLLM's factory does, for a config that
selects it).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from offload_connector.config import ConfigError
from offload_connector.vllm_setup import check_vllm_version, resolve_config

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "OffloadConnector"
MODULE_PATH = "offload_connector.vllm_connector"
_CHECKS_CONFIG = "_offload_connector_checks_config"  # marks our wrapper of create_engine_config


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    loader = getattr(KVConnectorFactory, "_registry", {}).get(CONNECTOR_NAME)
    if loader is None:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    elif not _is_ours(loader):
        logger.warning("vLLM already registers a connector named %s; set kv_connector_module_path=%r to "
                       "use offload-connector's", CONNECTOR_NAME, MODULE_PATH)
    install_config_check()


def _is_ours(loader: object) -> bool:
    """Whether a registry entry is the lazy loader this function registered (closure holds our path)."""
    closure = getattr(loader, "__closure__", None) or ()
    return any(getattr(cell, "cell_contents", None) == MODULE_PATH for cell in closure)


def install_config_check() -> bool:
    """Wrap `EngineArgs.create_engine_config` to run `check_engine_config` on the config it returns.

    Returns whether the wrapper is in place (False: this vLLM has no such method; the connector then
    checks its config when vLLM creates it).
    """
    from vllm.engine.arg_utils import EngineArgs

    create = getattr(EngineArgs, "create_engine_config", None)
    if create is None:
        return False
    if not getattr(create, _CHECKS_CONFIG, False):
        EngineArgs.create_engine_config = _checking(create)
    return True


def _checking(create: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        keep_hma_off_for_one_group_configs(self)
        try:
            vllm_config = create(self, *args, **kwargs)
        except ValueError as err:
            ours = _config_error_in(err)
            if ours is None:
                raise
            raise ours from None  # our message as the last line, not pydantic's framing of it
        check_engine_config(vllm_config)
        return vllm_config

    setattr(create_engine_config, _CHECKS_CONFIG, True)
    return create_engine_config


def keep_hma_off_for_one_group_configs(engine_args: Any) -> None:
    """Before vLLM builds its config: when our connector alone is selected with a config that supports one
    KV-cache group only (`store_policy: lazy` set explicitly, or a `remote` tier) and the user left
    `disable_hybrid_kv_cache_manager` unset, set it (as vLLM 0.32 did for every connector before ours
    declared `SupportsHMA`), so a hybrid model runs with one group instead of failing at start-up. An unset
    `store_policy` keeps it on: with several groups it means eager (`resolve_config`). A model with one
    group is unaffected; an explicit setting is left alone (the connector then refuses several groups with
    an error naming the keys). Parses only; a bad config is left for the checks."""
    ktc = getattr(engine_args, "kv_transfer_config", None)
    if ktc is None or getattr(engine_args, "disable_hybrid_kv_cache_manager", False) is not None:
        return
    if ktc.kv_connector != CONNECTOR_NAME and ktc.kv_connector_module_path != MODULE_PATH:
        return  # another connector, or MultiConnector (its children are found only with vLLM's config)
    try:
        config = resolve_config(ktc.kv_connector_extra_config, num_kv_groups=2)  # as a hybrid model runs it
    except ConfigError:
        return  # raised by check_engine_config once vLLM's config exists, as for any bad key
    if config.store_policy == "eager" and config.remote is None:
        return
    engine_args.disable_hybrid_kv_cache_manager = True
    why = f"store_policy: {config.store_policy}" if config.store_policy != "eager" else "a remote tier"
    logger.info("OffloadConnector with %s supports one KV-cache group: vLLM's hybrid KV cache manager is off "
                "(hybrid models run with one group; store_policy eager or unset, without remote, keeps it on)", why)


def _config_error_in(err: ValueError) -> ConfigError | None:
    """Our `ConfigError`, as raised or as wrapped by pydantic (raised inside `VllmConfig.__post_init__`)."""
    if isinstance(err, ConfigError):
        return err
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return None
    for detail in errors():
        cause = (detail.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            return cause
    return None


def check_engine_config(vllm_config: Any) -> None:
    """If `vllm_config` selects our connector, alone or as a child of vLLM's `MultiConnector`: raise
    `UnsupportedSetupError` when the installed vLLM is outside the supported range, `ConfigError` when our
    config is bad. Parses only."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return
    for connector_cls, config in _connectors_of(vllm_config):
        ours = sys.modules.get(MODULE_PATH)  # imported by vLLM's lookup if the class is ours or a subclass
        if ours is not None and isinstance(connector_cls, type) and issubclass(connector_cls, ours.OffloadConnector):
            check_vllm_version()
            resolve_config(config.kv_transfer_config.kv_connector_extra_config)


def _connectors_of(vllm_config: Any) -> list[tuple[Any, Any]]:
    """(class, the `VllmConfig` it will be created with) for the connector `vllm_config` selects or, when that
    is a `MultiConnector`, for each of its children, found the way `MultiConnector` itself finds them. A
    `connectors` list that `MultiConnector` cannot read is left for it to refuse, with its own error."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    connector_cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    children = getattr(connector_cls, "_get_connector_classes_and_configs", None)  # MultiConnector's
    if children is None:
        return [(connector_cls, vllm_config)]
    try:
        return list(children(vllm_config))
    except Exception as err:  # noqa: BLE001 - vLLM refuses it when it creates the MultiConnector
        logger.debug("MultiConnector children not checked early: %s", err)
        return []
