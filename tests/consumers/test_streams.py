"""Redis Streams: `StreamConsumer` on a redis-server of the tests' own (the stream and the
store on one server, under names of each test's own)."""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio

from goblin_idem import RedisStore
from goblin_idem.consumers import StreamConsumer
from goblin_idem.sql import SqlRecords
from tests.support.procs import spawn, stop
from tests.support.servers import Server, free_port
from tests.support.waits import until


@dataclass
class Setup:
    server: Server
    redis: redis.asyncio.Redis
    store: RedisStore
    stream: str = field(default_factory=lambda: f"orders-{uuid.uuid4().hex[:8]}")
    group: str = "billing"
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    consumers: list[StreamConsumer] = field(default_factory=list)

    def start(self, handler: Callable[..., Any], name: str = "c1", **kwargs: Any) -> StreamConsumer:
        options: dict[str, Any] = {"lease_seconds": 1, **kwargs}
        consumer = StreamConsumer(
            options.pop("store", self.store),
            self.redis,
            stream=self.stream,
            group=self.group,
            consumer=name,
            handler=handler,
            **options,
        )
        self.consumers.append(consumer)
        self.tasks.append(asyncio.create_task(consumer.run()))
        return consumer

    async def group_ready(self) -> None:
        async def exists() -> bool:
            return await self.redis.exists(self.stream) == 1

        await until(exists, what="the consumer created its group")

    async def publish(self, message_id: str | None, **fields: str) -> None:
        body = dict(fields)
        if message_id is not None:
            body["message_id"] = message_id
        await self.redis.xadd(self.stream, body)  # type: ignore[arg-type]

    async def pending(self) -> int:
        info = await self.redis.xpending(self.stream, self.group)
        return int(info["pending"])

    async def dead(self) -> list[dict[bytes, bytes]]:
        return [fields for _, fields in await self.redis.xrange(f"{self.stream}:dead")]

    async def close(self) -> None:
        for consumer in self.consumers:
            consumer.stop()
        await asyncio.gather(*self.tasks)


@pytest.fixture
async def setup(redis_server: Server) -> AsyncIterator[Setup]:
    store = RedisStore.from_url(redis_server.url)
    client = redis_server.client()
    s = Setup(redis_server, client, store)
    yield s
    await s.close()
    await store.aclose()
    await client.aclose()


class Effects:
    """What handlers did, by message id."""

    def __init__(self) -> None:
        self.runs: collections.Counter[str] = collections.Counter()

    async def __call__(self, fields: dict[bytes, bytes], entry_id: str) -> dict[str, str]:
        self.runs[fields[b"message_id"].decode()] += 1
        return {"entry": entry_id}


async def test_n_messages_n_effects_all_acked(setup: Setup) -> None:
    effects = Effects()
    setup.start(effects)
    await setup.group_ready()
    for i in range(20):
        await setup.publish(f"m{i}")
    await until(lambda: len(effects.runs) == 20, what="20 effects")
    await until(lambda: _zero(setup.pending()), what="every entry acked")
    assert set(effects.runs.values()) == {1}


async def test_a_message_published_twice_runs_once_both_acked(setup: Setup) -> None:
    effects = Effects()
    setup.start(effects)
    await setup.group_ready()
    await setup.publish("twice")
    await setup.publish("twice")
    await setup.publish("after")
    await until(lambda: "after" in effects.runs, what="the last message's effect")
    await until(lambda: _zero(setup.pending()), what="both copies acked")
    assert effects.runs == {"twice": 1, "after": 1}


async def test_the_handler_raising_once_runs_again_one_effect(setup: Setup) -> None:
    done: list[str] = []
    attempts = 0

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("the downstream said no")
        done.append(entry_id)

    setup.start(handler)
    await setup.group_ready()
    await setup.publish("flaky")
    await until(lambda: len(done) == 1, what="the redelivery's effect")
    await until(lambda: _zero(setup.pending()), what="acked after the second run")
    assert attempts == 2 and await setup.dead() == []


async def test_a_poison_message_goes_to_the_dead_letter_after_max_deliveries(
    setup: Setup,
) -> None:
    attempts = 0

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        nonlocal attempts
        attempts += 1
        raise ValueError(f"cannot parse attempt {attempts}")

    setup.start(handler, max_deliveries=2)
    await setup.group_ready()
    await setup.publish("poison", body="{{{")

    async def buried() -> bool:
        return len(await setup.dead()) == 1

    await until(buried, what="the dead letter's entry")
    await until(lambda: _zero(setup.pending()), what="the poison entry acked")
    [dead] = await setup.dead()
    assert attempts == 2
    assert dead[b"message_id"] == b"poison" and dead[b"body"] == b"{{{"
    reason = dead[b"goblin_idem.reason"].decode()
    assert "failed 2 times" in reason and "cannot parse attempt 2" in reason


async def test_the_dead_letter_log_line_names_the_id_as_sent_and_its_key_hash(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """The id is read from the entry as bytes: the line shows it as the producer wrote it,
    and the hash that `inspect --hash` and `forget --hash` take."""
    hashes: list[str] = []

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        raise ValueError("cannot parse")

    with caplog.at_level(logging.ERROR, "goblin_idem.consumers"):
        setup.start(handler, max_deliveries=1, on_event=lambda _, key_hash: hashes.append(key_hash))
        await setup.group_ready()
        await setup.publish("poison-7", body="{{{")

        async def buried() -> bool:
            return len(await setup.dead()) == 1

        await until(buried, what="the dead letter's entry")
    [line] = [r.getMessage() for r in caplog.records if "dead letter" in r.getMessage()]
    assert "message 'poison-7' " in line and "b'poison-7'" not in line
    assert f"key hash {hashes[-1]}" in line


async def test_a_message_without_an_id_or_with_a_malformed_one_is_dead_lettered(
    setup: Setup,
) -> None:
    effects = Effects()
    setup.start(effects)
    await setup.group_ready()
    await setup.publish(None, body="no id")
    await setup.publish("bad\nid", body="malformed")

    async def buried() -> bool:
        return len(await setup.dead()) == 2

    await until(buried, what="both in the dead letter")
    assert not effects.runs
    reasons = {d[b"body"]: d[b"goblin_idem.reason"] for d in await setup.dead()}
    assert b"no message id" in reasons[b"no id"]
    assert b"malformed" in reasons[b"malformed"]
    assert await setup.pending() == 0


async def test_a_key_function_names_the_business_id(setup: Setup) -> None:
    runs: list[str] = []

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        runs.append(fields[b"order"].decode())

    setup.start(handler, key=lambda fields: fields[b"order"])
    await setup.group_ready()
    await setup.publish(None, order="o-1")
    await setup.publish(None, order="o-1")
    await setup.publish(None, order="o-2")
    await until(lambda: sorted(runs) == ["o-1", "o-2"], what="one run per order")
    await until(lambda: _zero(setup.pending()), what="all acked")
    assert sorted(runs) == ["o-1", "o-2"]


async def test_a_redelivery_during_a_slow_first_delivery_never_runs_twice(
    setup: Setup,
) -> None:
    started = asyncio.Event()
    finish = asyncio.Event()
    runs: list[str] = []

    async def slow(fields: dict[bytes, bytes], entry_id: str) -> None:
        runs.append(entry_id)
        started.set()
        await finish.wait()

    first = setup.start(slow, "c1")
    await setup.group_ready()
    await setup.publish("slow")
    await asyncio.wait_for(started.wait(), 10)
    first.stop()  # c1 reads nothing more: the entry's takeover is c2's
    setup.start(slow, "c2")

    async def taken_over() -> bool:
        detail = await setup.redis.xpending_range(setup.stream, setup.group, "-", "+", 10)
        return bool(detail) and detail[0]["consumer"] == b"c2"

    await until(taken_over, what="c2 took the pending entry over (its lease of 1 s idle)")
    finish.set()
    await until(lambda: _zero(setup.pending()), what="the first delivery's ack")
    assert len(runs) == 1


async def test_two_consumers_under_load_effects_equal_distinct_ids(setup: Setup) -> None:
    effects = Effects()
    setup.start(effects, "c1")
    setup.start(effects, "c2")
    await setup.group_ready()
    ids = [f"m{i}" for i in range(300)] + [f"m{i}" for i in range(0, 300, 15)]
    async with setup.redis.pipeline(transaction=False) as pipe:
        for message_id in ids:
            pipe.xadd(setup.stream, {"message_id": message_id})
        await pipe.execute()
    await until(lambda: len(effects.runs) == 300, what="300 distinct effects")
    await until(lambda: _zero(setup.pending()), what="every copy acked")
    assert set(effects.runs.values()) == {1}


async def test_the_store_unavailable_runs_nothing_and_acks_nothing(setup: Setup) -> None:
    effects = Effects()
    nowhere = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    setup.start(effects, store=nowhere)
    await setup.group_ready()
    await setup.publish("m1")

    async def delivered() -> bool:
        detail = await setup.redis.xpending_range(setup.stream, setup.group, "-", "+", 10)
        return len(detail) == 1

    await until(delivered, what="the entry delivered")
    await setup.close()
    setup.consumers.clear()
    setup.tasks.clear()
    await nowhere.aclose()
    assert not effects.runs and await setup.pending() == 1
    setup.start(effects, "c2")  # a store again: the pending entry is taken over and run
    await until(lambda: effects.runs == {"m1": 1}, what="the run once the store is back")
    await until(lambda: _zero(setup.pending()), what="acked")


async def test_stop_lets_the_running_handler_finish_and_ack(setup: Setup) -> None:
    started = asyncio.Event()
    finish = asyncio.Event()
    done: list[str] = []

    async def slow(fields: dict[bytes, bytes], entry_id: str) -> None:
        started.set()
        await finish.wait()
        done.append(entry_id)

    consumer = setup.start(slow)
    await setup.group_ready()
    await setup.publish("m1")
    await asyncio.wait_for(started.wait(), 10)
    consumer.stop()
    await setup.publish("m2")  # published after stop(): left for another consumer
    finish.set()
    await asyncio.wait_for(setup.tasks[0], 10)
    assert len(done) == 1
    assert await setup.redis.xlen(setup.stream) == 2
    info = await setup.redis.xinfo_groups(setup.stream)
    assert info[0]["pending"] == 0  # m1 acked; m2 never read


async def test_sigkill_after_the_commit_before_the_ack_one_effect(setup: Setup) -> None:
    """A consumer process killed between storing its result and XACK: the entry is taken
    over by another consumer, which finds the result and acks without running."""
    effects_key = f"{setup.stream}:effects"
    child = spawn(
        [
            "-m",
            "tests.consumers.stream_worker",
            setup.server.url,
            setup.stream,
            effects_key,
            "kill-before-ack",
        ],
        {},
    )
    try:
        await setup.group_ready()
        await setup.publish("m1")

        def killed() -> bool:
            return child.poll() is not None

        await until(killed, what="the worker killed itself before its ack")
        assert child.returncode == -signal.SIGKILL
    finally:
        stop(child)
    assert await setup.redis.hget(effects_key, "m1") == b"1"
    assert await setup.pending() == 1

    async def handler(fields: dict[bytes, bytes], entry_id: str) -> None:
        await setup.redis.hincrby(effects_key, fields[b"message_id"].decode(), 1)

    setup.start(handler, "c2")
    await until(lambda: _zero(setup.pending()), what="the takeover's ack")
    assert await setup.redis.hget(effects_key, "m1") == b"1"


async def _zero(pending: Any) -> bool:
    return int(await pending) == 0


async def test_the_records_database_unavailable_runs_nothing_and_says_so(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    effects = Effects()
    nowhere = SqlRecords(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/none")
    with caplog.at_level(logging.WARNING, "goblin_idem.consumers"):
        setup.start(effects, records=nowhere)
        await setup.group_ready()
        await setup.publish("m1")
        await until(
            lambda: any("records' database" in r.getMessage() for r in caplog.records),
            what="the log line naming the database",
        )
    await setup.close()
    setup.consumers.clear()
    setup.tasks.clear()
    await nowhere.aclose()
    assert not effects.runs and await setup.pending() == 1


async def test_every_delivery_is_told_to_on_event_with_its_key_hash(setup: Setup) -> None:
    events: list[tuple[str, str]] = []
    effects = Effects()
    setup.start(effects, on_event=lambda event, key_hash: events.append((event, key_hash)))
    await setup.group_ready()
    await setup.publish("m1")
    await until(lambda: len(events) == 1, what="the first delivery's event")
    await setup.publish("m1")
    await setup.publish(None, body="no id")
    await until(lambda: len(events) == 3, what="three events")
    (claimed, first), (replayed, again), (missing, none) = events
    assert (claimed, replayed, missing) == ("claimed", "replayed", "missing_key")
    assert first == again and len(first) == 32 and none == ""


async def test_sigterm_lets_the_running_handler_finish_and_ack(setup: Setup) -> None:
    effects_key = f"{setup.stream}:effects"
    child = spawn(
        [
            "-m",
            "tests.consumers.stream_worker",
            setup.server.url,
            setup.stream,
            effects_key,
            "slow",
        ],
        {},
    )
    try:
        await setup.group_ready()
        await setup.publish("m1")

        async def started() -> bool:
            return await setup.redis.llen(f"{effects_key}:started") == 1

        await until(started, what="the handler started")
        child.send_signal(signal.SIGTERM)
        await setup.publish("m2")  # after the SIGTERM: left for another consumer
        await setup.redis.rpush(f"{effects_key}:release", "go")

        def exited() -> bool:
            return child.poll() is not None

        await until(exited, what="the worker's exit after its handler finished")
        assert child.returncode == 0
    finally:
        stop(child)
    assert await setup.redis.hgetall(effects_key) == {b"m1": b"1"}
    info = await setup.redis.xinfo_groups(setup.stream)
    assert info[0]["pending"] == 0 and info[0]["lag"] == 1  # m1 acked, m2 never read
