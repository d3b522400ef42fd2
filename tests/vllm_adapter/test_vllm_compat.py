"""Issue 16: the supported vLLM range, declared once and enforced at start-up; our hooks are vLLM's.

Outside `SUPPORTED_VLLM` the connector refuses to start with an error naming the installed version and
the range: early, in the plugin's check while vLLM builds its config, and again when vLLM creates the
connector (set-ups without the plugin). The installed version is faked by patching `vllm.__version__`.
Every public method of `OffloadConnector` is a hook of vLLM's `KVConnectorBase_V1` (of 0.32, or of 0.33
for the sleep-mode hooks): run under both releases in CI (docs/vllm.md, "Compatibility").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from offload_connector.vllm.engine_setup import SUPPORTED_VLLM_TEXT, UnsupportedSetupError, check_vllm_version

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
