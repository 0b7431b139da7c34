"""RabbitMQ: `amqp` handlers consuming from a RabbitMQ node of the tests' own (its own node
name, ports, epmd and data dir), the store on a redis-server of the tests' own. Every queue
dead-letters to a queue of its own through a dead-letter exchange."""

from __future__ import annotations

import asyncio
import collections
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from goblin_idem import RedisStore
from goblin_idem.consumers import amqp
from tests.support.brokers import RabbitMQ
from tests.support.procs import spawn, stop
from tests.support.servers import Server, free_port
from tests.support.waits import until

Process = Callable[[AbstractIncomingMessage], Coroutine[Any, Any, Any]]


@dataclass
class Setup:
    broker: RabbitMQ
    connection: AbstractRobustConnection
    channel: AbstractChannel
    store: RedisStore
    queue: str = field(default_factory=lambda: f"orders-{uuid.uuid4().hex[:8]}")
    busy: int = 0
    channels: list[AbstractChannel] = field(default_factory=list)

    @property
    def dead_queue(self) -> str:
        return f"{self.queue}.dead"

    async def declare(self) -> None:
        dlx = await self.channel.declare_exchange(f"{self.queue}.dlx", aio_pika.ExchangeType.FANOUT)
        dead = await self.channel.declare_queue(self.dead_queue)
        await dead.bind(dlx)
        await self.channel.declare_queue(
            self.queue, arguments={"x-dead-letter-exchange": f"{self.queue}.dlx"}
        )

    async def consume(self, process: Process) -> None:
        """`process` on a channel of its own (prefetch 20), counted while it works."""
        channel = await self.connection.channel()
        await channel.set_qos(prefetch_count=20)
        self.channels.append(channel)
        queue = await channel.get_queue(self.queue)

        async def counted(message: AbstractIncomingMessage) -> None:
            self.busy += 1
            try:
                await process(message)
            finally:
                self.busy -= 1

        await queue.consume(counted)

    async def publish(self, message_id: str | None, body: bytes = b"{}", **headers: str) -> None:
        message = aio_pika.Message(body, message_id=message_id, headers=headers or None)
        await self.channel.default_exchange.publish(message, routing_key=self.queue)

    async def ready(self, name: str | None = None) -> int:
        """The messages waiting in the queue, as the broker counts them now (aio-pika's
        passive declare gives the first declaration's count again)."""
        underlay = await self.channel.get_underlay_channel()
        declared = await underlay.queue_declare(name or self.queue, passive=True)
        return int(declared.message_count or 0)

    async def settled(self) -> bool:
        """Nothing waiting in the queue and no delivery in a handler: every one acked,
        nacked back (then waiting again) or rejected."""
        return self.busy == 0 and await self.ready() == 0 and self.busy == 0


@pytest.fixture
async def setup(rabbitmq_server: RabbitMQ, redis_server: Server) -> AsyncIterator[Setup]:
    connection = await aio_pika.connect_robust(rabbitmq_server.url)
    channel = await connection.channel()
    s = Setup(rabbitmq_server, connection, channel, RedisStore.from_url(redis_server.url))
    await s.declare()
    yield s
    await connection.close()
    await s.store.aclose()


class Effects:
    def __init__(self) -> None:
        self.runs: collections.Counter[str] = collections.Counter()

    async def __call__(self, message: AbstractIncomingMessage) -> dict[str, str]:
        order = (message.headers or {}).get("order")
        self.runs[str(order or message.message_id)] += 1
        return {"id": str(message.message_id)}


async def test_n_messages_n_effects_all_acked(setup: Setup) -> None:
    effects = Effects()
    await setup.consume(amqp(setup.store)(effects))
    for i in range(20):
        await setup.publish(f"m{i}")
    await until(lambda: len(effects.runs) == 20, what="20 effects")
    await until(setup.settled, what="every message acked")
    assert set(effects.runs.values()) == {1}


async def test_a_message_published_twice_runs_once_both_acked(setup: Setup) -> None:
    effects = Effects()
    process = amqp(setup.store)(effects)
    await setup.consume(process)
    await setup.publish("twice")
    await setup.publish("twice")
    await setup.publish("after")
    await until(lambda: "after" in effects.runs, what="the last message's effect")
    await until(setup.settled, what="both copies acked")
    assert effects.runs == {"twice": 1, "after": 1}
    assert await setup.ready(setup.dead_queue) == 0


async def test_the_handler_raising_once_runs_again_one_effect(setup: Setup) -> None:
    attempts = 0

    @amqp(setup.store, requeue_delay_seconds=0.05)
    async def process(message: AbstractIncomingMessage) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("the downstream said no")

    await setup.consume(process)
    await setup.publish("flaky")
    await until(lambda: attempts == 2, what="the redelivery's run")
    await until(setup.settled, what="acked after the second run")
    assert attempts == 2


async def test_a_poison_message_goes_to_the_dead_letter_exchange(setup: Setup) -> None:
    attempts = 0

    @amqp(setup.store, max_deliveries=3, requeue_delay_seconds=0.05)
    async def process(message: AbstractIncomingMessage) -> None:
        nonlocal attempts
        attempts += 1
        raise ValueError("cannot parse")

    await setup.consume(process)
    await setup.publish("poison", b"{{{")

    async def dead() -> bool:
        return await setup.ready(setup.dead_queue) == 1

    await until(dead, what="the message in the dead-letter queue")
    await until(setup.settled, what="nothing left")
    assert attempts == 3
    queue = await setup.channel.get_queue(setup.dead_queue)
    message = await queue.get()
    assert message is not None and message.body == b"{{{" and message.message_id == "poison"
    await message.ack()


async def test_a_message_with_a_malformed_id_is_dead_lettered(setup: Setup) -> None:
    """(aiormq fills a random id into a message published without one, so a missing id
    cannot be sent from here; it takes the same path: no key.)"""
    effects = Effects()
    await setup.consume(amqp(setup.store)(effects))
    await setup.publish("order\t7", b"a tab in its id")

    async def dead() -> bool:
        return await setup.ready(setup.dead_queue) == 1

    await until(dead, what="the message in the dead-letter queue")
    assert not effects.runs


async def test_a_redelivery_during_a_slow_first_delivery_never_runs_twice(
    setup: Setup,
) -> None:
    """A producer's copy reaches another consumer while the first delivery runs: put back
    (after the delay) until the first ends and acks, then acked without running."""
    finish = asyncio.Event()
    runs: list[str] = []
    copies: list[bool] = []

    def order(message: AbstractIncomingMessage) -> str:
        copies.append(bool(message.redelivered))
        return str((message.headers or {})["order"])

    async def slow(message: AbstractIncomingMessage) -> None:
        runs.append(str(message.message_id))
        await finish.wait()

    for _ in range(2):
        await setup.consume(amqp(setup.store, key=order, requeue_delay_seconds=0.1)(slow))
    await setup.publish("a", order="o-1")
    await until(lambda: bool(runs), what="the first run")
    await setup.publish("b", order="o-1")
    await until(lambda: copies.count(True) >= 2, what="the copy put back and redelivered")
    finish.set()
    await until(setup.settled, what="both acked")
    assert runs == ["a"]


async def test_two_consumers_under_load_effects_equal_distinct_ids(setup: Setup) -> None:
    effects = Effects()
    for _ in range(2):
        await setup.consume(amqp(setup.store, scope="orders")(effects))
    ids = [f"m{i}" for i in range(300)] + [f"m{i}" for i in range(0, 300, 15)]
    for message_id in ids:
        await setup.publish(message_id)
    await until(lambda: len(effects.runs) == 300, what="300 distinct effects")
    await until(setup.settled, what="every copy acked")
    assert set(effects.runs.values()) == {1}


async def test_the_store_unavailable_runs_nothing_and_acks_nothing(setup: Setup) -> None:
    effects = Effects()
    nowhere = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    deliveries: list[bool] = []

    def key(message: AbstractIncomingMessage) -> str:
        deliveries.append(bool(message.redelivered))
        return str(message.message_id)

    await setup.consume(amqp(nowhere, key=key, requeue_delay_seconds=0.05)(effects))
    await setup.publish("m1")
    await until(lambda: len(deliveries) >= 2, what="put back and delivered again")
    for channel in setup.channels:
        await channel.close()
    await nowhere.aclose()
    assert not effects.runs and deliveries[1]

    async def back() -> bool:
        return await setup.ready() == 1

    await until(back, what="the message waiting again, unacked")


async def test_sigkill_after_the_commit_before_the_ack_one_effect(
    setup: Setup, redis_server: Server
) -> None:
    effects_key = f"{setup.queue}:effects"
    child = spawn(
        [
            "-m",
            "tests.consumers.amqp_worker",
            setup.broker.url,
            redis_server.url,
            setup.queue,
            effects_key,
        ],
        {},
    )
    client = redis_server.client()
    try:
        await setup.publish("m1")

        def killed() -> bool:
            return child.poll() is not None

        await until(killed, what="the worker killed itself before its ack")
        assert child.returncode == -signal.SIGKILL
    finally:
        stop(child)
    assert await client.hget(effects_key, "m1") == b"1"

    @amqp(setup.store, scope="orders-worker")
    async def process(message: AbstractIncomingMessage) -> None:
        await client.hincrby(effects_key, str(message.message_id), 1)

    await setup.consume(process)
    await until(setup.settled, what="the redelivery acked")
    assert await client.hget(effects_key, "m1") == b"1"
    await client.aclose()
