"""Real Redis servers for the remote-tier tests: started on free loopback ports, never persisted.

`RedisServer` runs `redis-server --save '' --appendonly no --maxmemory M --maxmemory-policy allkeys-lru`
(plus `--requirepass` when asked) in a temporary directory; it can be stopped, restarted on the same
port, and paused (SIGSTOP) and resumed. `redis_cluster` starts three such servers in cluster mode and joins
them with `redis-cli --cluster create`. Tests that need them skip, saying why, where `redis-server` or the
`redis` package is missing (`.ci/run` installs both, so CI runs them).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def require_redis() -> None:
    """Skip the calling test unless a local redis-server and the redis package are installed."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server/redis-cli not installed (apt-get install redis-server; .ci/run does)")
    pytest.importorskip("redis", reason="the `redis` package is not installed (pip install '.[remote]')")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free loopback port whose cluster-bus port (port + 10000) is free too.

    Both lie below Linux's default ephemeral range (32768-60999), so no outgoing connection (redis-cli's
    own, another test's) can take either between this check and the server's bind.
    """
    for _ in range(1000):
        port = random.randrange(10000, 22768)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


class PortTaken(RuntimeError):
    """redis-server exited because another process holds its port (or its cluster-bus port)."""


class RedisServer:
    def __init__(self, workdir: Path, maxmemory: str = "64mb", password: str | None = None,
                 cluster: bool = False, policy: str = "allkeys-lru") -> None:
        self.workdir, self.maxmemory, self.password, self.cluster = workdir, maxmemory, password, cluster
        self.policy = policy
        self.proc: subprocess.Popen | None = None
        for attempt in range(3):  # a port taken between the check and the bind: try another
            self.port = free_port()
            try:
                self.start()
                return
            except PortTaken:
                if attempt == 2:
                    raise

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def args(self) -> list[str]:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy, "--dir", str(self.workdir),
                "--logfile", str(self.logfile)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        return args

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while self.cli("PING") != "PONG":
            exited = self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                self.stop()
                log = self.logfile.read_text(errors="replace")[-2000:] if self.logfile.exists() else ""
                error = PortTaken if exited and "Failed listening on port" in log else RuntimeError
                raise error(f"redis-server on port {self.port} did not start; its log ends:\n{log}")
            time.sleep(0.05)

    def cli(self, *command: str) -> str:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        out = subprocess.run([REDIS_CLI, "-p", str(self.port), *auth, *command], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip()

    def info(self, field: str) -> int:
        """One integer field of INFO (e.g. used_memory, evicted_keys)."""
        for line in self.cli("INFO").splitlines():
            if line.startswith(field + ":"):
                return int(line.split(":", 1)[1])
        raise KeyError(field)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)


def make_cluster(workdir: Path, maxmemory: str = "64mb") -> list[RedisServer]:
    """Three masters, no replicas, all 16384 slots assigned; returns once the cluster says ok."""
    nodes: list[RedisServer] = []
    try:
        for _ in range(3):
            nodes.append(RedisServer(workdir, maxmemory, cluster=True))
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, check=True, timeout=60)
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the 3-node cluster did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        for node in nodes:  # no server outlives a failed set-up
            node.stop()
        raise
    return nodes


@pytest.fixture
def redis_server(tmp_path):
    require_redis()
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    require_redis()
    nodes = make_cluster(tmp_path)
    yield nodes
    for node in nodes:
        node.stop()
