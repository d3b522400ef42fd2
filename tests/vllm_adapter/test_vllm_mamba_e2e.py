"""End to end on a Mamba hybrid: `vllm.LLM` on vllm-cpu with a tiny config-only NemotronH-style model
(`tiny_nemotronh`: layers Mamba2, attention, Mamba2, MLP; seeded dummy weights; block size 32).

With prefix caching vLLM runs the Mamba layers in `mamba_cache_mode="align"`: three KV-cache groups (one
per Mamba layer, one for the attention layer) over one GPU block pool, pages padded to one size, and the
Mamba groups' block `i` holding the layer's state after `32 * (i + 1)` tokens. The connector stores those
state blocks with the attention KV and a returning prompt loads, of each Mamba group, only the state block
ending at its hit. `max_num_batched_tokens` is the block size: longer prefill steps crash in vllm-cpu's
scan kernel in align mode, and one block per step leaves a state at every block boundary.

vLLM's dummy weights (uniform in +-1e-3) leave every Mamba mixer's output under its norms' epsilon, so the
model's outputs would not depend on the state at all; the engine here scales them to +-1 (seeded, so
still deterministic), and then a prompt's output depends on its prefix through the state.

Checked: a prefix evicted from the GPU cache comes back from the CPU tier with the attention blocks and one
state block per Mamba group, every loaded block equal byte for byte to its host-pool block; greedy outputs
equal those of the same prompts computed whole (under a cache salt of their own); a CPU tier without the
state of the hit's last block serves only up to the block whose state it has; zeroing the stored state
blocks in the host pool changes the output of a prompt that loads them (the state is what is served);
nothing stays held at the end.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm_tp_engine import count_loaded_bytes  # noqa: E402

from offload_connector.hashing import group_suffix  # noqa: E402

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_nemotronh")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
BS = 32
STATE_GROUPS, ATTENTION_GROUP = (0, 1), 2  # vLLM's group order: the Mamba layers 0 and 2, then attention


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


X, Y = tokens(1, 128), tokens(2, 192)  # 4 and 6 blocks


@contextmanager
def weights_of_unit_scale() -> Iterator[None]:
    """vLLM's dummy weights times 1000 (uniform in +-1) while the engine loads its model (this process)."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    original = DummyModelLoader.load_weights

    def load_weights(self, model, model_config) -> None:
        original(self, model, model_config)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1000.0)

    DummyModelLoader.load_weights = load_weights
    try:
        yield
    finally:
        DummyModelLoader.load_weights = original


def generate(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
    out = llm.generate([request], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module")
def run() -> dict:
    kv = KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
                          kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "16MiB"})
    with weights_of_unit_scale():
        llm = LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=BS, enforce_eager=True,
                  enable_prefix_caching=True, max_model_len=256, max_num_batched_tokens=BS, max_num_seqs=4,
                  num_gpu_blocks_override=16, seed=0, dtype="float32", kv_transfer_config=kv)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from offload_connector.vllm.compat import in_process_connector

    try:
        core = llm.llm_engine.engine_core.engine_core
        connector = in_process_connector(llm)
        offload, worker = connector.offload, get_kv_transfer_group().worker
        llm.collective_rpc(count_loaded_bytes)
        loads: list[list[int]] = []  # per load: how many blocks of each group it loads
        update = offload.update_state_after_alloc

        def recording_update(request, gpu_block_ids, num_external_tokens):
            update(request, gpu_block_ids, num_external_tokens)
            job = offload.transfers.requests[request.request_id].load
            if job is not None:
                loaded = set(job.gpu_block_ids)
                loads.append([len(loaded & set(ids)) for ids in gpu_block_ids])

        offload.update_state_after_alloc = recording_update
        result: dict = {"groups": [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups],
                        "modes": [getattr(g.kv_cache_spec, "mamba_cache_mode", None)
                                  for g in core.scheduler.kv_cache_config.kv_cache_groups]}
        # 1-3. X + a stores X; Y + b evicts X's blocks from the 16-block GPU cache; X + c loads X's 4 blocks.
        result["story"] = [generate(llm, p) for p in (X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16))]
        result["story_loads"] = list(loads)
        # 4. The same prompt computed whole: nothing of it is cached anywhere under its own salt.
        result["x_c_whole"] = generate(llm, X + tokens(13, 16), salt="whole-1")
        # 5. Y's state at its last block (block 5) is gone from the CPU tier: Y + d may load only up to block 4.
        pool = offload.cpu_pool
        state_keys = {key for key in pool.cached if key[-4:] in {group_suffix(g) for g in STATE_GROUPS}}
        result["num_state_blocks"] = len(state_keys)
        assert llm.reset_prefix_cache()  # vLLM's GPU prefix cache only: what follows comes from the CPU tier
        y_keys = _prompt_keys(core, Y + tokens(14, 16))
        for g in STATE_GROUPS:
            pool.uncache(pool.cached[y_keys[5] + group_suffix(g)])
        loads.clear()
        result["y_d"] = generate(llm, Y + tokens(14, 16))
        result["y_d_loads"] = list(loads)
        result["y_d_whole"] = generate(llm, Y + tokens(14, 16), salt="whole-2")
        result["stats"] = offload.stats.snapshot()
        result["verified"] = (worker.test_verified_blocks, worker.test_mismatched_blocks, worker.test_bytes_loaded)
        result["bytes_per_block"] = worker.bytes_per_block
        # 6. Zero every stored state block in the host pool; X + e then loads zeros as X's state.
        assert llm.reset_prefix_cache()
        for key, block in pool.cached.items():
            if key[-4:] in {group_suffix(g) for g in STATE_GROUPS}:
                worker.host_pool.buffer.view(-1, worker.bytes_per_block)[block.block_id].zero_()
        loaded_before = offload.stats.num_loaded_blocks
        result["x_e_zeroed_state"] = generate(llm, X + tokens(15, 16))
        result["x_e_zeroed_loaded"] = offload.stats.num_loaded_blocks - loaded_before
        result["x_e_whole"] = generate(llm, X + tokens(15, 16), salt="whole-3")
        result["idle"] = offload.is_idle() and pool.num_held_blocks() == 0
        offload.check_integrity()
        return result
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _prompt_keys(core, prompt: list[int]) -> list[bytes]:
    """The block hashes vLLM gives `prompt` (as our keys are made: the hash, then the group suffix)."""
    from vllm.v1.request import Request

    request = Request("probe", prompt, GREEDY, None, block_hasher=core.request_block_hasher)
    return [bytes(h) for h in request.block_hashes]


def test_the_model_runs_mamba_state_groups_in_align_mode(run: dict) -> None:
    assert run["groups"] == ["MambaSpec", "MambaSpec", "FullAttentionSpec"]
    assert run["modes"] == ["align", "align", None]
    assert run["bytes_per_block"] == 2 * 32 * 2 * 32 * 4  # one layer slot: the attention page (K, V) = the state page


def test_an_evicted_prefix_comes_back_from_the_cpu_tier_with_its_state(run: dict) -> None:
    (_, cold), _, (x_c, cached) = run["story"]
    assert cold == 0 and cached == 128  # X's 4 blocks; the GPU cache had lost them to Y + b
    # One load: X's 4 attention blocks and, of each Mamba group, the state block after 128 tokens.
    assert run["story_loads"] == [[1, 1, 4]]
    assert x_c == run["x_c_whole"][0] and run["x_c_whole"][1] == 0
    stats = run["stats"]
    assert stats["num_failed_load_blocks"] == 0 and stats["num_failed_store_blocks"] == 0
    verified, mismatched, loaded_bytes = run["verified"]
    assert verified == stats["num_loaded_blocks"] > 0 and mismatched == 0
    assert loaded_bytes == stats["num_loaded_blocks"] * run["bytes_per_block"]


def test_the_hit_ends_where_the_state_of_its_last_block_is_on_the_cpu_tier(run: dict) -> None:
    """Y's 6 attention blocks are on the CPU tier but the state after 192 tokens is not: the hit stops at
    160 tokens, with the state after 160 tokens (block 4) loaded; outputs still equal computing it whole."""
    out, cached = run["y_d"]
    assert cached == 160 and run["y_d_loads"] == [[1, 1, 5]]
    assert out == run["y_d_whole"][0] and run["y_d_whole"][1] == 0


def test_the_outputs_depend_on_the_stored_state(run: dict) -> None:
    """Zeroing the state blocks in the host pool (the attention blocks untouched) changes the output of a
    prompt that loads them: the equalities above hold because the state is served."""
    assert run["num_state_blocks"] > 0 and run["x_e_zeroed_loaded"] == 6
    assert run["x_e_zeroed_state"][1] == 128
    assert run["x_e_zeroed_state"][0] != run["x_e_whole"][0]


def test_nothing_stays_held(run: dict) -> None:
    assert run["idle"]
