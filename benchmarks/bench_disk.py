"""Disk tier data path: store and load GB/s through the tier's I/O against `dd` with direct I/O at the same
block size in the same run, the start-up index rebuild rate, and the cost of the checksums per GB.

Blocks are a Llama-8B-like rank's (`--block-mib` MiB, default 2: 32 layers x K/V = 64 planes of 32 KiB in a
page-aligned host buffer, as the host pool lays them out), `--num-blocks` of them, written in steps of
`--batch` blocks (one job per step, as the worker submits them) by `--threads` I/O threads, in each mode:
- `buffered` (`disk.direct_io: false`): stores through the page cache, then `os.sync()`;
  loads after every record was dropped from the page cache (`posix_fadvise(DONTNEED)`), so they read the
  device, not memory;
- `direct` (the default, `disk.direct_io: true`): O_DIRECT both ways.
Each mode first writes every block once, untimed (a running engine's copy slots are touched already).
A store is timed from the first submit until every record is renamed into place (buffered: plus the
`sync` that puts it on the device); a load until every block is in the pool and verified.
Baseline: `dd bs=<block> count=<num-blocks> oflag=direct` (one file, sequential) then
`iflag=direct`, same directory, same run. `*_vs_dd` = our GB/s / dd's (goal >= 0.8).
`deletes_per_s`: records unlinked per second (what eviction costs the scheduler's file thread).
Rebuild: `--scan-blocks` small records in a fresh directory, scanned as at start-up (blocks/s).
Hash cost: seconds per GB of xxh3-64 (every record) and of the keyed BLAKE2b (`disk.auth_key_file`).

    python benchmarks/bench_disk.py --json [--dir DIR] [--block-mib 2] [--num-blocks 256]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import tempfile
import time

import numpy as np

from offload_connector.disk.config import DiskConfig
from offload_connector.disk.directory import open_private_dir
from offload_connector.disk.format import Sealer, Verifier, rank_fingerprint, record_name
from offload_connector.tier_identity import TierIdentity
from scheduler_side.tiers.disk.files import scan_rank_dirs
from worker_side.tiers.disk.io import DiskWorkerIO
from worker_side.tiers.disk.records import PoolSegments

IDENTITY = TierIdentity(model="bench", block_size=16, hash_algo="xxh3_128", layout="64 planes")
PLANES = 64


def make_rows(num_blocks: int, block_bytes: int) -> tuple[PoolSegments, mmap.mmap]:
    chunk = block_bytes // PLANES
    buf = mmap.mmap(-1, PLANES * num_blocks * chunk)
    whole = np.frombuffer(buf, np.uint8)
    whole[:] = np.random.default_rng(0).integers(0, 256, whole.size, dtype=np.uint8)
    planes = [(whole[p * num_blocks * chunk:(p + 1) * num_blocks * chunk], chunk, [0], chunk) for p in range(PLANES)]
    return PoolSegments(planes), buf


def key(i: int) -> bytes:
    return i.to_bytes(16, "big") + bytes(4)


def drop_page_cache(directory: str) -> None:
    os.sync()
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_mode(root: str, rows: PoolSegments, args, direct: bool) -> dict:  # noqa: ANN001
    cfg = DiskConfig(path=root, bytes=1 << 40, io_threads=args.threads, direct_io=direct,
                     max_inflight_bytes=args.num_blocks * rows.bytes_per_block)
    io = DiskWorkerIO(cfg, open_private_dir(root), rank_fingerprint(IDENTITY, 0, 1), rows)
    ids = list(range(1, args.num_blocks))
    gb = len(ids) * rows.bytes_per_block / 1e9
    for s in range(0, len(ids), args.batch):  # warm-up, untimed: a running engine's copy slots are touched
        io.submit_write(s, ids[s:s + args.batch], [key(10**6 + i) for i in ids[s:s + args.batch]])
    io.wait_idle()
    io.poll()
    start = time.perf_counter()
    for i in ids:
        os.unlink(os.path.join(io.dir, record_name(key(10**6 + i))))
    delete_s = time.perf_counter() - start
    start = time.perf_counter()
    for s in range(0, len(ids), args.batch):
        io.submit_write(s, ids[s:s + args.batch], [key(i) for i in ids[s:s + args.batch]])
    io.wait_idle()
    if not direct:
        os.sync()
    store_s = time.perf_counter() - start
    failed = sum(len(r.failed_keys) for r in io.poll())
    drop_page_cache(io.dir)
    start = time.perf_counter()
    for s in range(0, len(ids), args.batch):
        io.submit_read(s, ids[s:s + args.batch], [key(i) for i in ids[s:s + args.batch]])
    io.wait_idle()
    load_s = time.perf_counter() - start
    failed += sum(len(r.failed_keys) for r in io.poll())
    io.close()
    shutil.rmtree(io.dir)
    return {"direct": io.direct, "store_gbps": gb / store_s, "load_gbps": gb / load_s, "failed_blocks": failed,
            "deletes_per_s": len(ids) / delete_s}


def dd(path: str, block_bytes: int, count: int) -> dict:
    def rate(cmd: list[str]) -> float:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"copied, ([0-9.]+) s", out)
        return count * block_bytes / 1e9 / float(m.group(1))
    bs = f"bs={block_bytes}"
    write = rate(["dd", "if=/dev/zero", f"of={path}", bs, f"count={count}", "oflag=direct", "conv=fsync"])
    read = rate(["dd", f"if={path}", "of=/dev/null", bs, f"count={count}", "iflag=direct"])
    os.unlink(path)
    return {"store_gbps": write, "load_gbps": read}


def rebuild(root: str, num: int) -> dict:
    rows, _ = make_rows(2, PLANES * 64)  # 4 KiB payloads: the scan reads headers only
    cfg = DiskConfig(path=root, bytes=1 << 40, io_threads=4, max_inflight_bytes=256 * 8192)
    io = DiskWorkerIO(cfg, open_private_dir(root), rank_fingerprint(IDENTITY, 0, 1), rows)
    for s in range(0, num, 256):
        io.submit_write(s, [1] * min(256, num - s), [key(i) for i in range(s, min(num, s + 256))])
        io.wait_idle()
    io.close()
    drop_page_cache(io.dir)  # the directory entries and inodes stay cached: a warm-metadata figure
    result = scan_rank_dirs([io.dir], [Verifier(rank_fingerprint(IDENTITY, 0, 1), None)], rows.bytes_per_block,
                            time.time())
    shutil.rmtree(io.dir)
    return {"blocks": len(result.keys), "seconds": result.seconds, "blocks_per_s": result.blocks_per_second}


def hash_cost(nbytes: int) -> dict:
    data = memoryview(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8))
    out = {}
    for name, auth in (("xxh3", None), ("xxh3_and_blake2b", b"k" * 32)):
        sealer = Sealer(bytes(16), auth)
        start = time.perf_counter()
        sealer.seal(key(0), [data], nbytes)
        out[f"{name}_s_per_gb"] = (time.perf_counter() - start) / (nbytes / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="a directory on the filesystem to measure (default: a temporary one)")
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="blocks per job (one step's)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--scan-blocks", type=int, default=10000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench_disk.", dir=args.dir)
    try:
        block_bytes = int(args.block_mib * (1 << 20)) // (PLANES * 4096) * PLANES * 4096
        rows, _buf = make_rows(args.num_blocks, block_bytes)
        root = os.path.join(base, "tier")
        out = {"block_bytes": block_bytes, "num_blocks": args.num_blocks - 1, "threads": args.threads,
               "batch": args.batch, "dd": dd(os.path.join(base, "dd.bin"), block_bytes, args.num_blocks - 1)}
        for mode, direct in (("buffered", False), ("direct", True)):
            out[mode] = run_mode(root, rows, args, direct)
            for d in ("store", "load"):
                out[mode][f"{d}_vs_dd"] = out[mode][f"{d}_gbps"] / out["dd"][f"{d}_gbps"]
        out["rebuild"] = rebuild(os.path.join(base, "scan"), args.scan_blocks)
        out["hash"] = hash_cost(256 << 20)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"blocks of {block_bytes >> 10} KiB x {args.num_blocks - 1}, {args.threads} threads, {args.batch} per job")
    print(f"dd direct      store {out['dd']['store_gbps']:.2f} GB/s  load {out['dd']['load_gbps']:.2f} GB/s")
    for mode in ("buffered", "direct"):
        r = out[mode]
        print(f"tier {mode:9s} store {r['store_gbps']:.2f} GB/s ({r['store_vs_dd']:.2f} of dd)  load "
              f"{r['load_gbps']:.2f} GB/s ({r['load_vs_dd']:.2f} of dd)  failed {r['failed_blocks']}  "
              f"{r['deletes_per_s']:,.0f} deletes/s")
    print(f"index rebuild  {out['rebuild']['blocks_per_s']:,.0f} blocks/s ({out['rebuild']['blocks']} records)")
    print(f"hash cost      xxh3 {out['hash']['xxh3_s_per_gb']:.3f} s/GB, with keyed BLAKE2b "
          f"{out['hash']['xxh3_and_blake2b_s_per_gb']:.3f} s/GB")


if __name__ == "__main__":
    main()
