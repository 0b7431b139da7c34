"""A worker SIGKILLed between its commit and its publish: the database has the record, the
store only the claim. After the lease, the next request replays the record; nothing runs
twice."""

from __future__ import annotations

import asyncio
import http.client
import json
import secrets
import time

import pytest
from sqlalchemy import func, select

from goblin_idem.sql import SqlRecords
from tests.support.apps.sql_app import payments_table
from tests.support.postgres import Postgres
from tests.support.procs import start_uvicorn, stop
from tests.support.servers import Server, free_port
from tests.support.sql import create_tables

APP = "tests.support.apps.sql_app:app"


def post(
    port: int, key: str, ref: str, extra: dict[str, object] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST /payments of `ref` (amount 7, and `extra`'s fields) with `key`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/payments",
            body=json.dumps({"ref": ref, "amount": 7, **(extra or {})}),
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


async def test_killed_after_commit_replays_once_after_the_lease(
    postgres: Postgres, database: str, redis_server: Server
) -> None:
    url = postgres.url(database)
    records = SqlRecords(url)
    payments = payments_table("payments")
    await create_tables(records, payments)
    env = {
        "DATABASE_URL": url,
        "REDIS_URL": redis_server.url,
        "RECORDS_TABLE": records.table.name,
        "PAYMENTS_TABLE": "payments",
        "LEASE_SECONDS": "1",
    }
    key = f"crash-{secrets.token_hex(4)}"
    port = free_port()
    dying = start_uvicorn(
        port, {**env, "KILL_AFTER_COMMIT": "1"}, app="tests.support.apps.sql_app:app"
    )
    try:
        with pytest.raises((http.client.HTTPException, OSError)):
            post(port, key, "c1")  # the worker dies after its commit: no response
        assert dying.wait(timeout=10) != 0
    finally:
        stop(dying)

    async def count() -> int:
        async with records.engine.connect() as conn:
            return int(
                (await conn.execute(select(func.count()).select_from(payments))).scalar_one()
            )

    assert await count() == 1
    port = free_port()
    serving = start_uvicorn(port, env, app=APP)
    try:
        deadline = time.monotonic() + 20
        status, headers, body = post(port, key, "c1")
        while status == 409 and time.monotonic() < deadline:  # until the dead run's lease ends
            await asyncio.sleep(0.1)
            status, headers, body = post(port, key, "c1")
        assert status == 201 and headers.get("idempotent-replayed") == "true"
        assert json.loads(body)["ref"] == "c1"
        again = post(port, key, "c1")
        assert again[0] == 201 and again[2] == body
    finally:
        stop(serving)
    assert await count() == 1
    await records.aclose()
