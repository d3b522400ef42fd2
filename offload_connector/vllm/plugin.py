"""vLLM general plugin (entry point `vllm.general_plugins: offload_connector`).

`register()` does two things, in every process where vLLM loads its plugins:

- It adds the name `OffloadConnector` to vLLM's `KVConnectorFactory` registry as a *lazy* entry (module
  path + class name), so `{"kv_connector": "OffloadConnector", "kv_role": "kv_both"}` works without
  `kv_connector_module_path`. The factory imports `offload_connector.vllm_connector` only when a
  connector class is looked up. A name already taken by vLLM itself (a future built-in
  `OffloadConnector`) is left alone with a warning: set `kv_connector_module_path` to pick ours.
- It wraps `EngineArgs.create_engine_config`, which every vLLM entry point (`LLM`, the OpenAI server,
  `vllm serve`) calls to build its `VllmConfig`, in the process the user started, so that a mistake stops
  start-up before the engine core, the workers, the model or any cache exist (early_check.py):
  before vLLM builds its config, vLLM's own offload flags beside ours are refused and our config is
  parsed (ours selected directly); after, `check_engine_config` checks the installed vLLM's version
  (`UnsupportedSetupError` outside the supported range), parses our config (also as a child of
  `MultiConnector`), refuses a config that serves one KV-cache group for a Mamba hybrid (vLLM cannot run
  one with its hybrid KV cache manager off) and sizes the CPU tier against the model's KV shape and the
  host's MemAvailable. Then, on vLLM's CPU platform, `leave_cores_to_the_model` keeps vLLM's executor
  from reserving a core for our connector (cpu_cores.py).
  vLLM loads plugins before that call (`EngineArgs.__post_init__`). The only connector hook vLLM calls
  with our config earlier is `requires_piecewise_for_cudagraph`, inside `VllmConfig.__post_init__` and
  only on GPUs with CUDA graphs; it checks too, and the wrapper re-raises our `ConfigError` from the
  pydantic `ValidationError` that wraps it there. Without the plugin the connector still checks when vLLM
  creates it, after the model is loaded.
- A refusal is one line: the server entry points (`usage_context` API_SERVER, OPENAI_API_SERVER,
  OPENAI_BATCH_RUNNER: command lines, like argparse's errors) exit with status 1 and print only
  `ConfigError: <message>`; in a Python program (`LLM`, engine code) the error is raised with no frames of
  ours, so its traceback is the caller's and its last line is the message.

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
from offload_connector.lower_tiers import lower_tier_sections
from offload_connector.sizing import mem_available_bytes
from offload_connector.vllm import compat, cpu_cores
from offload_connector.vllm.early_check import (
    CONNECTOR_NAME,
    MODULE_PATH,
    check_capacity,
    check_engine_args,
    selects_ours,
)
from offload_connector.vllm.engine_setup import keeps_hybrid_manager, located_in_extra_config, resolve_config
from offload_connector.vllm.errors import UnsupportedSetupError

logger = logging.getLogger(__name__)

# vLLM's usage contexts of its command-line servers: there a refusal exits with one line, no traceback.
COMMAND_LINE_CONTEXTS = ("API_SERVER", "OPENAI_API_SERVER", "OPENAI_BATCH_RUNNER")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if not compat.is_registered(CONNECTOR_NAME):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    elif not selects_ours(CONNECTOR_NAME, None):
        logger.warning("vLLM already registers a connector named %s; set kv_connector_module_path=%r to "
                       "use offload-connector's", CONNECTOR_NAME, MODULE_PATH)
    install_config_check()


def install_config_check() -> bool:
    """Wrap `EngineArgs.create_engine_config` to run `check_engine_config` on the config it returns.

    Returns whether the wrapper is in place (False: this vLLM has no such method; the connector then
    checks its config when vLLM creates it).
    """
    return compat.wrap_create_engine_config(_checking)


def _checking(create: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            check_engine_args(self)
            keep_hma_off_for_one_group_configs(self)
            cpu_cores.take_back_ours()  # set for an earlier engine of this process (or its parent)
            try:
                vllm_config = create(self, *args, **kwargs)
            except ValueError as err:
                ours = compat.error_raised_in_config(err, ConfigError)
                if ours is None:
                    raise
                raise ours from None  # our message as the last line, not pydantic's framing of it
            check_engine_config(vllm_config)
            leave_cores_to_the_model(vllm_config)
        except (ConfigError, UnsupportedSetupError) as err:
            raise refusal(err, compat.usage_context_name(args, kwargs)) from None
        return vllm_config

    return create_engine_config


def refusal(err: ConfigError | UnsupportedSetupError, usage_context: str | None) -> BaseException:
    """What stops start-up with `err` as one line: for a command-line server (`usage_context`, a
    `UsageContext` name) a `SystemExit` (status 1) that prints only `ConfigError: <message>`; anywhere else
    `err` without our frames in its traceback."""
    if usage_context in COMMAND_LINE_CONTEXTS:
        return SystemExit(f"{type(err).__name__}: {err}")
    return err.with_traceback(None)


def keep_hma_off_for_one_group_configs(engine_args: Any) -> None:
    """Before vLLM builds its config: when our connector alone is selected with a config that supports one
    KV-cache group only (`store_policy: lazy` set explicitly, or a lower tier such as `remote`) and the user left
    `disable_hybrid_kv_cache_manager` unset, set it (as vLLM 0.32 did for every connector before ours
    declared `SupportsHMA`), so a hybrid model runs with one group instead of failing at start-up (a Mamba
    hybrid cannot: `check_mamba_hybrid` then refuses the config, naming the key). An unset
    `store_policy` keeps it on: with several groups it means eager (`resolve_config`). A model with one
    group is unaffected; an explicit setting is left alone (the connector then refuses several groups with
    an error naming the keys). Parses only; a bad config is left for the checks."""
    ktc = engine_args.kv_transfer_config
    if ktc is None or engine_args.disable_hybrid_kv_cache_manager is not None:
        return
    if ktc.kv_connector != CONNECTOR_NAME and ktc.kv_connector_module_path != MODULE_PATH:
        return  # another connector, or MultiConnector (its children are found only with vLLM's config)
    try:
        config = resolve_config(ktc.kv_connector_extra_config, num_kv_groups=2)  # as a hybrid model runs it
    except ConfigError:
        return  # raised by check_engine_config once vLLM's config exists, as for any bad key
    if keeps_hybrid_manager(config):
        return
    engine_args.disable_hybrid_kv_cache_manager = True
    tiers = [name for name, _ in lower_tier_sections(config)]
    why = f"store_policy: {config.store_policy}" if config.store_policy != "eager" else f"a {tiers[0]} tier"
    logger.info("OffloadConnector with %s supports one KV-cache group: vLLM's hybrid KV cache manager is off "
                "(hybrid models run with one group; store_policy eager or unset, without lower tiers, keeps it "
                "on)", why)


def check_engine_config(vllm_config: Any) -> None:
    """If `vllm_config` selects our connector, alone or as a child of vLLM's `MultiConnector`: raise
    `UnsupportedSetupError` when the installed vLLM is outside the supported range, `ConfigError` when our
    config is bad or its CPU tier holds fewer than 2 blocks of this model per rank or more than this host's
    MemAvailable. Parses and sizes only."""
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return
    for connector_cls, config in _connectors_of(vllm_config):
        if _is_ours(connector_cls):
            compat.check_vllm_version()
            groups = 2 if compat.is_mamba_hybrid(config) else 1  # several groups: unset means eager
            extra = config.kv_transfer_config.kv_connector_extra_config
            ours_config = resolve_config(extra, groups)
            check_mamba_hybrid(config, ours_config)
            try:
                check_capacity(config, ours_config, mem_available_bytes())
            except ConfigError as err:
                raise located_in_extra_config(err, extra) from None


def leave_cores_to_the_model(vllm_config: Any) -> None:
    """If `vllm_config` selects our connector, alone or beside others in vLLM's `MultiConnector`: keep vLLM's
    CPU executor from reserving a core for it (cpu_cores.py; beside another connector, say what to set)."""
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return
    ours = [_is_ours(connector_cls) for connector_cls, _ in _connectors_of(vllm_config)]
    if any(ours):
        cpu_cores.leave_cores_to_the_model(vllm_config, only_ours=all(ours))


def _is_ours(connector_cls: Any) -> bool:
    """Whether a connector class is our `OffloadConnector` or a subclass of it."""
    ours = sys.modules.get(MODULE_PATH)  # imported by vLLM's lookup if the class is ours or a subclass
    return ours is not None and isinstance(connector_cls, type) and issubclass(connector_cls, ours.OffloadConnector)


def check_mamba_hybrid(vllm_config: Any, config: Any) -> None:
    """A Mamba/SSM hybrid (vLLM's `ModelConfig.is_hybrid`) runs only with vLLM's hybrid KV cache manager, so
    only with a config that serves several KV-cache groups (eager stores, no lower tier): else
    `UnsupportedSetupError` naming the key, before vLLM fails later on specs it cannot unify."""
    if not compat.is_mamba_hybrid(vllm_config) or keeps_hybrid_manager(config):
        return
    tiers = [name for name, _ in lower_tier_sections(config)]
    key = f"the {tiers[0]} tier ({tiers[0]} section)" if tiers else f"store_policy={config.store_policy!r}"
    raise UnsupportedSetupError(
        f"OffloadConnector: {key} supports one KV-cache group, and this Mamba hybrid "
        f"({', '.join(vllm_config.model_config.architectures or [])}) keeps its state and attention in several "
        "(vLLM cannot turn its hybrid KV cache manager off for it); allowed: store_policy: eager (or unset) "
        "and no remote or disk section")


def _connectors_of(vllm_config: Any) -> list[tuple[Any, Any]]:
    """(class, the `VllmConfig` it will be created with) for the connector `vllm_config` selects or, when that
    is a `MultiConnector`, for each of its children, found the way `MultiConnector` itself finds them. A
    `connectors` list that `MultiConnector` cannot read is left for it to refuse, with its own error."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    connector_cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    try:
        children = compat.multi_connector_children(connector_cls, vllm_config)
    except Exception as err:  # noqa: BLE001 - vLLM refuses it when it creates the MultiConnector
        logger.debug("MultiConnector children not checked early: %s", err)
        return []
    return [(connector_cls, vllm_config)] if children is None else children
