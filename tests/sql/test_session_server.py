"""The session dependency under uvicorn, on PostgreSQL: a request without a key commits
through it; a keyed run replays from the database once the store lost it; a route that
commits through a session of its own is named in the server's log."""

from __future__ import annotations

import http.client
import secrets

from redis import Redis
from sqlalchemy import func, select

from goblin_idem.sql import SqlRecords
from tests.support.apps.sql_app import payments_table
from tests.support.postgres import Postgres
from tests.support.procs import output_of, start_uvicorn
from tests.support.servers import Server, free_port
from tests.support.sql import create_tables

APP = "tests.support.apps.sql_app:app"


def post(port: int, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, headers={"Idempotency-Key": key} if key else {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


async def test_the_session_dependency_under_uvicorn(
    postgres: Postgres, database: str, redis_server: Server
) -> None:
    url = postgres.url(database)
    records = SqlRecords(url)
    payments = payments_table("payments")
    await create_tables(records, payments)

    async def count(ref: str) -> int:
        query = select(func.count()).select_from(payments).where(payments.c.ref == ref)
        async with records.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    env = {
        "DATABASE_URL": url,
        "REDIS_URL": redis_server.url,
        "RECORDS_TABLE": records.table.name,
        "PAYMENTS_TABLE": "payments",
    }
    port = free_port()
    server = start_uvicorn(port, env, app=APP)
    try:
        assert post(port, "/orders?ref=nokey")[0] == 201
        key = f"order-{secrets.token_hex(4)}"
        status, _, body = post(port, "/orders?ref=keyed", key)
        assert status == 201
        Redis.from_url(redis_server.url).flushall()
        status, headers, again = post(port, "/orders?ref=keyed", key)
        assert status == 201 and headers.get("idempotent-replayed") == "true" and again == body
        for n in range(2):
            assert post(port, f"/own-session?ref=own{n}", f"own-{key}-{n}")[0] == 201
    finally:
        log = output_of(server)
    assert await count("nokey") == 1 and await count("keyed") == 1
    told = [line for line in log.splitlines() if "a commit on the records' database" in line]
    assert len(told) == 1, log
    assert "WARNING" in told[0] and "POST /own-session:" in told[0]
    await records.aclose()
