"""Private ``redis-server`` processes for the fleet tests and benchmark: one server or a cluster.

A server runs on 127.0.0.1 on a free port without persistence (``--save "" --appendonly no``)
and can be killed (SIGKILL) and started again on the same port, as a Redis that crashes and
restarts. A cluster is three masters started with ``--cluster-enabled yes`` and joined by
``redis-cli --cluster create ... --cluster-yes``. Whoever starts one stops it (``stop``, or the
context manager); nothing is left running or on disk.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType

__all__ = ["RedisCluster", "RedisServer", "cluster_port", "free_port", "redis_binaries"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port() -> int:
    """A free port ``p`` whose cluster bus port ``p + 10000`` is free too (and below 65536).

    An ephemeral port from the kernel is often above 55535, where the bus port cannot exist.
    """
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(20000, 55000)
        if _bindable(p) and _bindable(p + 10000):
            return p
    raise RuntimeError("no free port pair for a cluster node")


def redis_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` paths, or None if either is not installed."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
        c.sendall(b"PING\r\n")
        return c.recv(64)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``kill`` (SIGKILL) and ``start`` again on its port."""

    def __init__(
        self, *, port: int | None = None, cluster: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
        found = redis_binaries()
        if found is None:
            raise FileNotFoundError("redis-server / redis-cli are not installed")
        self.binary = found[0]
        if port is None:
            port = cluster_port() if cluster else free_port()
        self.port = port
        self.cluster = cluster
        self.extra_args = list(extra_args)  # e.g. ["--maxmemory", "4gb"]
        self._dir = tempfile.TemporaryDirectory(prefix="aioshm-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start (again) on ``port`` and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        args += ["--loglevel", "warning", "--dir", self._dir.name, *self.extra_args]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
            args += ["--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start (port {self.port})")
            try:
                if _ping(self.port).startswith(b"+PONG"):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {timeout} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (a crash: every connection drops) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10.0)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class RedisCluster:
    """Three cluster-enabled masters on 127.0.0.1, joined into one cluster (no replicas)."""

    def __init__(self, masters: int = 3, timeout: float = 30.0) -> None:
        found = redis_binaries()
        if found is None:
            raise FileNotFoundError("redis-server / redis-cli are not installed")
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(cluster=True))
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            create = ["--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run(
                [found[1], *create],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=timeout,
            )
            self._wait_ok(found[1], timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self, cli: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(n.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                for n in self.nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    @property
    def url(self) -> str:
        """The URL of the first node (a cluster client discovers the others)."""
        return self.nodes[0].url

    def stop(self) -> None:
        """Stop every node."""
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
