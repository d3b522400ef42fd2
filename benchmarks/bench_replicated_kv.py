"""How to keep one copy of KV that every tensor-parallel rank holds identically (MLA's latent): measured.

    python benchmarks/bench_replicated_kv.py [--ranks 2] [--block-kib 72] [--blocks 64] [--repeat 20]

Two layouts give every rank its loaded block while the host holds one copy:
- `shared`: one host pool mapped by every rank's process (a /dev/shm file); one rank stores, every rank
  loads the whole block from the shared mapping (one memcpy per rank, no communication);
- `slice`: each rank's private pool holds 1/ranks of the block; a load copies the rank's slice back and
  then all-gathers the slices across the ranks (torch.distributed's gloo, the CPU engine's collective).
Each of `--ranks` processes times, per load of `--blocks` blocks of `--block-kib` KiB, the median over
`--repeat` loads; a store is timed the same way (shared: one rank copies whole blocks; slice: every
rank copies its slice). Prints one JSON object (microseconds per block). CPU only: GPU figures need NCCL
and a device, which this benchmark does not claim.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _worker(rank: int, ranks: int, args: argparse.Namespace, init: str, shm: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    block, n = args.block_kib * 1024, args.blocks
    kv = torch.randint(0, 255, (n, block), dtype=torch.uint8)  # this rank's "GPU" blocks
    # shared: one file-backed mapping, rank 0 creates it
    if rank == 0:
        with open(shm, "wb") as f:
            f.truncate(n * block)
    dist.barrier()
    with open(shm, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), n * block)
    shared = torch.frombuffer(mapped, dtype=torch.uint8).view(n, block)
    piece = block // ranks
    private = torch.empty((n, piece), dtype=torch.uint8)
    gathered = [torch.empty((n, piece), dtype=torch.uint8) for _ in range(ranks)]

    def store_shared() -> None:
        if rank == 0:
            shared.copy_(kv)

    def load_shared() -> None:
        kv.copy_(shared)

    def store_slice() -> None:
        private.copy_(kv[:, rank * piece:(rank + 1) * piece])

    def load_slice() -> None:
        kv[:, rank * piece:(rank + 1) * piece].copy_(private)
        dist.all_gather(gathered, private)
        for r, part in enumerate(gathered):
            if r != rank:
                kv[:, r * piece:(r + 1) * piece].copy_(part)

    figures = {name: _timed(fn, args.repeat) * 1e6 / n for name, fn in (
        ("store_shared_us_per_block", store_shared), ("load_shared_us_per_block", load_shared),
        ("store_slice_us_per_block", store_slice), ("load_slice_us_per_block", load_slice))}
    out[rank] = figures
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--block-kib", type=int, default=72)  # tests/tiny_deepseek: 2 layers x 16 x 576 x fp32
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        shm = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tmp, f"bench_replicated_{os.getpid()}")
        out = mp.Manager().dict()
        try:
            mp.spawn(_worker, args=(args.ranks, args, init, shm, out), nprocs=args.ranks)
        finally:
            if os.path.exists(shm):
                os.unlink(shm)
    per_rank = [dict(out[r]) for r in range(args.ranks)]
    result = {"ranks": args.ranks, "block_kib": args.block_kib, "blocks": args.blocks,
              **{k: round(max(r[k] for r in per_rank), 2) for k in per_rank[0]}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
