"""Message brokers of the tests' own, and a wait for what a consumer did.

Each broker is started on free loopback ports, with its data in a temporary directory, and
stopped by PID: a RabbitMQ node (Debian's ``rabbitmq-server``) with its own node name, AMQP,
distribution and epmd ports, and a ``nats-server -js``. Never the brokers a machine may
already run on the standard ports. Redis Streams use the redis-server of `servers`.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import stop
from tests.support.servers import free_port

__all__ = ["Broker", "start_nats", "until"]


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


async def until(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 20.0, what: str = ""
) -> None:
    """Wait for `condition` (a function, or a coroutine function) to hold, checking every
    20 ms; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or condition}")
        await asyncio.sleep(0.02)
