"""Issue 30: every start-up mistake stops vLLM in its config step with one line naming the key, the value
and what is allowed: an implausible `cpu_bytes` (fewer than 2 blocks of this model per rank, or more than
the host's MemAvailable), vLLM's own CPU offload flags beside our connector, a bad key.

In-process tests go through `EngineArgs.create_engine_config` (what `LLM` and the servers call); the
subprocess tests run `vllm.LLM` and the OpenAI server as a user does and read what they print: one
traceback at most for `LLM` (the caller's frames, not ours), none for the server (one line, exit 1).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402

import offload_connector.vllm.plugin as plugin  # noqa: E402
from offload_connector.config import ConfigError  # noqa: E402
from offload_connector.vllm.errors import UnsupportedSetupError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_llama")  # 32 KiB per 32-token block (2 layers, float32)
ENGINE_KWARGS = dict(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32,
                     enforce_eager=True, max_model_len=256, dtype="float32")
GIB = 2**30


def offload(extra: dict, short_name: bool = False) -> KVTransferConfig:
    module = {} if short_name else {"kv_connector_module_path": "offload_connector.vllm_connector"}
    return KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config=extra, **module)


def multi(extra: dict) -> KVTransferConfig:
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": "kv"}}
    ours = {"kv_connector": "OffloadConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": [example, ours]})


@pytest.fixture(autouse=True)
def registered(monkeypatch) -> None:
    plugin.register()  # what vLLM does in EngineArgs.__post_init__
    monkeypatch.setattr(plugin, "mem_available_bytes", lambda: 4 * GIB)  # a 4 GiB host, whatever this one has


def create(kv_transfer_config: KVTransferConfig, **kwargs):
    return EngineArgs(**ENGINE_KWARGS, kv_transfer_config=kv_transfer_config, **kwargs).create_engine_config()


# ---- cpu_bytes against the model and the host --------------------------------------------------------
@pytest.mark.parametrize("ours", [offload, multi])
def test_a_tier_under_two_blocks_is_refused_and_a_gib_count_suggested(ours) -> None:
    with pytest.raises(ConfigError) as err:
        create(ours({"cpu_bytes": 8}))
    assert err.value.key == "cpu_bytes" and err.value.value == 8
    assert ">= 64 KiB" in str(err.value) and "2 blocks of 32 KiB" in str(err.value)
    assert str(err.value).endswith("did you mean 8GiB?) (in kv_connector_extra_config)")


@pytest.mark.parametrize(("extra", "key", "shown"), [
    ({"cpu_bytes": "10TiB"}, "cpu_bytes", "'10TiB'"),  # as written
    ({"cpu_bytes": 5 * GIB}, "cpu_bytes", str(5 * GIB)),
    ({"num_cpu_blocks": 200_000}, "num_cpu_blocks", "200000"),  # 200,000 x 32 KiB = 6.1 GiB
])
def test_a_tier_above_memavailable_is_refused(extra: dict, key: str, shown: str) -> None:
    with pytest.raises(ConfigError) as err:
        create(offload(extra))
    message = str(err.value)
    assert err.value.key == key and f"got {shown}" in message
    assert "this host's MemAvailable is 4 GiB" in message and "MiB" not in message
    assert message.endswith("(in kv_connector_extra_config)")


def test_a_default_the_host_cannot_hold_says_it_is_the_default(monkeypatch, tmp_path) -> None:
    """Issue 41: every config error says where the key came from; one no source sets is the default."""
    monkeypatch.setattr(plugin, "mem_available_bytes", lambda: 4 * GIB)
    (tmp_path / "offload.yaml").write_text("eviction: arc\n")
    with pytest.raises(ConfigError) as err:
        create(offload({"config_file": str(tmp_path / "offload.yaml")}))
    assert str(err.value).startswith("invalid config key 'cpu_bytes': got '8GiB'; allowed: <= 4 GiB here")
    assert str(err.value).endswith(f"(not set in kv_connector_extra_config or {tmp_path.resolve() / 'offload.yaml'}: "
                                   "the default)")


def test_a_plausible_tier_passes() -> None:
    assert create(offload({"cpu_bytes": "3GiB"})).kv_transfer_config.kv_connector_extra_config == {"cpu_bytes": "3GiB"}
    create(offload({"num_cpu_blocks": 2}))  # the smallest tier: the null block and one


MAMBA_KWARGS = dict(ENGINE_KWARGS, model=str(Path(__file__).resolve().parents[1] / "tiny_nemotronh"),
                    enable_prefix_caching=True, max_num_batched_tokens=32)


@pytest.mark.parametrize(("extra", "key"), [({"store_policy": "lazy"}, "store_policy='lazy'"),
                                            ({"remote": {"url": "redis://127.0.0.1:1"}}, "the remote tier (remote section)")])
def test_a_mamba_hybrid_with_a_one_group_config_is_refused_naming_the_key(extra: dict, key: str) -> None:
    """vLLM cannot run Mamba layers with its hybrid KV cache manager off (it fails later, on specs it
    cannot unify): a config that serves one group stops start-up in the config step, saying what to set."""
    with pytest.raises(UnsupportedSetupError, match=re.escape(key) + r" supports one KV-cache group, and this "
                       r"Mamba hybrid \(NemotronHForCausalLM\).*allowed: store_policy: eager \(or unset\)"):
        EngineArgs(**MAMBA_KWARGS, kv_transfer_config=offload({"cpu_bytes": "16MiB", **extra})).create_engine_config()


def test_a_mamba_hybrid_with_eager_stores_keeps_hma_on_and_align_mode() -> None:
    config = EngineArgs(**MAMBA_KWARGS, kv_transfer_config=offload({"cpu_bytes": "16MiB"})).create_engine_config()
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    assert config.cache_config.mamba_cache_mode == "align" and config.cache_config.mamba_block_size == 32


def test_tensor_parallel_ranks_on_one_host_share_its_memory() -> None:
    """Checked without running TP: vLLM's config for TP=2 (a CPU run of 2 ranks is not started here)."""
    from offload_connector.config import load_config
    from offload_connector.vllm.early_check import check_capacity, ranks_on_host

    vllm_config = create(offload({"cpu_bytes": "1GiB"}))
    vllm_config.parallel_config.tensor_parallel_size = 2
    vllm_config.parallel_config.world_size = 2
    assert ranks_on_host(vllm_config.parallel_config) == 2
    check_capacity(vllm_config, load_config({"cpu_bytes": "4GiB"}), available=4 * GIB)
    with pytest.raises(ConfigError, match=r"2 ranks' pools would take 6 GiB"):
        check_capacity(vllm_config, load_config({"cpu_bytes": "6GiB"}), available=4 * GIB)


# ---- vLLM's own CPU offload beside ours ---------------------------------------------------------------
@pytest.mark.parametrize(("short_name", "named"), [
    (True, "kv_connector 'OffloadConnector' with vLLM's own OffloadingConnector"),
    (False, "kv_connector 'OffloadConnector' (offload_connector.vllm_connector) with vLLM's own OffloadingConnector"),
])
def test_kv_offloading_size_beside_our_connector_is_refused_naming_both(short_name: bool, named: str) -> None:
    """vLLM would replace our connector by its own (short form) or look its class up in our module (path)."""
    with pytest.raises(UnsupportedSetupError) as err:
        create(offload({"cpu_bytes": "1GiB"}, short_name), kv_offloading_size=1)
    message = str(err.value)
    assert "kv_offloading_size=1 (kv_offloading_backend='native')" in message and named in message
    assert '{"cpu_bytes": "1GiB"}' in message  # the same size, in our key


def test_kv_offloading_backend_or_a_multiconnector_child_is_refused_too() -> None:
    with pytest.raises(UnsupportedSetupError, match="kv_offloading_backend='lmcache'.*LMCacheMPConnector"):
        create(offload({"cpu_bytes": "1GiB"}), kv_offloading_backend="lmcache")
    with pytest.raises(UnsupportedSetupError, match="'OffloadConnector' inside MultiConnector"):
        create(multi({"cpu_bytes": "1GiB"}), kv_offloading_size=2)


def test_kv_offloading_size_without_our_connector_is_vllms_business() -> None:
    vllm_config = EngineArgs(**ENGINE_KWARGS, kv_offloading_size=1).create_engine_config()
    assert vllm_config.kv_transfer_config.kv_connector == "OffloadingConnector"


# ---- how a refusal looks ------------------------------------------------------------------------------
def test_a_server_exits_with_one_line_and_a_program_gets_the_error() -> None:
    args = EngineArgs(**ENGINE_KWARGS, kv_transfer_config=offload({"store_polcy": "lazy"}))
    with pytest.raises(SystemExit) as exited:
        args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    assert str(exited.value.code).startswith("ConfigError: invalid config key 'store_polcy': got 'lazy'")
    with pytest.raises(ConfigError) as err:
        args.create_engine_config(usage_context=UsageContext.LLM_CLASS)
    frames = [f.tb_frame.f_code.co_filename for f in _walk(err.value.__traceback__)]
    assert sum("offload_connector" in f for f in frames) == 1  # the wrapper's raise, none of our internals


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as users run it: the engine core in its own process
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_llm_prints_one_short_traceback_ending_in_the_error() -> None:
    """`cpu_bytes: 8` used to start the engine core and fail 26 s later (about 90 lines, `[rank0]:` frames)."""
    script = textwrap.dedent(f"""
        from vllm import LLM
        from vllm.config import KVTransferConfig
        LLM(model={MODEL_DIR!r}, load_format="dummy", skip_tokenizer_init=True, block_size=32, enforce_eager=True,
            max_model_len=256, dtype="float32", kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadConnector", kv_role="kv_both", kv_connector_extra_config={{"cpu_bytes": 8}}))
    """)
    out = _run([sys.executable, "-c", script])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and out.stderr.count("Traceback") == 1
    assert re.fullmatch(r"offload_connector\.config_errors\.ConfigError: invalid config key 'cpu_bytes': got 8; .*"
                        r"did you mean 8GiB\?\) \(in kv_connector_extra_config\)", lines[-1])
    traceback = lines[next(i for i, line in enumerate(lines) if line.startswith("Traceback")):]
    assert len(traceback) <= 12  # the caller's frames and the message
    assert not any("[rank0]" in line or "EngineCore" in line for line in lines)  # no engine was started


@pytest.mark.parametrize(("extra", "flags", "last"), [
    ('{"cpu_bytes":"10TiB"}', [], r"ConfigError: invalid config key 'cpu_bytes': got '10TiB'; allowed: <= .* "
                                     r"here: this host's MemAvailable is .* \(in kv_connector_extra_config\)"),
    ("{}", ["--kv-offloading-size", "1"], r"UnsupportedSetupError: OffloadConnector: vLLM's kv_offloading_size=1\.0 .*"),
])
def test_the_openai_server_exits_with_one_line(extra: str, flags: list[str], last: str) -> None:
    """`cpu_bytes: 10TiB` used to print 254 lines and 5 tracebacks, 38 s after start; the flag silently
    replaced our connector."""
    out = _run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL_DIR,
                "--load-format", "dummy", "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager",
                "--max-model-len", "256", "--dtype", "float32", "--port", str(_free_port()), *flags,
                "--kv-transfer-config",
                f'{{"kv_connector":"OffloadConnector","kv_role":"kv_both","kv_connector_extra_config":{extra}}}'])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert re.fullmatch(last, lines[-1])


def test_the_connector_checks_memavailable_itself_before_building_blocks(monkeypatch) -> None:
    """Without the plugin's check (VLLM_PLUGINS leaving it out), the connector refuses the same tier from
    vLLM's exact KV spec, before its scheduler builds one object per CPU block."""
    from vllm_sim_helpers import Sim

    import offload_connector.vllm.connector as vllm_connector

    monkeypatch.setattr(vllm_connector, "mem_available_bytes", lambda: GIB)
    with pytest.raises(ConfigError, match=r"got '2GiB'; allowed: <= 1 GiB here: this host's MemAvailable is 1 GiB"):
        Sim(num_gpu_blocks=8, num_cpu_blocks=None, cpu_bytes="2GiB")
    Sim(num_gpu_blocks=8, num_cpu_blocks=None, cpu_bytes="1MiB").assert_no_leaks()
