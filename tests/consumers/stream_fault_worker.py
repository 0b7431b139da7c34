"""A Redis Streams consumer process of the fault run (`stream_faults`).

    python -m tests.consumers.stream_fault_worker <broker url> <store url> <database url>
        <stream> <name> <records: 1|0> <seed> <kill chance>

Its handler inserts a row per message into ``effects``: with records through the run's
transaction (``goblin_idem.sql.connection()``), else in a transaction of its own committed
before the run's result is stored (what a consumer without records does). With chance
`kill chance` per message it SIGKILLs itself when about to ack: after the commit and the
result's publish, before XACK.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from typing import Any

import redis.asyncio
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from goblin_idem import RedisStore
from goblin_idem.consumers import StreamConsumer
from goblin_idem.sql import SqlRecords, connection

INSERT = sa.text("INSERT INTO effects (message_id, entry_id, worker) VALUES (:m, :e, :w)")


class KilledSometimesBeforeAck(redis.asyncio.Redis):
    chance = 0.0
    rng = random.Random()

    async def xack(self, *args: Any, **kwargs: Any) -> Any:
        if self.rng.random() < self.chance:
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().xack(*args, **kwargs)


async def main(
    broker: str,
    store_url: str,
    db: str,
    stream: str,
    name: str,
    with_records: str,
    seed: str,
    chance: str,
) -> None:
    client = KilledSometimesBeforeAck.from_url(broker)
    client.rng = random.Random(int(seed))
    client.chance = float(chance)
    store = RedisStore.from_url(store_url, socket_timeout=1)
    records = SqlRecords(db) if with_records == "1" else None
    own = create_async_engine(db) if records is None else None

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        values = {"m": fields[b"message_id"].decode(), "e": entry_id, "w": name}
        if own is None:
            await (await connection()).execute(INSERT, values)
        else:
            async with own.begin() as conn:
                await conn.execute(INSERT, values)

    consumer = StreamConsumer(
        store,
        client,
        stream=stream,
        group="faults",
        consumer=name,
        handler=handler,
        records=records,
        lease_seconds=1,
        max_deliveries=1000,
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, consumer.stop)
    await consumer.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:9]))
