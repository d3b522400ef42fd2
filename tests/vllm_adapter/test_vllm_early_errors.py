"""Issue 12 item 7: a bad offload config stops vLLM while it builds its config, before any engine exists.

vLLM creates our connector only after the engine core has started and loaded the model (tens of seconds
into a server's start-up, the error buried under the engine's own traceback). The plugin checks the
config inside `EngineArgs.create_engine_config`, the call every entry point makes first; these tests go
through that same call (and through `vllm.LLM`) and check that our `ConfigError` comes out as it is,
naming the key and the file's absolute path, and that no engine core was ever constructed.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from offload_connector.config import ConfigError  # noqa: E402
from offload_connector.vllm.plugin import register  # noqa: E402

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_llama")
ENGINE_KWARGS = dict(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32,
                     enforce_eager=True, max_model_len=256, dtype="float32")


def offload(extra: dict, short_name: bool = False) -> KVTransferConfig:
    module = {} if short_name else {"kv_connector_module_path": "offload_connector.vllm_connector"}
    return KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config=extra, **module)


@pytest.fixture(autouse=True)
def plugin(tmp_path, monkeypatch) -> None:
    register()  # what vLLM does in EngineArgs.__post_init__ (explicit: VLLM_PLUGINS may leave it out)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "offload.yaml").write_text("store_policy: lazy\ntransfer:\n  num_streams: 0\n")


@pytest.mark.parametrize(("extra", "short_name", "key", "where"), [
    ({"store_polcy": "lazy"}, False, "store_polcy", "kv_connector_extra_config"),
    ({"cpu_bytes": "lots"}, True, "cpu_bytes", "kv_connector_extra_config"),
    ({"config_file": "offload.yaml"}, False, "transfer.num_streams", "offload.yaml"),
    ({"config_file": "missing.yaml"}, True, "config_file", "missing.yaml"),
])
def test_create_engine_config_refuses_a_bad_offload_config(tmp_path, extra: dict, short_name: bool,
                                                           key: str, where: str) -> None:
    args = EngineArgs(**ENGINE_KWARGS, kv_transfer_config=offload(extra, short_name))
    with pytest.raises(ConfigError) as err:
        args.create_engine_config()
    assert err.value.key == key
    if where.endswith(".yaml"):
        where = str(tmp_path.resolve() / where)  # relative in the config, absolute in the message
    assert where in str(err.value)


def test_create_engine_config_passes_a_good_offload_config() -> None:
    # The check is transparent: vLLM's config comes back with our settings untouched.
    wrapped = EngineArgs.create_engine_config
    register()  # vLLM may load plugins again: wrapped once
    assert EngineArgs.create_engine_config is wrapped
    extra = {"config_file": "offload.yaml", "transfer": {"num_streams": 3}}
    vllm_config = EngineArgs(**ENGINE_KWARGS, kv_transfer_config=offload(extra)).create_engine_config()
    assert vllm_config.kv_transfer_config.kv_connector_extra_config == extra


def multi(ours: KVTransferConfig) -> KVTransferConfig:
    """Ours second inside vLLM's MultiConnector, beside vLLM's ExampleConnector."""
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": "kv"}}
    child = {"kv_connector": ours.kv_connector, "kv_role": ours.kv_role,
             "kv_connector_extra_config": ours.kv_connector_extra_config}
    if ours.kv_connector_module_path:
        child["kv_connector_module_path"] = ours.kv_connector_module_path
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": [example, child]})


@pytest.mark.parametrize("short_name", [False, True])
def test_a_bad_offload_config_inside_a_multiconnector_is_refused_as_early(short_name: bool) -> None:
    args = EngineArgs(**ENGINE_KWARGS, kv_transfer_config=multi(offload({"store_polcy": "lazy"}, short_name)))
    with pytest.raises(ConfigError) as err:
        args.create_engine_config()
    assert err.value.key == "store_polcy"


def test_a_good_offload_config_inside_a_multiconnector_passes() -> None:
    extra = {"config_file": "offload.yaml", "transfer": {"num_streams": 3}}
    vllm_config = EngineArgs(**ENGINE_KWARGS, kv_transfer_config=multi(offload(extra))).create_engine_config()
    assert vllm_config.kv_transfer_config.kv_connector == "MultiConnector"


def test_llm_fails_before_the_engine_core_is_built(monkeypatch) -> None:
    from vllm import LLM
    from vllm.v1.engine.core import EngineCore

    def engine_core_built(*args, **kwargs) -> None:
        raise AssertionError("the engine core was built: the config error came too late")

    monkeypatch.setattr(EngineCore, "__init__", engine_core_built)
    with pytest.raises(ConfigError, match="store_polcy"):
        LLM(**ENGINE_KWARGS, kv_transfer_config=offload({"store_polcy": "lazy"}))


def test_connector_hook_checks_the_config_and_pydantic_wrapping_is_undone() -> None:
    """On GPUs with CUDA graphs vLLM calls `requires_piecewise_for_cudagraph` inside `VllmConfig`'s
    `__post_init__`, where pydantic turns any ValueError into a ValidationError: the plugin's wrapper
    raises our ConfigError itself. Other errors pass through unchanged."""
    import pydantic

    from offload_connector.vllm.connector import OffloadConnector
    from offload_connector.vllm.plugin import _checking

    assert OffloadConnector.requires_piecewise_for_cudagraph({"store_policy": "lazy"}) is False
    with pytest.raises(ConfigError, match="store_polcy"):
        OffloadConnector.requires_piecewise_for_cudagraph({"store_polcy": "lazy"})

    @pydantic.dataclasses.dataclass
    class Config:  # stands in for VllmConfig, a pydantic dataclass
        extra: dict
        kv_transfer_config: None = None  # VllmConfig's field; the wrapper's own check finds no connector

        def __post_init__(self) -> None:
            if self.extra.get("vllm_error"):
                raise ValueError("one of vLLM's own errors")
            OffloadConnector.requires_piecewise_for_cudagraph(self.extra)

    def args(extra: dict) -> SimpleNamespace:  # stands in for EngineArgs: no kv_transfer_config, `extra` apart
        return SimpleNamespace(kv_transfer_config=None, extra=extra)

    create = _checking(lambda engine_args: Config(engine_args.extra))
    with pytest.raises(pydantic.ValidationError):
        Config({"store_polcy": "lazy"})
    with pytest.raises(ConfigError, match="store_polcy"):
        create(args({"store_polcy": "lazy"}))
    with pytest.raises(pydantic.ValidationError, match="one of vLLM's own errors"):
        create(args({"vllm_error": True}))
    assert create(args({})).extra == {}
