"""NATS JetStream: `jetstream` handlers on a nats-server -js of the tests' own, the store on
a redis-server of the tests' own."""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, StreamConfig
from nats.js.client import JetStreamContext

from goblin_idem import RedisStore
from goblin_idem.consumers import jetstream
from goblin_idem.consumers._nats import JetStreamHandler
from goblin_idem.sql import SqlRecords, session
from tests.support.brokers import Nats
from tests.support.procs import spawn, stop
from tests.support.servers import Server, free_port
from tests.support.waits import until


@dataclass
class Setup:
    nc: Client
    js: JetStreamContext
    store: RedisStore
    stream: str = field(default_factory=lambda: f"orders{uuid.uuid4().hex[:8]}")
    subs: list[Any] = field(default_factory=list)

    @property
    def subject(self) -> str:
        return f"{self.stream}.new"

    async def subscribe(
        self, handler: JetStreamHandler, *, ack_wait: float = 30, max_deliver: int = -1
    ) -> None:
        config = ConsumerConfig(ack_wait=ack_wait, max_deliver=max_deliver)
        sub = await handler.subscribe(
            self.js, self.subject, queue="billing", durable="billing", config=config
        )
        self.subs.append(sub)

    async def publish(self, msg_id: str | None, body: bytes = b"{}", **headers: str) -> bool:
        """Publish; whether JetStream stored it (False: its duplicate window dropped it)."""
        if msg_id is not None:
            headers["Nats-Msg-Id"] = msg_id
        ack = await self.js.publish(self.subject, body, headers=headers or None)
        return not ack.duplicate

    async def settled(self) -> bool:
        info = await self.js.consumer_info(self.stream, "billing")
        return info.num_ack_pending == 0 and info.num_pending == 0


@pytest.fixture
async def setup(nats_server: Nats, redis_server: Server) -> AsyncIterator[Setup]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    s = Setup(nc, js, RedisStore.from_url(redis_server.url))
    # a duplicate window of 100 ms (the least allowed): a producer's retry after it is stored again
    await js.add_stream(
        StreamConfig(name=s.stream, subjects=[f"{s.stream}.>"], duplicate_window=0.1)
    )
    yield s
    for sub in s.subs:
        await sub.unsubscribe()
    await js.delete_stream(s.stream)
    await nc.drain()
    await s.store.aclose()


class Effects:
    def __init__(self) -> None:
        self.runs: collections.Counter[str] = collections.Counter()

    async def __call__(self, msg: Msg) -> dict[str, int]:
        name = (msg.headers or {}).get("order") or (msg.headers or {})["Nats-Msg-Id"]
        self.runs[name] += 1
        return {"sequence": msg.metadata.sequence.stream}


async def test_n_messages_n_effects_all_acked(setup: Setup) -> None:
    effects = Effects()
    await setup.subscribe(jetstream(setup.store)(effects))
    for i in range(20):
        await setup.publish(f"m{i}")
    await until(lambda: len(effects.runs) == 20, what="20 effects")
    await until(setup.settled, what="every message acked")
    assert set(effects.runs.values()) == {1}


async def test_a_message_published_twice_runs_once_both_acked(setup: Setup) -> None:
    """The producer's retry comes after JetStream's own duplicate window: stored twice."""
    effects = Effects()
    await setup.subscribe(jetstream(setup.store)(effects))
    assert await setup.publish("twice")

    async def stored_again() -> bool:
        return await setup.publish("twice")

    await until(stored_again, what="the copy stored after the duplicate window")
    await setup.publish("after")
    await until(lambda: "after" in effects.runs, what="the last message's effect")
    await until(setup.settled, what="both copies acked")
    assert effects.runs == {"twice": 1, "after": 1}


async def test_the_handler_raising_once_runs_again_one_effect(setup: Setup) -> None:
    attempts = 0

    @jetstream(setup.store, requeue_delay_seconds=0.05)
    async def handle(msg: Msg) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("the downstream said no")

    await setup.subscribe(handle)
    await setup.publish("flaky")
    await until(lambda: attempts == 2, what="the redelivery's run")
    await until(setup.settled, what="acked after the second run")
    assert attempts == 2


async def test_a_poison_message_is_terminated_after_max_deliveries(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = 0
    terminated: list[bytes] = []

    async def advisory(msg: Msg) -> None:
        terminated.append(msg.data)

    await setup.nc.subscribe(
        f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{setup.stream}.billing", cb=advisory
    )

    @jetstream(setup.store, max_deliveries=2, requeue_delay_seconds=0.05)
    async def handle(msg: Msg) -> None:
        nonlocal attempts
        attempts += 1
        raise ValueError(f"cannot parse attempt {attempts}")

    await setup.subscribe(handle)
    with caplog.at_level(logging.ERROR, "goblin_idem.consumers"):
        await setup.publish("poison")
        await until(lambda: bool(terminated), what="the server's MSG_TERMINATED advisory")
    await until(setup.settled, what="nothing left pending")
    assert attempts == 2
    [line] = [r.getMessage() for r in caplog.records if "dead letter" in r.getMessage()]
    assert "'poison'" in line and "failed 2 times" in line and "cannot parse attempt 2" in line


async def test_a_message_without_the_header_is_terminated_and_named(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    effects = Effects()
    await setup.subscribe(jetstream(setup.store)(effects))
    with caplog.at_level(logging.ERROR, "goblin_idem.consumers"):
        await setup.publish(None, b"anonymous")
        await until(setup.settled, what="the message terminated")
    assert not effects.runs
    [line] = [r.getMessage() for r in caplog.records]
    assert "no message id" in line and f"subject {setup.subject}" in line


async def test_a_consumer_that_would_stop_first_is_refused(setup: Setup) -> None:
    handler = jetstream(setup.store, max_deliveries=5)(Effects())
    with pytest.raises(ValueError, match="max_deliver=5, not above max_deliveries=5"):
        await setup.subscribe(handler, max_deliver=5)


async def test_a_redelivery_during_a_slow_first_delivery_never_runs_twice(
    setup: Setup,
) -> None:
    """Two members of the queue group; the first delivery outlives ack_wait (in_progress
    keeps it), a copy of the message reaches the other member meanwhile and is put back
    until the first ends, then acked without running."""
    finish = asyncio.Event()
    runs: list[int] = []
    deliveries: collections.Counter[int] = collections.Counter()

    def order(msg: Msg) -> str:
        deliveries[msg.metadata.sequence.stream] += 1
        return (msg.headers or {})["order"]

    async def slow(msg: Msg) -> None:
        runs.append(msg.metadata.sequence.stream)
        await finish.wait()

    for _ in range(2):
        handler = jetstream(setup.store, key=order, lease_seconds=1, requeue_delay_seconds=0.3)
        await setup.subscribe(handler(slow), ack_wait=1)
    await setup.publish("a", order="o-1")
    await until(lambda: bool(runs), what="the first run")
    await setup.publish("b", order="o-1")
    # the copy put back (in flight) five times: 1.5 s, past the first's ack_wait
    await until(lambda: deliveries[2] >= 6, what="the copy put back while the first runs")
    finish.set()
    await until(setup.settled, what="both acked")
    assert runs == [1]
    assert deliveries[1] == 1  # in_progress kept the server from redelivering the first


async def test_two_consumers_under_load_effects_equal_distinct_ids(setup: Setup) -> None:
    effects = Effects()
    for _ in range(2):
        handler = jetstream(setup.store, key=lambda m: (m.headers or {})["order"])
        await setup.subscribe(handler(effects))
    orders = [f"o{i}" for i in range(300)] + [f"o{i}" for i in range(0, 300, 15)]
    await asyncio.gather(*(setup.publish(f"m{n}", order=o) for n, o in enumerate(orders)))
    await until(lambda: len(effects.runs) == 300, what="300 distinct effects")
    await until(setup.settled, what="every copy acked")
    assert set(effects.runs.values()) == {1}


async def test_the_store_unavailable_runs_nothing_and_acks_nothing(setup: Setup) -> None:
    effects = Effects()
    nowhere = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    deliveries: list[int] = []

    def key(msg: Msg) -> str:
        deliveries.append(msg.metadata.num_delivered)
        return (msg.headers or {})["Nats-Msg-Id"]

    handler = jetstream(nowhere, key=key, requeue_delay_seconds=0.05)(effects)
    await setup.subscribe(handler)
    await setup.publish("m1")
    await until(lambda: len(deliveries) >= 2, what="put back and delivered again")
    for sub in setup.subs:
        await sub.unsubscribe()
    setup.subs.clear()
    await nowhere.aclose()
    assert not effects.runs
    info = await setup.js.consumer_info(setup.stream, "billing")
    assert info.num_ack_pending + info.num_pending == 1


async def test_sigkill_after_the_commit_before_the_ack_one_effect(
    setup: Setup, nats_server: Nats, redis_server: Server
) -> None:
    """A consumer process killed between storing its result and its ack: the server
    redelivers after ack_wait to the other member, which finds the result and acks."""
    effects_key = f"{setup.stream}:effects"
    client = redis_server.client()
    args = [nats_server.url, redis_server.url, setup.subject, effects_key]
    child = spawn(["-m", "tests.consumers.nats_worker", *args], {})
    try:

        async def joined() -> bool:
            try:
                info = await setup.js.consumer_info(setup.stream, "billing")
            except nats.js.errors.NotFoundError:
                return False
            return bool(info.push_bound)

        await until(joined, what="the worker's subscription")
        await setup.publish("m1")

        def killed() -> bool:
            return child.poll() is not None

        await until(killed, what="the worker killed itself before its ack")
        assert child.returncode == -signal.SIGKILL
    finally:
        stop(child)
    assert await client.hget(effects_key, "m1") == b"1"

    @jetstream(setup.store)
    async def handle(msg: Msg) -> None:
        await client.hincrby(effects_key, (msg.headers or {})["Nats-Msg-Id"], 1)

    await setup.subscribe(handle, ack_wait=1)
    await until(setup.settled, what="the redelivery acked")
    assert await client.hget(effects_key, "m1") == b"1"
    await client.aclose()


async def test_with_records_the_handler_writes_in_the_runs_transaction(
    setup: Setup, tmp_path: Path
) -> None:
    """A run that raised after its write leaves no row; the redelivery's row commits with
    the record, and a copy of the message replays the record."""
    records = SqlRecords(f"sqlite+aiosqlite:///{tmp_path / 'records.db'}")
    await records.create_table()
    async with records.engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE charges (invoice TEXT NOT NULL)"))
    attempts = 0

    @jetstream(
        setup.store, records=records, key=lambda m: m.headers["invoice"], requeue_delay_seconds=0.05
    )
    async def charge(msg: Msg) -> dict[str, int]:
        nonlocal attempts
        attempts += 1
        db = await session()  # the run's session, as an HTTP handler's
        await db.execute(sa.text("INSERT INTO charges VALUES (:i)"), {"i": msg.headers["invoice"]})
        if attempts == 1:
            raise RuntimeError("the card network timed out")
        return {"attempt": attempts}

    await setup.subscribe(charge)
    await setup.publish("send-1", invoice="INV-1")
    await until(lambda: attempts == 2, what="the redelivery's run")
    await until(setup.settled, what="acked")
    await setup.publish("send-2", invoice="INV-1")  # the producer's retry
    await until(setup.settled, what="the copy acked")
    async with records.engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT invoice FROM charges"))).all()
    assert [r[0] for r in rows] == ["INV-1"] and attempts == 2
    await records.aclose()
