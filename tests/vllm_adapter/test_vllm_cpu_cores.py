"""Issue 40: on vLLM's CPU build the connector costs the model no core.

vLLM's CPU executor reserves one more core per rank for any KV connector (for NIXL's transfer threads).
On 2 cores that reserved every core, vLLM fell back to reserving none, and the worker ran 2 OpenMP threads,
one of them on the engine core's busy core: decode 2-5x slower in the OpenAI server. The plugin now sets
`VLLM_CPU_NUM_OF_RESERVED_CPU` to what vLLM reserves without a connector (cpu_cores.py).

The first test runs `vllm.LLM` as a user does (engine core and worker in processes of their own) with and
without the connector, and reads the worker's thread binding. The others go through
`EngineArgs.create_engine_config`, where the plugin decides.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_sim_helpers import MODEL_DIR  # noqa: E402

import offload_connector.vllm.plugin as plugin  # noqa: E402
from offload_connector.vllm import compat_platform, cpu_cores  # noqa: E402
from offload_connector.vllm.compat_platform import RESERVED_CPU_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OURS = {"kv_connector": "OffloadConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": "8MiB"}}

# Run in the worker: its torch threads, the OpenMP placement vLLM gave it, and the cores its threads may run on.
BINDING_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    def binding(worker):
        import os, torch
        cpus = set()
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/status") as status:
                    cpus |= {line.split(":")[1].strip() for line in status if line.startswith("Cpus_allowed_list")}
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        omp = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
        return {"torch_threads": torch.get_num_threads(), "omp": {k: os.environ.get(k) for k in omp},
                "cores_of_threads": sorted(cpus)}

    if __name__ == "__main__":
        ktc = KVTransferConfig(**json.loads(sys.argv[1])) if len(sys.argv) > 1 else None
        llm = LLM(model=MODEL_PATH, load_format="dummy", skip_tokenizer_init=True, block_size=32,
                  enforce_eager=True, max_model_len=256, dtype="float32", kv_transfer_config=ktc)
        llm.generate([{"prompt_token_ids": list(range(1, 100))}], SamplingParams(max_tokens=8), use_tqdm=False)
        print("BINDING", json.dumps(llm.collective_rpc(binding)))
""").replace("MODEL_PATH", repr(MODEL_DIR))


def _worker_binding(tmp_path: Path, *connector: str) -> tuple[list[dict], str]:
    script = tmp_path / "binding.py"
    script.write_text(BINDING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc with a function
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", RESERVED_CPU_ENV, cpu_cores.OURS_MARK_ENV):
        env.pop(name, None)  # as users run it: engine core and workers in processes of their own
    out = subprocess.run([sys.executable, str(script), *connector], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    found = re.search(r"^BINDING (.*)$", out.stdout, re.M)
    assert out.returncode == 0 and found, out.stderr[-3000:]
    return json.loads(found[1]), out.stdout + out.stderr  # vLLM logs to stdout


def test_the_workers_binding_with_the_connector_is_the_binding_without(tmp_path: Path) -> None:
    without, _ = _worker_binding(tmp_path)
    with_ours, log = _worker_binding(tmp_path, json.dumps(OURS))
    assert with_ours == without
    reserved = re.search(rf"OffloadConnector: {RESERVED_CPU_ENV}=(\d+), the cores vLLM's CPU executor reserves "
                         r"without a KV connector \((\d+) with one,", log)
    assert reserved and int(reserved[1]) < int(reserved[2])
    assert f"; {RESERVED_CPU_ENV}={reserved[1]}, as without a KV connector" in log  # the connector's start-up line


# ---------------------------------------------------------------- the plugin's decision
@pytest.fixture(autouse=True)
def clean_env(monkeypatch) -> None:
    plugin.register()
    for name in (RESERVED_CPU_ENV, cpu_cores.OURS_MARK_ENV):
        monkeypatch.delenv(name, raising=False)  # restored to absent after each test, whatever the plugin set
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (else the CPU platform turns "uni" into "mp")


def create(kv_transfer_config: KVTransferConfig | None, backend: str | None = "mp"):
    """vLLM's config for the test model, as `vllm.LLM` builds it (the plugin's wrapper runs)."""
    return EngineArgs(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, max_model_len=256,
                      kv_transfer_config=kv_transfer_config, distributed_executor_backend=backend).create_engine_config()


def test_ours_alone_gets_the_reservation_of_no_connector_and_the_next_engine_gets_it_back() -> None:
    config = create(KVTransferConfig(**OURS))
    ours = os.environ.pop(RESERVED_CPU_ENV)  # (vLLM's figures below are read with it unset)
    assert ours == os.environ[cpu_cores.OURS_MARK_ENV]
    assert compat_platform.cpu_cores_reserved(config, config.kv_transfer_config) > \
        compat_platform.cpu_cores_reserved(config, None) \
        == int(ours)
    os.environ[RESERVED_CPU_ENV] = ours
    create(None)  # a later engine of this process without the connector: vLLM's own reservation again
    assert RESERVED_CPU_ENV not in os.environ and cpu_cores.OURS_MARK_ENV not in os.environ


def test_the_users_setting_is_kept(monkeypatch) -> None:
    monkeypatch.setenv(RESERVED_CPU_ENV, "2")
    create(KVTransferConfig(**OURS))
    create(None)
    assert os.environ[RESERVED_CPU_ENV] == "2" and cpu_cores.OURS_MARK_ENV not in os.environ


def test_a_value_the_user_changed_after_ours_is_theirs() -> None:
    create(KVTransferConfig(**OURS))
    os.environ[RESERVED_CPU_ENV] = "3"
    create(None)
    assert os.environ[RESERVED_CPU_ENV] == "3" and cpu_cores.OURS_MARK_ENV not in os.environ


def test_beside_another_connector_nothing_is_set() -> None:
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": "kv"}}
    create(KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": [example, OURS]}))
    assert RESERVED_CPU_ENV not in os.environ


def test_multi_connector_of_ours_alone_is_ours() -> None:
    create(KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": [OURS]}))
    assert RESERVED_CPU_ENV in os.environ


def test_an_executor_that_binds_no_threads_is_left_alone() -> None:
    config = create(KVTransferConfig(**OURS), backend="uni")
    assert config.parallel_config.distributed_executor_backend == "uni"
    assert RESERVED_CPU_ENV not in os.environ
