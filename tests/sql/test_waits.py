"""A claim won after waiting (`wait_seconds`) asks the database again: the run that held the
claim may have committed while this one waited, and died before it published."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import delete, insert, select

from goblin_idem import once
from goblin_idem.sql import connection
from tests.sql.conftest import Setup
from tests.sql.test_middleware import pay, replayed
from tests.support.apps.sql_app import build


async def committed_by_a_dead_run(setup: Setup, put_back: Callable[[], Awaitable[Any]]) -> Any:
    """Take the key's row out, flush the store and hold the claim as a run that died would:
    returns the task that puts the row back (its commit) once the waiter is polling."""
    t = setup.records.table
    async with setup.engine.begin() as conn:
        (row,) = (await conn.execute(select(t))).mappings().all()
        row = dict(row)
        await conn.execute(delete(t))
    client = setup.store.client
    (claim,) = await client.keys("*:c")  # type: ignore[union-attr]
    await client.flushall()  # type: ignore[union-attr]
    await client.set(claim, b"dead-run", px=800)  # type: ignore[union-attr]

    async def commit_later() -> None:
        await asyncio.sleep(0.2)  # the waiter's first lookup has answered: no row yet
        async with setup.engine.begin() as conn:
            await conn.execute(insert(t).values(row))
        await put_back()

    return asyncio.ensure_future(commit_later())


async def nothing() -> None:
    return None


async def test_the_middleware_asks_again_after_a_wait(setup: Setup) -> None:
    runs: list[str] = []

    async def counted(ref: str) -> None:
        runs.append(ref)

    held: list[int] = []  # connections checked out while the duplicate waits

    async def during_the_wait() -> None:
        held.append(setup.engine.pool.checkedout())  # type: ignore[attr-defined]

    app = build(setup.store, setup.records, setup.payments, gate=counted, wait_seconds=5)
    first = await pay(app, "k1", "w", "gate")
    later = await committed_by_a_dead_run(setup, during_the_wait)
    again = await pay(app, "k1", "w", "gate")
    await later
    assert replayed(again) and again.body == first.body
    assert runs == ["w"]  # the handler did not run again
    assert held == [0]  # the lookup made alongside the claim step kept none through the wait
    assert await setup.payment_count("w") == 1


async def test_once_asks_again_after_a_wait(setup: Setup) -> None:
    runs = 0

    @once(setup.store, key=lambda ref: ref, records=setup.records, wait_seconds=5)
    async def charge(ref: str) -> int:
        nonlocal runs
        runs += 1
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref=ref, amount=runs))
        return runs

    assert await charge("w") == 1
    later = await committed_by_a_dead_run(setup, nothing)
    assert await charge("w") == 1
    await later
    assert runs == 1
