"""One `vllm.LLM` engine in its own process, for tests/vllm_adapter/test_vllm_remote_e2e.py and
test_vllm_disk_e2e.py (not a test module).

    python tests/vllm_remote_engine.py '{"url": ... or "disk": DIR, "prompts": [[...], ...], "flush": true}'

Runs the tiny dummy-weight model of tests/tiny_llama (as test_vllm_e2e.py does) with OffloadConnector and
the given remote tier (`url`) or disk tier (`disk`: its directory; neither: no connector at all), generates each prompt alone and in order, greedily,
and prints one JSON line: each prompt's output tokens and `num_cached_tokens`, and the remote counters of
both roles (the engine runs in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0). With `flush`, it waits for the
worker's queued writes to reach the server before printing, so the next engine can see them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from offload_connector.vllm.compat import in_process_connector  # noqa: E402

MODEL_DIR = str(Path(__file__).parent / "tiny_llama")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)


def main() -> None:
    args = json.loads(sys.argv[1])
    kv, tier = None, "disk" if args.get("disk") else "remote"
    if args.get("url") or args.get("disk"):
        section = ({"path": args["disk"], "bytes": "64MiB", "timeout_ms": 5000, "write": "on_store"} if tier == "disk" else
                   {"url": args["url"], "namespace": "e2e", "timeout_ms": 5000})
        kv = KVTransferConfig(
            kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB", tier: section})
    llm = LLM(disable_log_stats=False, model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32, enforce_eager=True,
              max_model_len=256, num_gpu_blocks_override=10, max_num_seqs=4, max_num_batched_tokens=256, seed=0,
              dtype="float32", kv_transfer_config=kv)
    result: dict = {"outputs": [], "cached": []}
    for prompt in args["prompts"]:
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        result["outputs"].append(list(out.outputs[0].token_ids))
        result["cached"].append(out.num_cached_tokens)
    if kv is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = in_process_connector(llm)
        worker = get_kv_transfer_group().worker
        if args.get("flush"):
            llm.generate([{"prompt_token_ids": [7] * 40}], GREEDY, use_tqdm=False)  # steps that report the stores
            worker.wait_all()  # and the writes they queued reach the server
        if tier == "disk":  # wait for the start-up scan's count, not for its use (the engine never waits)
            connector.offload.tiers["disk"].wait_scan(30)
        result["lookup"] = connector.offload.tiers[tier].counters.snapshot()
        result["worker"] = worker.tier_ios[tier].counters.snapshot() if tier == "remote" else \
            worker.tier_ios[tier].io.counters.snapshot()
        result["stats"] = connector.offload.stats.snapshot()
        result["prom"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                          if m.name.startswith(f"vllm:offload_connector_{tier}_")}
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
