"""Messages per second through each broker consumer, against the same consumer without
goblin-idem, one run per broker.

    python bench/consumer_bench.py [--messages 3000] [--brokers redis,nats,amqp]

Each broker is one of the tests' own on loopback (tests/support/brokers.py, servers.py),
the store a redis-server of its own. Per broker, the same messages (distinct ids, a handler
that does nothing) are consumed twice from a backlog: by the bare consumer (read, run the
handler, ack) and through goblin-idem's adapter (claim, run, publish, ack); the time is from
the first read to the last ack. It prints the rates and their ratio (adapter / bare) as
JSON. The handler does no work, so the ratio is the adapter's whole cost: a handler that
writes to a database dilutes it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aio_pika
import nats
import redis.asyncio
from nats.js.api import ConsumerConfig, StreamConfig

from goblin_idem import RedisStore
from goblin_idem.consumers import StreamConsumer, amqp, jetstream
from tests.support.brokers import start_nats, start_rabbitmq
from tests.support.servers import start_server

BATCH = 16


async def nothing(*args: Any) -> None:
    return None


async def redis_rates(n: int, broker_url: str, store: RedisStore) -> dict[str, float]:
    client = redis.asyncio.Redis.from_url(broker_url)
    rates = {}
    for variant in ("bare", "goblin_idem"):
        stream = f"bench-{uuid.uuid4().hex[:8]}"
        async with client.pipeline(transaction=False) as pipe:
            for i in range(n):
                pipe.xadd(stream, {"message_id": f"{variant}-{i}"})
            await pipe.execute()
        await client.xgroup_create(stream, "g", id="0")
        start = time.perf_counter()
        if variant == "bare":
            await _bare_stream(client, stream, n)
        else:
            consumer = StreamConsumer(
                store,
                client,
                stream=stream,
                group="g",
                consumer="c",
                handler=nothing,
                batch=BATCH,
            )
            task = asyncio.create_task(consumer.run())
            await _until_acked(functools.partial(_stream_done, client, stream))
            consumer.stop()
            await task
        rates[variant] = n / (time.perf_counter() - start)
    await client.aclose()
    return rates


async def _bare_stream(client: redis.asyncio.Redis, stream: str, n: int) -> None:
    """What a consumer without goblin-idem does: read a batch, run it, ack each entry."""
    done = 0
    while done < n:
        reply: Any = await client.xreadgroup("g", "c", {stream: ">"}, count=BATCH, block=1000)
        entries = reply[0][1] if reply else []

        async def one(entry_id: Any, fields: Any) -> None:
            await nothing(fields, entry_id)
            await client.xack(stream, "g", entry_id)

        await asyncio.gather(*(one(i, f) for i, f in entries))
        done += len(entries)


async def _stream_done(client: redis.asyncio.Redis, stream: str) -> bool:
    group = (await client.xinfo_groups(stream))[0]
    return bool(group["pending"] == 0 and group["lag"] == 0)


async def nats_rates(n: int, url: str, store: RedisStore) -> dict[str, float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    rates = {}
    for variant in ("bare", "goblin_idem"):
        name = f"bench{uuid.uuid4().hex[:8]}"
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"]))
        await asyncio.gather(
            *(
                js.publish(f"{name}.m", b"{}", headers={"Nats-Msg-Id": f"{variant}-{i}"})
                for i in range(n)
            )
        )
        config = ConsumerConfig(max_ack_pending=BATCH, max_deliver=-1)
        start = time.perf_counter()
        if variant == "bare":

            async def bare(msg: Any) -> None:
                await nothing(msg)
                await msg.ack()

            sub = await js.subscribe(
                f"{name}.m", durable="c", cb=bare, manual_ack=True, config=config
            )
        else:
            handler = jetstream(store)(nothing)
            sub = await handler.subscribe(js, f"{name}.m", durable="c", config=config)

        await _until_acked(functools.partial(_nats_done, js, name))
        rates[variant] = n / (time.perf_counter() - start)
        await sub.unsubscribe()
        await js.delete_stream(name)
    await nc.drain()
    return rates


async def _nats_done(js: Any, name: str) -> bool:
    info = await js.consumer_info(name, "c")
    return bool(info.num_ack_pending == 0 and info.num_pending == 0)


async def amqp_rates(n: int, url: str, store: RedisStore) -> dict[str, float]:
    connection = await aio_pika.connect_robust(url)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=BATCH)
    rates = {}
    for variant in ("bare", "goblin_idem"):
        name = f"bench-{uuid.uuid4().hex[:8]}"
        queue = await channel.declare_queue(name, auto_delete=False)
        for i in range(n):
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}", message_id=f"{variant}-{i}"), routing_key=name
            )
        finished = asyncio.Event()
        on_message = _counting(n, finished, amqp(store)(nothing) if variant != "bare" else None)
        start = time.perf_counter()
        tag = await queue.consume(on_message)
        await finished.wait()
        rates[variant] = n / (time.perf_counter() - start)
        await queue.cancel(tag)
        await queue.delete()
    await connection.close()
    return rates


def _counting(
    n: int, finished: asyncio.Event, process: Callable[[Any], Awaitable[Any]] | None
) -> Callable[[Any], Awaitable[None]]:
    """A queue's callback: the bare consumer's (`process` None: ack) or goblin-idem's,
    setting `finished` at the n-th message."""
    handled = 0

    async def on_message(message: Any) -> None:
        nonlocal handled
        if process is None:
            await nothing(message)
            await message.ack()
        else:
            await process(message)
        handled += 1
        if handled == n:
            finished.set()

    return on_message


async def _until_acked(done: Callable[[], Awaitable[bool]]) -> None:
    """Poll the broker's count every 5 ms (the consumer under test has no hook to tell)."""
    while True:
        if await done():
            return
        await asyncio.sleep(0.005)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--brokers", default="redis,nats,amqp")
    args = parser.parse_args()
    wanted = args.brokers.split(",")
    store_server = start_server("redis")
    stream_server = start_server("redis")
    started: list[Any] = [store_server, stream_server]
    results: dict[str, dict[str, float]] = {}

    async def measure() -> None:
        store = RedisStore.from_url(store_server.url)
        if "redis" in wanted:
            results["redis_streams"] = await redis_rates(args.messages, stream_server.url, store)
        if "nats" in wanted:
            nats_server = start_nats()
            started.append(nats_server)
            results["nats_jetstream"] = await nats_rates(args.messages, nats_server.url, store)
        if "amqp" in wanted:
            rabbitmq = start_rabbitmq()
            started.append(rabbitmq)
            results["rabbitmq"] = await amqp_rates(args.messages, rabbitmq.url, store)
        await store.aclose()

    try:
        asyncio.run(measure())
    finally:
        for server in reversed(started):
            server.stop()
    for rates in results.values():
        rates["ratio"] = rates["goblin_idem"] / rates["bare"]
    rounded = {
        b: {k: round(v, 2 if k == "ratio" else 0) for k, v in r.items()} for b, r in results.items()
    }
    print(json.dumps({"messages": args.messages, **rounded}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
