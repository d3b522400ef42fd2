"""The remote tier's TP-independent layout, per block: records per KV head vs one record per rank.

One worker rank's remote I/O (`RemoteWorkerIO`, real redis-server started here on a loopback port) over a
host pool of fake-engine-layout tensors (per layer (2, blocks, block_size, heads, head_dim), fp16) filled
with random bytes. Per case, the same blocks are written (snapshot, `SET NX EX` in the worker's pipelined
batches, until the queue is drained) and fetched back into zeroed rows (`GET`, checks, copy into the
pool), and every fetched byte is compared with what was written: a run that differs fails. Layouts:
- `rank`: one record per block (per rank), the block's bytes in host-pool order (records keyed with the rank);
- `head`: one record per KV head, each head's slice of the block (head-major, keyed without the rank;
  what a TP 1 rank of an 8-head model does, the most parts a block has);
- `head_tp2`: rank 0 of TP 2 reading the 4 head records of its half, written by the `head` case's TP 1
  rank (the mixed-TP fleet's read).
- `head_auth` (with `--auth`): the `head` case with `remote.auth_key_file` set (every record signed with
  a keyed BLAKE2b and verified on fetch); `auth_over_head` is its ratio to `head` within the run, and
  `codec_us` times `encode_value` / `decode_value` of every head's record of a block alone (no network),
  unkeyed and keyed.
Per block, medians over `--repeats` alternating rounds: wall time, and CPU time (this process's, i.e.
the rank's threads, plus the server's from INFO cpu), which a loaded machine disturbs far less; `head /
rank` is the ratio within the run. `split_us` is the host-pool <-> parts cost alone (HeadRows.read_parts / write_parts vs HostRows),
no network.

    nice python benchmarks/bench_remote_layout.py [--json] [--repeats 5] [--auth]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_fleet import BenchmarkError, Server  # noqa: E402
from offload_connector.remote.config import RemoteConfig  # noqa: E402
from offload_connector.remote.format import BlockParts, decode_value, encode_value, key_prefix  # noqa: E402
from offload_connector.tier_identity import TierIdentity  # noqa: E402
from worker_side.block_layout import tensor_block_view  # noqa: E402
from worker_side.host_pool import HostPool  # noqa: E402
from worker_side.tiers.head_rows import HeadRows  # noqa: E402
from worker_side.tiers.host_rows import HostRows  # noqa: E402
from worker_side.tiers.remote_io import RemoteWorkerIO  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
# (name, layers, blocks): 2 layers = 128 KiB blocks (16 KiB a head), 16 layers = 1 MiB blocks (128 KiB a head)
CASES = (("128KiB", 2, 256), ("1MiB", 16, 64))


def make_pool(layers: int, heads: int, num_blocks: int) -> HostPool:
    views = [tensor_block_view(f"model.layers.{i}.attn", torch.zeros(2, num_blocks, BLOCK_SIZE, heads, HEAD_DIM,
                                                                      dtype=torch.float16),
                               num_blocks, "kv_first", head_dim=3) for i in range(layers)]
    return HostPool(views, num_blocks + 1, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))


def identity(layers: int) -> TierIdentity:
    return TierIdentity(model="bench", dtype="float16", kv_cache_dtype="float16", block_size=BLOCK_SIZE,
                        hash_algo="xxh3_128", layout=f"{layers}x(2,{BLOCK_SIZE},{HEADS},{HEAD_DIM})", kv_heads=HEADS)


class Clock:
    """Wall time and CPU time (this process + the server) between `start` and `stop`."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def server_cpu(self) -> float:
        info = self.server.client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def start(self) -> None:
        self.wall, self.cpu, self.srv = time.perf_counter(), time.process_time(), self.server_cpu()

    def stop(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        return wall, cpu + self.server_cpu() - self.srv


def timed_write(clock: Clock, io: RemoteWorkerIO, cpu_ids: list[int], keys: list[bytes]) -> tuple[float, float]:
    clock.start()
    io.write(cpu_ids, keys)
    if not io.wait_idle(120):
        raise BenchmarkError("writes did not drain in 120 s")
    return clock.stop()


def timed_fetch(clock: Clock, io: RemoteWorkerIO, event: int, cpu_ids: list[int],
                keys: list[bytes]) -> tuple[float, float]:
    clock.start()
    io.submit_fetch(event, cpu_ids, keys)
    if not io.wait_idle(120):
        raise BenchmarkError("fetch did not finish in 120 s")
    elapsed = clock.stop()
    failed = [c for r in io.poll() for c in r.failed_cpu_ids]
    if failed:
        raise BenchmarkError(f"{len(failed)} blocks failed to fetch")
    return elapsed


def time_codec(rows: HeadRows, cpu_ids: list[int], auth_key: bytes | None) -> tuple[float, float]:
    """Seconds per block to encode, then decode, every head's record of the blocks (no network)."""
    parts = [rows.read_parts(c) for c in cpu_ids]
    keys = [[os.urandom(60) for _ in p] for p in parts]  # about a real key's length
    start = time.process_time()
    blobs = [[encode_value(k, memoryview(p), auth_key) for k, p in zip(ks, ps, strict=True)]
             for ks, ps in zip(keys, parts, strict=True)]
    encode = time.process_time() - start
    start = time.process_time()
    for ks, bs in zip(keys, blobs, strict=True):
        for k, b in zip(ks, bs, strict=True):
            if decode_value(k, b, rows.part_bytes, auth_key)[0] is None:
                raise BenchmarkError("a value just encoded was refused")
    decode = time.process_time() - start
    return encode / len(cpu_ids), decode / len(cpu_ids)


def run_case(server: Server, layers: int, num_blocks: int, repeats: int, auth: bool = False) -> dict:
    pool = make_pool(layers, HEADS, num_blocks)
    half = make_pool(layers, HEADS // 2, num_blocks)  # rank 0 of TP 2: heads 0-3
    ident = identity(layers)
    cfg = RemoteConfig(url=[server.url], timeout_ms=20000, max_inflight_bytes=1 << 40)
    cpu_ids = list(range(1, num_blocks + 1))
    gen = torch.Generator().manual_seed(layers)
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8, generator=gen))
    want = [pool[c].clone() for c in cpu_ids]
    half_want = []
    tp1_rows, half_rows = HeadRows(pool, HEADS), HeadRows(half, HEADS // 2)
    for c in cpu_ids:  # what rank 0 of TP 2 holds of the same blocks: heads 0-3
        parts = tp1_rows.read_parts(c)
        for h in range(HEADS // 2):
            half_rows.write_part(c, h, memoryview(parts[h]))
        half_want.append(half[c].clone())
    layouts = ("rank", "head", "head_auth") if auth else ("rank", "head")
    auth_key = os.urandom(32)
    times: dict[str, list[float]] = {f"{layout}_{op}{kind}": [] for layout in layouts
                                     for op in ("write", "fetch") for kind in ("", "_cpu")}
    times.update(head_tp2_fetch=[], head_tp2_fetch_cpu=[], split_read=[], split_write=[], rows_read=[],
                 rows_write=[])
    clock = Clock(server)

    def record(name: str, wall_cpu: tuple[float, float]) -> None:
        times[name].append(wall_cpu[0] / num_blocks)
        times[f"{name}_cpu"].append(wall_cpu[1] / num_blocks)

    for rep in range(repeats):
        for layout in layouts:
            prefix = key_prefix(ident, f"b{rep}{layout}")
            parts = BlockParts.of(ident, 0, 1) if layout.startswith("head") else None
            io = RemoteWorkerIO(cfg, prefix, 0, 1, pool, parts, auth_key if layout == "head_auth" else None)
            keys = [os.urandom(16) + b"\0\0\0\0" for _ in cpu_ids]
            try:
                record(f"{layout}_write", timed_write(clock, io, cpu_ids, keys))
                pool.buffer.zero_()
                record(f"{layout}_fetch", timed_fetch(clock, io, rep, cpu_ids, keys))
                if any(not torch.equal(pool[c], w) for c, w in zip(cpu_ids, want, strict=True)):
                    raise BenchmarkError(f"{layout}: fetched bytes differ from those written")
                if layout == "head":  # rank 0 of TP 2 reads its heads of the blocks TP 1 just wrote
                    half.buffer.zero_()
                    tp2 = RemoteWorkerIO(cfg, prefix, 0, 2, half, BlockParts.of(ident, 0, 2))
                    try:
                        record("head_tp2_fetch", timed_fetch(clock, tp2, rep, cpu_ids, keys))
                    finally:
                        tp2.close()
                    if any(not torch.equal(half[c], w) for c, w in zip(cpu_ids, half_want, strict=True)):
                        raise BenchmarkError("head_tp2: fetched bytes differ from TP 1's heads 0-3")
            finally:
                io.close()
            server.client.flushall()
        rows = HostRows(pool)
        start = time.perf_counter()
        blobs = [rows.read(c) for c in cpu_ids]
        times["rows_read"].append((time.perf_counter() - start) / num_blocks)
        start = time.perf_counter()
        for c, b in zip(cpu_ids, blobs, strict=True):
            rows.write(c, memoryview(b))
        times["rows_write"].append((time.perf_counter() - start) / num_blocks)
        start = time.perf_counter()
        split = [tp1_rows.read_parts(c) for c in cpu_ids]
        times["split_read"].append((time.perf_counter() - start) / num_blocks)
        start = time.perf_counter()
        for c, parts in zip(cpu_ids, split, strict=True):
            tp1_rows.write_parts(c, [memoryview(p) for p in parts])
        times["split_write"].append((time.perf_counter() - start) / num_blocks)
        if auth:
            for name, key in (("plain", None), ("keyed", auth_key)):
                encode, decode = time_codec(tp1_rows, cpu_ids, key)
                times.setdefault(f"codec_{name}_encode", []).append(encode)
                times.setdefault(f"codec_{name}_decode", []).append(decode)
    us = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    out = {"block_bytes": pool.bytes_per_block, "part_bytes": tp1_rows.part_bytes, "blocks": num_blocks,
            "us_per_block": us,
            "head_over_rank": {f"{op}{kind}": round(us[f"head_{op}{kind}"] / us[f"rank_{op}{kind}"], 3)
                               for op in ("write", "fetch") for kind in ("", "_cpu")},
            "tp2_half_fetch_over_rank_fetch": {k: round(us[f"head_tp2_fetch{k}"] / us[f"rank_fetch{k}"], 3)
                                               for k in ("", "_cpu")},
            "split_over_rows": {"read": round(us["split_read"] / us["rows_read"], 3),
                                "write": round(us["split_write"] / us["rows_write"], 3)}}
    if auth:
        out["auth_over_head"] = {f"{op}{kind}": round(us[f"head_auth_{op}{kind}"] / us[f"head_{op}{kind}"], 3)
                                 for op in ("write", "fetch") for kind in ("", "_cpu")}
        gb = pool.bytes_per_block / 1e9  # CPU seconds per GB of KV, keyed minus plain, encode + decode
        out["auth_extra_cpu_s_per_gb"] = {
            "write": round((us["codec_keyed_encode"] - us["codec_plain_encode"]) / 1e6 / gb, 3),
            "fetch": round((us["codec_keyed_decode"] - us["codec_plain_decode"]) / 1e6 / gb, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--auth", action="store_true", help="also the head layout with remote.auth_key_file set")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        server = Server(workdir)
        try:
            server.client.config_set("maxmemory", 0)
            result = {"load_average": [round(x, 2) for x in os.getloadavg()], "heads": HEADS,
                      "auth": args.auth,
                      "cases": {name: run_case(server, layers, blocks, args.repeats, args.auth)
                                for name, layers, blocks in CASES}}
            result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        finally:
            server.proc.terminate()
            server.proc.wait()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, case in result["cases"].items():
            print(name, case["us_per_block"], case["head_over_rank"], case["tp2_half_fetch_over_rank_fetch"],
                  case["split_over_rows"], case.get("auth_over_head", ""), case.get("auth_extra_cpu_s_per_gb", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
