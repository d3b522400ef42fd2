"""`offload-connector check CONFIG [--model-config config.json] [--tp N] [--block-size N] [--json]`: exit 0
and what the config gives per rank when valid, exit 2 and one `error:` line naming the key otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import offload_connector.cli.check as config_check
from offload_connector.cli.main import main

TESTS = Path(__file__).resolve().parents[1]
LLAMA = str(TESTS / "tiny_llama" / "config.json")  # 2 layers, 2 KV heads of 32, float32
GEMMA2 = str(TESTS / "tiny_gemma2" / "config.json")  # 4 layers alternating sliding window / full
DEEPSEEK = str(TESTS / "tiny_deepseek" / "config.json")  # MLA: 2 layers, latent 512 + 64, float32


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def offload_yaml(tmp_path) -> Path:
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 8GiB\n")
    return path


@pytest.fixture(autouse=True)
def host_with_64_gib(monkeypatch) -> None:
    monkeypatch.setattr(config_check, "mem_available_bytes", lambda: 64 * 2**30)


def test_a_valid_config_alone_is_checked_and_asks_for_the_model(capsys, offload_yaml) -> None:
    code, out, err = check(capsys, str(offload_yaml))
    assert code == 0 and err == ""
    assert out.startswith(f"{offload_yaml}: valid\n") and "cpu_bytes 8 GiB for the whole engine" in out
    assert "pass --model-config" in out


def test_per_rank_bytes_blocks_and_tokens_for_a_model(capsys, offload_yaml) -> None:
    code, out, _ = check(capsys, str(offload_yaml), "--model-config", LLAMA, "--block-size", "32")
    assert code == 0
    assert "llama: 2 layers x 2 KV heads (2 per rank) x head size 32 x float32, block_size 32" in out
    assert "per rank     8 GiB = 262,143 blocks of 32 KiB = 8,388,576 tokens" in out
    code, out, _ = check(capsys, str(offload_yaml), "--model-config", LLAMA, "--tp", "2", "--json")
    result = json.loads(out)
    # TP=2: 4 GiB per rank; one KV head of 32 per rank, vLLM's default block of 16 tokens, 2 layers:
    # 16 x 1 x (32 + 32) x 4 bytes x 2 = 8 KiB blocks.
    assert result["per_rank"] == {"bytes": 4 * 2**30, "blocks": 2**19 - 1, "tokens": (2**19 - 1) * 16,
                                  "bytes_per_block": 8192}
    assert result["host"] == {"mem_available": 64 * 2**30, "needed": 8 * 2**30} and result["valid"] is True


def test_an_mla_model_under_tp_shares_one_pool_among_the_ranks(capsys, offload_yaml) -> None:
    """MLA's latent is the same on every rank: at TP 2 the ranks map one pool of the whole cpu_bytes."""
    runs = [json.loads(check(capsys, str(offload_yaml), "--model-config", DEEPSEEK, "--block-size", "16",
                             "--tp", tp, "--json")[1]) for tp in ("1", "2")]
    blocks = (8 * 2**30) // (16 * 576 * 4 * 2) - 1
    assert [r["per_rank"]["blocks"] for r in runs] == [blocks, blocks] and [r["shared_by"] for r in runs] == [1, 2]
    assert runs[1]["host"]["needed"] == runs[0]["host"]["needed"]  # one pool on the host either way
    code, out, _ = check(capsys, str(offload_yaml), "--model-config", DEEPSEEK, "--block-size", "16", "--tp", "2")
    assert code == 0 and "one pool shared by the 2 ranks: MLA's latent is the same on each" in out


def test_a_hybrid_model_follows_the_store_policy(capsys, tmp_path) -> None:
    """eager keeps vLLM's hybrid KV cache manager on (a block holds one group's 2 layers), lazy turns it off
    (all 4 layers); unset is eager for a hybrid model, as the connector resolves it."""
    pytest.importorskip("transformers")  # fills in Gemma 2's layer_types, as for vLLM
    sizes, policies = {}, {}
    for policy in ("eager", "lazy", None):
        path = tmp_path / f"{policy}.yaml"
        path.write_text("cpu_bytes: 1GiB\n" + (f"store_policy: {policy}\n" if policy else ""))
        code, out, _ = check(capsys, str(path), "--model-config", GEMMA2, "--block-size", "32", "--json")
        assert code == 0
        sizes[policy] = json.loads(out)["per_rank"]["bytes_per_block"]
        policies[policy] = json.loads(out)["store_policy"]
    assert sizes == {"eager": 32768, "lazy": 65536, None: 32768}
    assert policies == {"eager": "eager", "lazy": "lazy", None: "eager"}


@pytest.mark.parametrize(("yaml", "args", "error"), [
    ("store_polcy: lazy\n", [], "error: invalid config key 'store_polcy': got 'lazy'"),
    ("cpu_bytes: 8\n", ["--model-config", LLAMA, "--block-size", "32"],
     "error: invalid config key 'cpu_bytes': got 8; allowed: >= 64 KiB"),
    ("cpu_bytes: 100GiB\n", ["--model-config", LLAMA],
     "error: invalid config key 'cpu_bytes': got '100 GiB'; allowed: <= 64 GiB here: this host's MemAvailable is 64 GiB"),
    ("cpu_bytes: 1GiB\n", ["--model-config", "missing.json"], "error: model config key '--model-config': got 'missing.json'"),
    ("cpu_bytes: 1GiB\n", ["--model-config", LLAMA, "--dtype", "int3"], "error: model config key 'torch_dtype': got 'int3'"),
])
def test_a_bad_config_or_model_is_one_error_line_and_exit_2(capsys, tmp_path, monkeypatch, yaml: str,
                                                           args: list[str], error: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "offload.yaml").write_text(yaml)
    code, out, err = check(capsys, "offload.yaml", *args)
    assert code == 2 and out == "" and err.startswith(error) and err.count("\n") == 1


def test_a_small_bare_cpu_bytes_suggests_gib(capsys, tmp_path) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 8\n")
    _, _, err = check(capsys, str(path), "--model-config", LLAMA)
    assert err.rstrip().endswith("did you mean 8GiB?)")


def test_another_hosts_config_skips_this_hosts_memory(capsys, tmp_path) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 100GiB\n")
    code, out, _ = check(capsys, str(path), "--model-config", LLAMA, "--no-host-memory", "--json")
    assert code == 0 and "host" not in json.loads(out)
