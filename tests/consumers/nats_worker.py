"""A NATS JetStream consumer process that SIGKILLs itself when it is about to ack: its
result is stored (the run's closing step ended) and the message is still unacked.

    python -m tests.consumers.nats_worker <nats url> <redis url> <subject> <effects hash>

It joins the queue group ``billing`` (durable ``billing``, ``ack_wait`` 1 s). The handler's
effect is an HINCRBY of the message's ``Nats-Msg-Id`` in the effects hash.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import nats
import redis.asyncio
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from goblin_idem import RedisStore
from goblin_idem.consumers import jetstream


class KilledBeforeAck:
    """The message, but its ack kills the process."""

    def __init__(self, msg: Msg) -> None:
        self.msg = msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self.msg, name)

    async def ack(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


async def main(nats_url: str, redis_url: str, subject: str, effects: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    store = RedisStore.from_url(redis_url)

    @jetstream(store)
    async def handle(msg: Msg) -> None:
        await client.hincrby(effects, (msg.headers or {})["Nats-Msg-Id"], 1)

    async def killed_before_ack(msg: Msg) -> None:
        await handle(KilledBeforeAck(msg))  # type: ignore[arg-type]

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    config = ConsumerConfig(ack_wait=1, max_deliver=-1)
    await js.subscribe(
        subject,
        queue="billing",
        durable="billing",
        config=config,
        cb=killed_before_ack,
        manual_ack=True,
    )
    await asyncio.Future()  # until killed


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
