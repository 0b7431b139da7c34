"""The middleware's closing store steps (publish, release): inline, with no task per
request, and never cut short by a cancellation (a cancelled step starts again in a task)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from goblin_idem import IdempotencyMiddleware, MemoryStore
from goblin_idem.keys import key_names
from goblin_idem.record import decode
from tests.support.asgi import request


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})


class SlowPublish(MemoryStore):
    """A store whose publish and CAD wait first, as a network store's do, and whose publish
    may then fail."""

    def __init__(self, delay: float | None, failures: int = 0) -> None:
        super().__init__()
        self.delay = delay
        self.failures = failures
        self.calls = 0
        self.cads = 0

    async def cad(self, key: Any, expected: Any) -> int:
        self.cads += 1
        if self.delay is not None:
            await asyncio.sleep(self.delay)
        return await super().cad(key, expected)

    async def publish(
        self, result_key: Any, value: bytes, ttl_ms: int, claim_key: Any, token: Any
    ) -> int:
        self.calls += 1
        if self.delay is not None:
            await asyncio.sleep(self.delay)
        if self.failures:
            self.failures -= 1
            raise RedisConnectionError("store went away")
        return await super().publish(result_key, value, ttl_ms, claim_key, token)


class RecordingTasks:
    """A task factory that notes the coroutine of every task created on the loop."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any] | Generator[Any, Any, Any],
    ) -> asyncio.Task[Any]:
        self.names.append(getattr(coro, "__qualname__", type(coro).__name__))
        return asyncio.Task(coro, loop=loop)  # type: ignore[arg-type]


@pytest.mark.parametrize("store_kind", ["in process", "waits"])
async def test_a_first_run_publishes_without_a_task(store_kind: str) -> None:
    loop = asyncio.get_running_loop()
    tasks = RecordingTasks()
    loop.set_task_factory(tasks)
    try:
        store = MemoryStore() if store_kind == "in process" else SlowPublish(delay=0.01)
        mw = IdempotencyMiddleware(app, store=store)
        for key in ("k1", "k2", "k3"):
            assert (await request(mw, key=key)).status == 201
            assert (await request(mw, key=key)).header("idempotent-replayed") == b"true"
    finally:
        loop.set_task_factory(None)
    assert set(tasks.names) == {"_Renewals.run"}  # the watchdog's loop, nothing per request


async def test_a_publish_that_waits_outlives_the_cancelled_request() -> None:
    store = SlowPublish(delay=0.2)
    mw = IdempotencyMiddleware(app, store=store)
    task = asyncio.create_task(request(mw, key="k"))
    await asyncio.sleep(0.05)  # the app has answered; the publish is waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)
    stored = await store.get(key_names(b"idem", b"", b"k").result)
    assert stored is not None and decode(stored).body == b"done"
    replay = await request(mw, key="k")
    assert replay.body == b"done" and replay.header("idempotent-replayed") == b"true"


async def test_a_release_that_waits_outlives_the_cancelled_request() -> None:
    store = SlowPublish(delay=0.2)
    started = asyncio.Event()

    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        if not started.is_set():
            started.set()
            await asyncio.sleep(10)
        await app(scope, receive, send)

    mw = IdempotencyMiddleware(slow_app, store=store)
    task = asyncio.create_task(request(mw, key="k"))
    await started.wait()
    task.cancel()  # the run is cut short: its claim must be freed all the same
    await asyncio.sleep(0.05)  # the release (CAD) is waiting ...
    task.cancel()  # ... and a second cancellation must not cut it short either
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)
    assert await store.get(key_names(b"idem", b"", b"k").claim) is None
    assert mw.counters.released == 1 and store.cads == 2  # started again, counted once
    assert (await request(mw, key="k")).status == 201  # the key is free: a retry runs


async def test_a_publish_that_fails_after_waiting_is_retried_then_counted() -> None:
    store = SlowPublish(delay=0.01, failures=3)
    mw = IdempotencyMiddleware(app, store=store)
    reply = await request(mw, key="k")
    assert reply.status == 201 and reply.body == b"done"  # the client still gets its answer
    assert store.calls == 3 and mw.counters.publish_errors == 1  # tried, paused, tried twice


async def test_a_publish_that_fails_twice_succeeds_on_the_third_try() -> None:
    store = SlowPublish(delay=0.01, failures=2)
    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k")).status == 201
    assert store.calls == 3 and mw.counters.publish_errors == 0
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"


@pytest.mark.parametrize("delay", [None, 0])  # fails before its first wait / after a bare yield
async def test_a_publish_that_fails_once_is_retried(delay: float | None) -> None:
    store = SlowPublish(delay=delay, failures=1)
    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k")).status == 201
    assert store.calls == 2 and mw.counters.publish_errors == 0
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"
