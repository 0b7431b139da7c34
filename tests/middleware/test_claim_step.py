"""The middleware's opening step, `claim_unless_done`: a stored result wins over a won
claim, so a claim lost while its result survives never runs the work again; and retaking a
lapsed claim at publish is retried and logged as what happened."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from redis.exceptions import ResponseError
from starlette.types import Receive, Scope, Send

from goblin_idem import CLAIMED, IdempotencyMiddleware, RedisStore, Store
from goblin_idem._keys import key_names
from goblin_idem.store._server_errors import WRONGTYPE
from tests.support.backends import Backend
from tests.support.inproc import CountingApp, send_once
from tests.support.servers import Server


async def test_a_lost_claim_whose_result_survives_replays_instead_of_running(
    backend: Backend,
) -> None:
    """The claim key vanished (evicted, lost in a restart) while the result stayed: the
    next duplicate gets the stored response and takes the claim back for the result's TTL."""
    handler = CountingApp()
    mw = IdempotencyMiddleware(handler, store=backend.store, ttl_seconds=600)
    first = await send_once(mw, "lost")
    assert first.status == 201 and not first.replayed
    names = key_names(b"idem", b"", b"lost")
    assert await backend.store.delete(names.claim) == 1

    again = await send_once(mw, "lost")
    assert again.status == 201 and again.replayed and again.body == first.body
    assert len(handler.runs["lost"]) == 1
    assert mw.counters.claimed == 1 and mw.counters.replayed == 1
    started = time.monotonic()
    result_ttl = await backend.store.pttl(names.result)
    claim_ttl = await backend.store.pttl(names.claim)
    between_ms = (time.monotonic() - started) * 1000  # a loaded machine reads slowly
    assert 590_000 < result_ttl <= 600_000  # the claim retaken for the result's TTL:
    assert result_ttl - 10 - between_ms <= claim_ttl <= 600_000  # (PTTL rounds to the ms)
    third = await send_once(mw, "lost")  # answered by the claim alone again
    assert third.replayed and len(handler.runs["lost"]) == 1


async def test_the_claim_step_replies(store: Store) -> None:
    assert await store.claim_unless_done("{a}:c", "{a}:r", "t1", 30) is CLAIMED
    assert await store.claim_unless_done("{a}:c", "{a}:r", "t2", 30) is None  # in flight
    assert await store.publish("{a}:r", b"done", 60_000, "{a}:c", "t1") == 1
    assert await store.claim_unless_done("{a}:c", "{a}:r", "t2", 30) == b"done"
    assert await store.get("{a}:c") == b"t1"  # a duplicate changes nothing

    # The claim is gone, the result is not: the result wins, the claim is this caller's
    # again for as long as the result lives.
    await store.delete("{a}:c")
    assert await store.claim_unless_done("{a}:c", "{a}:r", "t3", 30) == b"done"
    assert await store.get("{a}:c") == b"t3"
    assert 59_000 < await store.pttl("{a}:c") <= 60_000

    # A result that outlives the lease by less: the claim keeps a lease at least.
    await store.set("{b}:r", b"soon", px=2000)
    assert await store.claim_unless_done("{b}:c", "{b}:r", "t", 30) == b"soon"
    assert 29_000 < await store.pttl("{b}:c") <= 30_000


async def test_the_claim_step_on_a_result_of_another_type(backend: Backend) -> None:
    await backend.make_hash("{h}:r")
    with pytest.raises(ResponseError) as info:
        await backend.store.claim_unless_done("{h}:c", "{h}:r", "t", 30)
    assert str(info.value) == WRONGTYPE


async def test_retaking_a_lapsed_claim_after_a_restart_is_retried(
    own_redis: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart while the handler runs loses the claim and breaks the pooled connections.
    Publishing reconnects and finds the claim gone; taking it back must not fail on a
    stale pooled connection, nor report "another run" when it was an error."""
    store = RedisStore.from_url(own_redis.url)
    restarts = 0
    tokens: list[bytes] = []

    async def restarting(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal restarts
        await receive()
        names = key_names(b"idem", b"", b"r1")
        tokens.append(await store.get(names.claim) or b"")
        restarts += 1
        await asyncio.to_thread(own_redis.restart)  # no persistence: every key is gone
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    mw = IdempotencyMiddleware(restarting, store=store, ttl_seconds=600)
    try:
        await store.detect()
        with caplog.at_level(logging.WARNING, logger="goblin_idem"):
            reply = await send_once(mw, "r1")
        assert reply.status == 201 and restarts == 1
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("goblin_idem")]
        assert any("retaken for the result's TTL" in line for line in lines), lines
        assert not any("another run" in line for line in lines), lines
        names = key_names(b"idem", b"", b"r1")
        assert await store.get(names.claim) == tokens[0]  # the run's own token, retaken
        assert 590_000 < await store.pttl(names.claim) <= 600_000
        assert mw.counters.lease_lost == 1 and mw.counters.publish_errors == 0
        assert (await send_once(mw, "r1")).replayed
    finally:
        await store.aclose()


async def test_a_claim_really_taken_by_another_run_is_reported_as_such(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lease lapsed and another request took the key meanwhile: the log names the
    other run's token, not an error."""
    from goblin_idem import MemoryStore

    store = MemoryStore()
    names = key_names(b"idem", b"", b"k")

    async def blocking(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        time.sleep(1.2)  # noqa: ASYNC251 - blocks the loop past the lease: no renewal
        await store.set(names.claim, b"999:other", px=60_000)  # the lapsed claim, taken
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    mw = IdempotencyMiddleware(blocking, store=store, lease_seconds=1)
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        assert (await send_once(mw, "k")).status == 201
    lines = [r.getMessage() for r in caplog.records if r.name == "goblin_idem.middleware"]
    assert any("another run (token 999:other) holds it now" in line for line in lines), lines
    assert await store.get(names.claim) == b"999:other"
