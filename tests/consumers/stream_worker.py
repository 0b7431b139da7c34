"""A Redis Streams consumer process that SIGKILLs itself when it is about to ack: its result
is stored (the run's closing step ended) and the entry is still pending.

    python -m tests.consumers.stream_worker <redis url> <stream> <effects hash>

The handler's effect is an HINCRBY of the message id in the effects hash.
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


async def main(url: str, stream: str, effects: str) -> None:
    client = KilledBeforeAck.from_url(url)
    store = RedisStore.from_url(url)

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        await client.hincrby(effects, fields[b"message_id"].decode(), 1)

    consumer = StreamConsumer(
        store,
        client,
        stream=stream,
        group="billing",
        consumer="doomed",
        handler=handler,
        lease_seconds=1,
    )
    await consumer.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
