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
     "error: invalid config key 'cpu_bytes': got '100GiB'; allowed: <= 64 GiB here: this host's MemAvailable is 64 GiB"),
    ("cpu_bytes: 1GiB\n", ["--model-config", "missing.json"],
     "error: --model-config: got 'missing.json' (No such file or directory); allowed: the path of a model's config.json"),
    ("cpu_bytes: 1GiB\n", ["--model-config", LLAMA, "--dtype", "int3"],
     "error: --dtype: got 'int3'; allowed: auto (the config's torch_dtype), float32 (float, fp32), float16 (half, fp16)"),
    ("cpu_bytes: 1GiB\n", ["--dtype", "half"], "error: --dtype: got 'half' (it is the KV dtype of the model --model-config"),
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
    assert err.rstrip().endswith(f"did you mean 8GiB?) (in {path.resolve()})")


def test_a_size_with_a_unit_is_echoed_as_written_and_not_guessed(capsys, tmp_path) -> None:
    """Issue 41: `cpu_bytes: 8B` was echoed as `got 8` and guessed to mean 8GiB."""
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 8B\n")
    code, _, err = check(capsys, str(path), "--model-config", LLAMA)
    assert code == 2 and "got '8B'; allowed: >= 32 KiB" in err and "did you mean" not in err
    assert err.rstrip().endswith(f"(in {path.resolve()})")


def test_a_default_the_host_cannot_hold_says_it_is_the_default(capsys, tmp_path, monkeypatch) -> None:
    """The default cpu_bytes (8 GiB) on a host with less: the error says no file set it."""
    monkeypatch.setattr(config_check, "mem_available_bytes", lambda: 2**30)
    path = tmp_path / "offload.yaml"
    path.write_text("eviction: arc\n")
    code, _, err = check(capsys, str(path), "--model-config", LLAMA)
    assert code == 2 and err.startswith("error: invalid config key 'cpu_bytes': got '8GiB'; allowed: <= 1 GiB here")
    assert err.rstrip().endswith(f"(not set in {path.resolve()}: the default)")


@pytest.mark.parametrize(("yaml", "error"), [
    ("store_polcy: lazy\n", "(unknown key; did you mean 'store_policy'?)"),
    ("transfer:\n  backnd: cpu\n", "invalid config key 'transfer.backnd': got 'cpu'; allowed: known keys here: backend,"),
    ("eviction: lur\n", "did you mean 'lru'?"),
    ("kv_offloading_size: 8\n", "invalid config key 'kv_offloading_size': got 8; allowed: cpu_bytes, a size such as "
                                '"8GiB" (vLLM\'s --kv-offloading-size is a number of GiB) (kv_offloading_size is an '
                                "option of vLLM's own CPU offload, not of OffloadConnector; did you mean cpu_bytes: 8GiB?)"),
    ("eviction_policy: lru\n", "allowed: eviction: 'lru' | 'arc'"),
    ("cpu_bytes: 64mb\n", "got '64mb'; allowed: a positive int (bytes) or a number with a unit, written in this case: "
                          "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"),
    ("cpu_bytes: 64mb\n", "(unknown unit 'mb'; did you mean '64MiB' or '64MB'?)"),
])
def test_config_errors_guess_what_was_meant_and_say_where(capsys, tmp_path, yaml: str, error: str) -> None:
    """Issue 41: a near miss of a key or value gets "did you mean", vLLM's own option names what to set
    instead, sizes take only the documented units in their case, and every error names the file."""
    path = tmp_path / "offload.yaml"
    path.write_text(yaml)
    code, _, err = check(capsys, str(path))
    assert code == 2 and error in err and err.rstrip().endswith(f"(in {path.resolve()})")
    assert err.count("\n") == 1


def test_the_unknown_key_error_sets_apart_the_keys_vllm_ignores(capsys, tmp_path) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text("nonsense: 1\n")
    _, _, err = check(capsys, str(path))
    known = err.split("known keys here: ")[1].split(";")[0]
    assert "cpu_bytes" in known and "hash_algo" not in known and "engine" not in known
    assert "for the fake engine only (ignored under vLLM): hash_algo, engine" in err and "did you mean" not in err


@pytest.mark.parametrize("names", [("half", "fp16", "float16"), ("bf16", "bfloat16", "torch.bfloat16"),
                                   ("fp8", "fp8_e5m2", "fp8_e4m3"), ("float", "fp32", "auto")])
def test_dtype_takes_vllms_names_and_the_short_forms_alike(capsys, tmp_path, names: tuple[str, ...]) -> None:
    """Issue 41: `--dtype fp16` was refused while `half` and `fp8` were taken."""
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 1GiB\n")
    sizes = set()
    for name in names:
        code, out, _ = check(capsys, str(path), "--model-config", LLAMA, "--dtype", name, "--json")
        assert code == 0
        sizes.add(json.loads(out)["per_rank"]["bytes_per_block"])
    assert len(sizes) == 1


def test_another_hosts_config_skips_this_hosts_memory(capsys, tmp_path) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 100GiB\n")
    code, out, _ = check(capsys, str(path), "--model-config", LLAMA, "--no-host-memory", "--json")
    assert code == 0 and "host" not in json.loads(out)
