"""One uvicorn server of apps/webhook_app.py per configuration and module: on Redis alone,
and on Redis with SQL records on PostgreSQL (each run's delivery row committed with its
record). Tests keep apart by their delivery ids and refs."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from goblin_idem.sql import SqlRecords
from tests.support.apps.webhook_app import deliveries_table
from tests.support.postgres import Postgres
from tests.support.procs import spawn, stop, uvicorn_args, wait_http
from tests.support.servers import Server, free_port
from tests.support.sql import create_tables

APP = "tests.support.apps.webhook_app:app"
CONFIGS = ("redis", "redis+postgresql")


@dataclass
class Receiver:
    """A running receiver: its URL and the Redis server its middleware claims on."""

    url: str
    redis: Server
    log: Path

    def stored_keys(self) -> list[bytes]:
        client = redis.Redis(port=self.redis.port)
        try:
            return sorted(client.keys("idem:*"))
        finally:
            client.close()


async def _create_tables(url: str, records: str, deliveries: str) -> None:
    made = SqlRecords(url, table=records)
    try:
        await create_tables(made, deliveries_table(deliveries))
    finally:
        await made.aclose()


@contextlib.contextmanager
def running_receiver(
    tmp: Path, redis_server: Server, postgres: Postgres | None, app: str = APP
) -> Iterator[Receiver]:
    """`app` under uvicorn on a free port, its output in a file (a refusal is logged: a pipe
    nobody reads would fill up and stall the server); stopped by its PID at the end."""
    env = {"REDIS_URL": redis_server.url}
    if postgres is not None:
        url = postgres.url(postgres.new_database(), "asyncpg")
        suffix = secrets.token_hex(4)
        env |= {
            "DATABASE_URL": url,
            "RECORDS_TABLE": f"records_{suffix}",
            "DELIVERIES_TABLE": f"deliveries_{suffix}",
        }
        asyncio.run(_create_tables(url, env["RECORDS_TABLE"], env["DELIVERIES_TABLE"]))
    port = free_port()
    log = tmp / "server.log"
    with log.open("wb") as out:
        proc = spawn([*uvicorn_args(app, port), "--no-access-log"], env, stderr=out)
        try:
            wait_http(proc, port, name="uvicorn", output=log.read_text)
            yield Receiver(f"http://127.0.0.1:{port}", redis_server, log)
        finally:
            stop(proc)


@pytest.fixture(scope="module", params=CONFIGS)
def receiver(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: Server,
) -> Iterator[Receiver]:
    postgres = request.getfixturevalue("postgres") if request.param != "redis" else None
    with running_receiver(tmp_path_factory.mktemp("receiver"), redis_server, postgres) as found:
        yield found
