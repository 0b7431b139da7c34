"""The middleware's closing store steps (publish, release): inline, with no task per
request, never cut short by a cancellation (a cancelled step starts again in a task), and a
failed publish retried while the claim holds, unless the server refused it for good; a
retry that meets its own landed attempt is no other run's result."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Coroutine, Generator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore, _closing
from goblin_idem._closing import publish_retried
from goblin_idem._keys import key_names
from goblin_idem._lease import Lease
from goblin_idem.records._format import decode
from goblin_idem.store import Published
from tests.support.asgi import request
from tests.support.proxy import Proxy
from tests.support.servers import Server, free_port
from tests.support.waits import until


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})


class SlowPublish(MemoryStore):
    """A store whose publish and CAD wait first, as a network store's do, and whose publish
    may then fail."""

    def __init__(
        self, delay: float | None, failures: int = 0, error: Exception | None = None
    ) -> None:
        super().__init__()
        self.delay = delay
        self.failures = failures
        self.error = error or RedisConnectionError("store went away")
        self.calls = 0
        self.cads = 0
        self.held: list[bool] = []  # at each attempt: did the claim still hold the token?

    async def cad(self, key: Any, expected: Any) -> int:
        self.cads += 1
        if self.delay is not None:
            await asyncio.sleep(self.delay)
        return await super().cad(key, expected)

    async def publish(
        self, result_key: Any, value: bytes, ttl_ms: int, claim_key: Any, token: Any
    ) -> Published:
        self.calls += 1
        self.held.append(await self.get(claim_key) == token)
        if self.delay is not None:
            await asyncio.sleep(self.delay)
        if self.failures:
            self.failures -= 1
            raise self.error
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
    await until(lambda: store.calls == 1, what="the app answered; the publish is waiting")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def published() -> bool:
        return await store.get(key_names(b"idem", b"", b"k").result) is not None

    await until(published, what="the publish landed")
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
    await until(lambda: store.cads == 1, what="the release (CAD) is waiting ...")
    task.cancel()  # ... and a second cancellation must not cut it short either
    with pytest.raises(asyncio.CancelledError):
        await task

    async def freed() -> bool:
        return await store.get(key_names(b"idem", b"", b"k").claim) is None

    await until(freed, what="the release deleted the claim")
    assert await store.get(key_names(b"idem", b"", b"k").claim) is None
    assert mw.counters.released == 1 and store.cads == 2  # started again, counted once
    assert (await request(mw, key="k")).status == 201  # the key is free: a retry runs


async def test_a_publish_that_keeps_failing_is_retried_while_the_claim_holds() -> None:
    """Retried until a third of the lease before the claim would expire, then counted: never
    after the claim has lapsed, when a duplicate could have run meanwhile."""
    store = SlowPublish(delay=0.01, failures=1_000)
    mw = IdempotencyMiddleware(app, store=store, lease_seconds=1)
    reply = await request(mw, key="k")
    assert reply.status == 201 and reply.body == b"done"  # the client still gets its answer
    assert mw.counters.publish_errors == 1
    assert store.calls > 3 and all(store.held), store.held


@pytest.mark.parametrize(
    "error",
    [ResponseError("WRONGTYPE ..."), OutOfMemoryError("OOM ..."), NoPermissionError("NOPERM")],
)
async def test_a_publish_the_server_refuses_is_not_retried(error: Exception) -> None:
    store = SlowPublish(delay=None, failures=1_000, error=error)
    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k")).status == 201
    assert store.calls == 1 and mw.counters.publish_errors == 1


@pytest.mark.parametrize("error", [TryAgainError("TRYAGAIN ..."), ReadOnlyError("READONLY")])
async def test_a_publish_refused_for_now_is_retried(error: Exception) -> None:
    store = SlowPublish(delay=None, failures=3, error=error)
    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k")).status == 201
    assert store.calls == 4 and mw.counters.publish_errors == 0
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"


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


@pytest.mark.parametrize("mode", ["script", "native"])
@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
async def test_a_publish_whose_reply_was_lost_meets_its_own_result(
    redis_native_server: Server, mode: str, autopipeline: bool
) -> None:
    """The publish ran on the server but its reply never came back: the retry's SET NX
    finds a result, which is this run's own (not another run's, not superseded)."""
    with Proxy(redis_native_server.port) as proxy:
        store = RedisStore.from_url(proxy.url, mode=mode, autopipeline=autopipeline)  # type: ignore[arg-type]

        async def losing_the_next_reply(scope: Any, receive: Any, send: Any) -> None:
            proxy.drop_responses(1)  # the publish's
            await app(scope, receive, send)

        mw = IdempotencyMiddleware(losing_the_next_reply, store=store, ttl_seconds=600)
        key = f"lost-reply-{secrets.token_hex(4)}"
        try:
            await store.detect()
            assert (await request(mw, key=key)).status == 201
            assert proxy.stats.dropped_responses == 1
            counters = mw.counters
            assert (counters.superseded, counters.lease_lost, counters.publish_errors) == (0, 0, 0)
            names = key_names(b"idem", b"", key.encode())
            assert 590_000 < await store.pttl(names.claim) <= 600_000  # this run's, published
            replay = await request(mw, key=key)
            assert replay.header("idempotent-replayed") == b"true" and replay.body == b"done"
        finally:
            await store.aclose()


async def test_a_failing_publish_is_retried_until_a_third_of_the_lease_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publish that keeps failing (its server gone) is sent again after pauses doubling
    from 50 ms and capped at 200 ms, until a third of the lease before the claim would
    lapse: no attempt starts after that, and one starts within a pause of it (a blip near
    the deadline still gets its retries)."""
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", mode="script")
    lease = Lease(b"{d}:c", b"t", 3000)
    lease.renewed_at = time.monotonic()
    deadline = lease.renewed_at + 2.0
    attempts: list[float] = []
    pauses: list[float] = []
    publish = store.publish

    async def timed(*args: Any) -> Published:
        attempts.append(time.monotonic())
        return await publish(*args)

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        await real_sleep(seconds)

    real_sleep = asyncio.sleep
    monkeypatch.setattr(store, "publish", timed)
    monkeypatch.setattr(_closing.asyncio, "sleep", pause)
    names = key_names(b"idem", b"", b"deadline")
    try:
        with pytest.raises(RedisConnectionError):
            await publish_retried(store, names, b"v", 60_000, lease)
    finally:
        monkeypatch.undo()
        await store.aclose()
    assert pauses[:4] == [0.05, 0.1, 0.2, 0.2] and max(pauses) == 0.2, pauses
    assert all(at < deadline for at in attempts), [at - lease.renewed_at for at in attempts]
    assert attempts[-1] > deadline - 0.3, [at - lease.renewed_at for at in attempts]
