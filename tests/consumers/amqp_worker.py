"""A RabbitMQ consumer process that SIGKILLs itself when it is about to ack: its result is
stored (the run's closing step ended) and the message is still unacked.

    python -m tests.consumers.amqp_worker <amqp url> <redis url> <queue> <effects hash>

The handler's effect is an HINCRBY of the message id in the effects hash.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import aio_pika
import redis.asyncio
from aio_pika.abc import AbstractIncomingMessage

from goblin_idem import RedisStore
from goblin_idem.consumers import amqp


class KilledBeforeAck:
    """The message, but its ack kills the process (aio-pika's messages have slots)."""

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self.message = message

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    async def ack(self, multiple: bool = False) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


async def main(amqp_url: str, redis_url: str, queue_name: str, effects: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    store = RedisStore.from_url(redis_url)

    @amqp(store, scope="orders-worker")
    async def process(message: AbstractIncomingMessage) -> None:
        await client.hincrby(effects, str(message.message_id), 1)

    async def killed_before_ack(message: AbstractIncomingMessage) -> None:
        await process(KilledBeforeAck(message))  # type: ignore[arg-type]

    connection = await aio_pika.connect_robust(amqp_url)
    channel = await connection.channel()
    queue = await channel.get_queue(queue_name)
    await queue.consume(killed_before_ack)
    await asyncio.Future()  # until killed


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
