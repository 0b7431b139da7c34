"""A Redis Streams consumer process, for what only a process shows.

    python -m tests.consumers.stream_worker <redis url> <stream> <effects hash> <mode>

The handler's effect is an HINCRBY of the message id in the effects hash. `mode`:

- ``kill-before-ack``: the process SIGKILLs itself when it is about to ack: its result is
  stored (the run's closing step ended) and the entry is still pending;
- ``slow``: the handler marks ``<effects>:started``, then waits until the key
  ``<effects>:release`` exists (BLPOP) before its effect; SIGTERM calls `stop()`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import redis.asyncio

from goblin_idem import RedisStore
from goblin_idem.consumers import StreamConsumer


class KilledBeforeAck(redis.asyncio.Redis):
    async def xack(self, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


async def main(url: str, stream: str, effects: str, mode: str) -> None:
    broker = KilledBeforeAck.from_url(url) if mode == "kill-before-ack" else None
    client = redis.asyncio.Redis.from_url(url)
    store = RedisStore.from_url(url)

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        if mode == "slow":
            await client.rpush(f"{effects}:started", entry_id)
            await client.blpop([f"{effects}:release"], timeout=60)
        await client.hincrby(effects, fields[b"message_id"].decode(), 1)

    consumer = StreamConsumer(
        store,
        broker or client,
        stream=stream,
        group="billing",
        consumer=mode,
        handler=handler,
        lease_seconds=1,
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, consumer.stop)
    await consumer.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
