"""A fleet of engines with and without the shared remote tier (issue 14 "Measure").

Fleet hit ratio: the bundled Mooncake synthetic trace (scaled: one trace block = one engine block) split
over N fake engines by a round-robin router (request i -> instance i mod N), the instances stepped in
lockstep in one process. Each instance has a GPU of `--gpu-fraction` (5%) and a CPU tier of
`--cpu-fraction` (10%) of the trace's distinct blocks; the shared configuration adds one redis-server (started
here on a loopback port, `--save ''`, allkeys-lru) whose `maxmemory` holds about `--shared-fraction` (40%)
of them (per block, one record per KV head: value + key + the server's per-key overhead, measured with
MEMORY USAGE on a probe key). Combined
hit ratio = (GPU + CPU hit tokens) / prompt tokens over all instances; `shared_vs_local` = shared / local
for the same N. Every instance verifies every block it reads: a run with integrity errors or leaks fails.

Remote fetch throughput: `--fetch-mib` MiB of values per block size in `--fetch-block-kib` written to the same server,
then read back and checked (header + checksum) one GET per round trip vs pipelined as the worker does it
(up to 64 blocks, about 2 MiB, per round trip); GB/s of block bytes and their ratio, within one run.

    nice python benchmarks/bench_fleet.py [--json] [--instances 2 4] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload_connector.cli.trace import bundled_trace_path, output_length, prompt_tokens, read_trace  # noqa: E402
from offload_connector.config import load_config  # noqa: E402
from offload_connector.fake_engine import FakeEngine  # noqa: E402
from offload_connector.remote.client import RemoteClient  # noqa: E402
from offload_connector.remote.format import HEADER_BYTES, decode_value, encode_value  # noqa: E402
from worker_side.tiers.remote_io import batch_blocks  # noqa: E402


class BenchmarkError(RuntimeError):
    """A run was not clean (integrity errors, leaks) or the server would not start."""


class Server:
    """A throwaway redis-server on a free loopback port."""

    def __init__(self, workdir: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise BenchmarkError("redis-server not found (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory-policy", "allkeys-lru", "--dir", workdir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise BenchmarkError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def size_for(self, num_blocks: int, key_len: int, value_len: int) -> int:
        """Set maxmemory to hold about `num_blocks` values; returns the bytes per key measured."""
        self.client.flushall()
        self.client.set(b"k" * key_len, b"v" * value_len)
        per_key = int(self.client.memory_usage(b"k" * key_len))
        self.client.flushall()
        base = int(self.client.info("memory")["used_memory"])
        self.client.config_set("maxmemory", base + num_blocks * per_key + (256 << 10))  # + client buffers
        return per_key

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def fleet_config(gpu_blocks: int, cpu_blocks: int, url: str | None, namespace: str, write: str = "on_store"):
    data = {"num_cpu_blocks": cpu_blocks, "transfer": {"backend": "cpu", "num_streams": 2},
            "engine": {"num_gpu_blocks": gpu_blocks, "block_size": 16, "num_layers": 2, "num_kv_heads": 2,
                       "head_dim": 8, "dtype": "float16", "max_num_batched_tokens": 4096, "max_num_seqs": 64}}
    if url is not None:
        data["remote"] = {"url": url, "namespace": namespace, "timeout_ms": 1000, "write": write}
    return load_config(data)


def run_fleet(trace, n: int, gpu_blocks: int, cpu_blocks: int, url: str | None, namespace: str,
              write: str = "on_store") -> dict:
    """Round-robin the trace over `n` engines stepped in lockstep; combined stats."""
    engines = [FakeEngine(fleet_config(gpu_blocks, cpu_blocks, url, namespace, write), sync_stores=True,
                          keep_outputs=False, keep_samples=False) for _ in range(n)]
    queues = [list(range(i, len(trace), n)) for i in range(n)]
    cursor = [0] * n
    start = time.perf_counter()
    try:
        while any(cursor[i] < len(queues[i]) or e.has_unfinished() for i, e in enumerate(engines)):
            for i, engine in enumerate(engines):
                bs = engine.block_size
                while cursor[i] < len(queues[i]) and len(engine.scheduler.waiting) < 2 * 64:
                    k = queues[i][cursor[i]]
                    engine.add_request(f"req-{k}", prompt_tokens(trace[k], bs, True), output_length(trace[k], bs, True))
                    cursor[i] += 1
                if engine.has_unfinished():
                    engine.step()
        for engine in engines:
            engine.check()
        wall = time.perf_counter() - start
        s = [e.stats for e in engines]
        prompt = sum(x.prompt_tokens for x in s)
        out = {"instances": n, "shared": url is not None, "write": write if url else None, "prompt_tokens": prompt,
               "gpu_hit_tokens": sum(x.gpu_hit_tokens for x in s), "cpu_hit_tokens": sum(x.cpu_hit_tokens for x in s),
               "integrity_errors": sum(x.integrity_errors for x in s), "leaked_blocks": sum(x.leaked_blocks for x in s),
               "wall_seconds": round(wall, 2)}
        out["hit_ratio"] = round((out["gpu_hit_tokens"] + out["cpu_hit_tokens"]) / prompt, 4)
        if url is not None:
            remote = {}
            for e in engines:
                for c in [e.connector.tiers["remote"].counters] + [w.tier_ios["remote"].counters for w in e.workers]:
                    for key, value in c.snapshot().items():
                        remote[key] = remote.get(key, 0) + value
            out["remote"] = remote
        if out["integrity_errors"] or out["leaked_blocks"]:
            raise BenchmarkError(f"unclean fleet run: {out}")
        return out
    finally:
        for engine in engines:
            engine.close()


def fetch_throughput(url: str, total_bytes: int, block_bytes: int) -> dict:
    """GB/s of verified block bytes read back: one GET per round trip vs pipelined as the worker does it
    (`remote_io.batch_blocks`: up to 64 blocks, about 2 MiB, per round trip)."""
    num_blocks = max(16, total_bytes // block_bytes)
    cfg = load_config({"remote": {"url": url, "timeout_ms": 10000}}).remote
    client = RemoteClient(cfg)
    payload = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8).numpy().tobytes()
    keys = [f"bench:fetch:{i}".encode() for i in range(num_blocks)]
    for i in range(0, num_blocks, 16):
        client.set_nx_many([(k, encode_value(k, payload)) for k in keys[i:i + 16]], 600)
    out = {"blocks": num_blocks, "block_bytes": block_bytes}
    out["pipelined_batch"] = batch_blocks(block_bytes)
    for name, batch in (("one_by_one", 1), ("pipelined", out["pipelined_batch"])):
        start = time.perf_counter()
        for i in range(0, num_blocks, batch):
            values = client.get_many(keys[i:i + batch])
            for k, v in zip(keys[i:i + batch], values or [], strict=True):
                if v is None or decode_value(k, v, block_bytes)[0] is None:
                    raise BenchmarkError(f"fetch benchmark: {k!r} missing or corrupt")
        seconds = time.perf_counter() - start
        out[f"{name}_gbps"] = round(num_blocks * block_bytes / seconds / 1e9, 3)
    out["pipelined_vs_one_by_one"] = round(out["pipelined_gbps"] / out["one_by_one_gbps"], 2)
    client.delete(keys)
    client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, nargs="+", default=[2, 4])
    p.add_argument("--gpu-fraction", type=float, default=0.05)
    p.add_argument("--cpu-fraction", type=float, default=0.10)
    p.add_argument("--shared-fraction", type=float, default=0.40)
    p.add_argument("--limit", type=int, default=None, help="only the trace's first N requests")
    p.add_argument("--fetch-mib", type=int, default=128, help="bytes read back per block size")
    p.add_argument("--fetch-block-kib", type=int, nargs="+", default=[16, 128, 512, 2048])
    p.add_argument("--write", choices=["on_store", "on_cpu_evict"], default="on_store", help="remote.write")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    trace = read_trace(bundled_trace_path(), limit=args.limit)
    distinct = len({h for r in trace for h in r.hash_ids})
    gpu, cpu, shared = (max(2, int(distinct * f)) for f in (args.gpu_fraction, args.cpu_fraction, args.shared_fraction))
    result: dict = {"trace_requests": len(trace), "distinct_blocks": distinct, "gpu_blocks": gpu, "cpu_blocks": cpu,
                    "shared_blocks": shared, "runs": []}
    with tempfile.TemporaryDirectory() as workdir:
        server = Server(workdir)
        try:
            probe = FakeEngine(fleet_config(gpu, cpu, server.url, "probe"), keep_outputs=False)
            io = probe.worker.tier_ios["remote"]
            keys = io.keys(bytes(20))  # one record per KV head of a block
            probe.close()
            result["keys_per_block"] = len(keys)
            result["bytes_per_key"] = server.size_for(shared * len(keys), len(keys[0]), HEADER_BYTES + io.rows.part_bytes)
            for n in args.instances:
                local = run_fleet(trace, n, gpu, cpu, None, "")
                server.client.flushall()
                remote = run_fleet(trace, n, gpu, cpu, server.url, f"fleet{n}", args.write)
                info = server.client.info()
                remote["server_keys_at_end"], remote["server_evicted_keys"] = info.get("db0", {}).get("keys", 0), \
                    info["evicted_keys"]
                result["runs"] += [local, remote]
                result[f"shared_vs_local_n{n}"] = round(remote["hit_ratio"] / local["hit_ratio"], 3)
            server.client.flushall()
            server.client.config_set("maxmemory", 0)
            result["fetch"] = [fetch_throughput(server.url, args.fetch_mib << 20, kib << 10)
                               for kib in args.fetch_block_kib]
        finally:
            server.stop()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for run in result["runs"]:
            print(f"N={run['instances']} {'shared' if run['shared'] else 'local '}: hit ratio {run['hit_ratio']:.4f} "
                  f"({run['wall_seconds']} s)")
        for n in args.instances:
            print(f"shared_vs_local N={n}: {result[f'shared_vs_local_n{n}']}")
        for f in result["fetch"]:
            print(f"fetch {f['block_bytes'] >> 10} KiB blocks: one by one {f['one_by_one_gbps']} GB/s, pipelined "
                  f"x{f['pipelined_batch']} {f['pipelined_gbps']} GB/s ({f['pipelined_vs_one_by_one']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
