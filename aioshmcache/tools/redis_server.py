"""Private ``redis-server`` processes for the fleet tests and benchmark: one server or a cluster.

A server runs on 127.0.0.1 without persistence and can be SIGKILLed and started again on its
port, as a Redis that crashes and restarts. A cluster is three masters joined by ``redis-cli
--cluster create``. Whoever starts one stops it (``stop``, or ``with``); nothing is left behind.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Self

__all__ = ["RedisCluster", "RedisServer", "free_port", "redis_binaries"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000, below 65536) is free too."""
    for port in random.sample(range(20000, 55000), 1000):
        with socket.socket() as a, socket.socket() as b, contextlib.suppress(OSError):
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 10000))
            return port
    raise RuntimeError("no free port pair for a cluster node")


def redis_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` paths, or None if either is not installed."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _binaries() -> tuple[str, str]:
    if (found := redis_binaries()) is None:
        raise FileNotFoundError("redis-server / redis-cli are not installed")
    return found


def _server_pid(port: int) -> int | None:
    """The pid of the redis-server answering on ``port`` (its ``INFO server``), or None.

    Not a PING: a port that was free a moment ago may be another program's server by now
    (another test run's), and a PONG from it would pass for ours."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
            c.sendall(b"INFO server\r\n")
            data = b""
            while data.partition(b"\r\nprocess_id:")[2].find(b"\r\n") < 0:  # not that line yet
                if not (chunk := c.recv(4096)) or len(data) > 1 << 16:
                    return None
                data += chunk
    except OSError:
        return None
    value = data.partition(b"\r\nprocess_id:")[2].split(b"\r\n", 1)[0]
    return int(value) if value.isdigit() else None


class _Stopped:
    """``with`` stops it."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(_Stopped):
    """One ``redis-server`` on 127.0.0.1; ``kill`` (SIGKILL) and ``start`` again on its port."""

    def __init__(
        self, *, port: int | None = None, cluster: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
        self.binary = _binaries()[0]
        self.port = port or (_cluster_port() if cluster else free_port())
        self.args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        self.args += ["no", "--daemonize", "no", "--loglevel", "warning", *extra_args]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
        self._dir = tempfile.TemporaryDirectory(prefix="aioshm-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start (again) on ``port`` and wait until it answers as itself (``INFO``'s pid)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.binary, *self.args, "--dir", self._dir.name]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while _server_pid(self.port) != self.proc.pid:  # ours, not whoever holds the port
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited at start (port {self.port}, maybe taken meanwhile)"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {timeout} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (a crash: every connection drops) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10.0)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.kill()
        self._dir.cleanup()


class RedisCluster(_Stopped):
    """Three cluster-enabled masters on 127.0.0.1, joined into one cluster (no replicas)."""

    def __init__(self, masters: int = 3, timeout: float = 30.0) -> None:
        cli = _binaries()[1]
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(cluster=True))
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            create = ["--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run([cli, *create], check=True, capture_output=True, timeout=timeout)
            deadline = time.monotonic() + timeout
            while not all(self._ok(cli, n.port) for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ok(cli: str, port: int) -> bool:
        info = [cli, "-p", str(port), "cluster", "info"]
        done = subprocess.run(info, capture_output=True, text=True, timeout=5)
        return "cluster_state:ok" in done.stdout

    @property
    def url(self) -> str:
        """The first node's URL (a cluster client discovers the others)."""
        return self.nodes[0].url

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
