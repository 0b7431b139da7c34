"""The records' database unavailable, under uvicorn on PostgreSQL: its pool exhausted, and
the server stopped. Each is a 503 ``database-unavailable`` with Retry-After, counted as
``database_errors`` and logged as the database's, never as the store's, never a plain 500,
and never a reason for ``fail_open`` to run the request unprotected."""

from __future__ import annotations

import http.client
import json
import secrets
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sql.test_crash import post
from tests.support.apps.sql_app import create_tables
from tests.support.postgres import Postgres, start_postgres
from tests.support.procs import output_of, spawn, uvicorn_args, wait_http
from tests.support.servers import Server, free_port

APP = "tests.support.apps.sql_app:app"
NEW_KEYS = 40


def prepare(url: str) -> dict[str, str]:
    """The tables of a fresh app in the database at `url`; the app's environment."""
    suffix = secrets.token_hex(4)
    records, payments = f"records_{suffix}", f"payments_{suffix}"
    create_tables(url, records, payments)
    return {
        "DATABASE_URL": url,
        "RECORDS_TABLE": records,
        "PAYMENTS_TABLE": payments,
    }


def serve(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    return wait_http(spawn(uvicorn_args(APP, port, "info"), env), port, name="uvicorn"), port


def stats(port: int) -> dict[str, int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/stats")
        counters: dict[str, int] = json.loads(conn.getresponse().read())
        return counters
    finally:
        conn.close()


def problem_type(body: bytes) -> str:
    kind: str = json.loads(body)["type"]
    return kind.rsplit(":", 1)[1]


def test_an_exhausted_pool_answers_503_database_unavailable(
    postgres: Postgres, redis_server: Server
) -> None:
    """pool_size=2, no overflow, 0.2 s to wait for a connection; 40 new keys at once, each
    run holding its connection 300 ms: the runs that get no connection (at the lookup, or
    at connection()) are refused as the database's, never as a 500 or the store's."""
    env = prepare(postgres.url(postgres.new_database()))
    env.update(REDIS_URL=redis_server.url, POOL_SIZE="2", POOL_TIMEOUT="0.2")
    proc, port = serve(env)
    try:
        body = {"mode": "hold", "hold_ms": 300}
        with ThreadPoolExecutor(NEW_KEYS) as pool:
            replies = list(
                pool.map(
                    lambda i: post(port, f"pool-{i}", f"p{i}", body),
                    range(NEW_KEYS),
                )
            )
        counters = stats(port)
    finally:
        log = output_of(proc)
    statuses = sorted(status for status, _, _ in replies)
    refused = [(h, b) for status, h, b in replies if status == 503]
    assert set(statuses) == {201, 503}, statuses
    for headers, reply in refused:
        assert problem_type(reply) == "database-unavailable", reply
        assert headers["retry-after"] == "1"
    assert counters["database_errors"] == len(refused)
    assert counters["store_errors"] == 0 and counters["unprotected"] == 0
    assert "unexpected error from the store" not in log and "store error" not in log
    assert "the database is unavailable" in log


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_a_stopped_database_answers_503_and_runs_nothing(
    redis_server: Server, fail_open: bool
) -> None:
    postgres = start_postgres()
    try:
        env = prepare(postgres.url())
        env.update(REDIS_URL=redis_server.url, FAIL_OPEN="1" if fail_open else "0")
        proc, port = serve(env)
        try:
            key = f"stopped-{secrets.token_hex(4)}"
            postgres.stop(fast=True)
            status, headers, reply = post(port, key, "s")
            counters = stats(port)
            postgres.start()
            # The key was freed, and the connection the stop broke was not pooled again:
            # the retry runs.
            again, _, _ = post(port, key, "s")
        finally:
            log = output_of(proc)
    finally:
        postgres.remove()
    assert status == 503 and problem_type(reply) == "database-unavailable", reply
    assert headers["retry-after"] == "1"
    assert counters["database_errors"] == 1 and counters["store_errors"] == 0
    assert counters["unprotected"] == 0 and counters["claimed"] == 0
    assert again == 201
    assert "store error" not in log and "unexpected error from the store" not in log
