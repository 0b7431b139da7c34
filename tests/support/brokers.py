"""Message brokers of the tests' own, and a wait for what a consumer did.

Each broker is started on free loopback ports, with its data in a temporary directory, and
stopped by PID: a RabbitMQ node (Debian's ``rabbitmq-server``) with its own node name, AMQP,
distribution and epmd ports, and a ``nats-server -js``. Never the brokers a machine may
already run on the standard ports. Redis Streams use the redis-server of `servers`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["until"]


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
