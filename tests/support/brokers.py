"""Message brokers of the tests' own (and, re-exported, the wait of `waits`).

Each broker is started on free loopback ports, with its data in a temporary directory, and
stopped by PID: a RabbitMQ node (Debian's ``rabbitmq-server``) with its own node name, AMQP,
distribution and epmd ports, and a ``nats-server -js``. Never the brokers a machine may
already run on the standard ports. Redis Streams use the redis-server of `servers`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import stop
from tests.support.servers import free_port
from tests.support.waits import until

__all__ = ["Broker", "Nats", "RabbitMQ", "start_nats", "start_rabbitmq", "until"]


@dataclass
class Broker:
    """One broker process of the tests' own; `stop()` ends it by PID and removes its dir."""

    proc: subprocess.Popen[bytes]
    port: int
    dir: Path

    def log(self) -> str:
        path = self.dir / "broker.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        stop(self.proc, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


class Nats(Broker):
    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@dataclass
class RabbitMQ(Broker):
    """A RabbitMQ node and the epmd it registers with, both of the test's own."""

    epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def stop(self) -> None:
        stop(self.proc, timeout=60)  # the start script stops the node on SIGTERM
        if self.epmd is not None:
            stop(self.epmd)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_rabbitmq() -> RabbitMQ:
    """A RabbitMQ node (Debian's rabbitmq-server) with its own node name, AMQP and
    distribution ports, its own epmd (started here, in the foreground, so it is stopped
    by PID too), and its data, logs, configuration and Erlang cookie in a temp dir: never
    the node a machine may run on the standard ports. Its start takes seconds: start one
    per test session."""
    scripts = sorted(Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*/sbin/rabbitmq-server"))
    epmd_binary = shutil.which("epmd")
    if not scripts or epmd_binary is None:
        raise RuntimeError("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    directory = Path(tempfile.mkdtemp(prefix="goblin-rabbitmq-"))
    port, dist_port, epmd_port = free_port(), free_port(), free_port()
    (directory / "enabled_plugins").write_text("[].\n")
    (directory / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = 127.0.0.1:{port}\nlog.file.level = warning\n"
    )
    (directory / "rabbitmq-env.conf").write_text("")
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(directory),  # the Erlang cookie
        "LANG": "C.UTF-8",
        "RABBITMQ_NODENAME": f"goblin{port}@localhost",
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
        "RABBITMQ_LOG_BASE": str(directory / "log"),
        "RABBITMQ_LOGS": str(directory / "broker.log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
        "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq.conf"),
        "RABBITMQ_CONF_ENV_FILE": str(directory / "rabbitmq-env.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(directory / "advanced.config"),
        "RABBITMQ_PID_FILE": str(directory / "rabbitmq.pid"),
    }
    epmd = subprocess.Popen(
        [epmd_binary, "-port", str(epmd_port), "-address", "127.0.0.1"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with open(directory / "start.log", "wb") as out:
        proc = subprocess.Popen(
            [str(scripts[-1])],
            env=env,
            cwd=directory,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    broker = RabbitMQ(proc, port, directory, epmd)
    _wait_port(broker, 120)
    return broker


def _wait_port(broker: Broker, timeout: float) -> None:
    """Until the broker accepts a TCP connection on its port (or has exited: RuntimeError
    with its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if broker.proc.poll() is not None:
            raise RuntimeError(f"the broker exited ({broker.proc.returncode}): {broker.log()}")
        try:
            with socket.create_connection(("127.0.0.1", broker.port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    broker.stop()
    raise RuntimeError(f"the broker did not listen within {timeout:g} s: {broker.log()}")


def start_nats() -> Nats:
    """``nats-server -js`` on a free loopback port, its JetStream store in a temp dir."""
    binary = shutil.which("nats-server")
    if binary is None:
        raise RuntimeError("nats-server is not installed (apt-get install nats-server)")
    directory = Path(tempfile.mkdtemp(prefix="goblin-nats-"))
    port = free_port()
    log = directory / "broker.log"
    args = [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(directory / "js")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    broker = Nats(proc, port, directory)
    _wait_port(broker, 20)
    return broker
