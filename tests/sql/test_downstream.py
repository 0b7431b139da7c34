"""Exactly-once across a hop: service A's handler charges a card at service B through the
client transport (tests/support/apps/downstream_app.py), both under uvicorn with the
middleware on one redis-server and SQL records in a PostgreSQL database each.

A's run is made to run twice — its claim deleted mid-run, its worker SIGSTOPped past its
lease, its first run failing after B answered — and the second run sends B the key the
first one sent (derived from A's claim): B's handler runs once, A's second run gets B's
replayed answer, and each database holds one effect."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import create_engine, select

from goblin_idem._keys import key_names
from goblin_idem.sql import SqlRecords
from tests.support.apps.downstream_app import effects_table
from tests.support.postgres import Postgres
from tests.support.procs import start_uvicorn, stop
from tests.support.servers import Server, free_port

APP = "tests.support.apps.downstream_app:app"
LEASE_SECONDS = 1


@dataclass
class Service:
    """One service's database and its table of effects, and its processes."""

    role: str
    url: str
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    def start(self, **env: str) -> int:
        port = free_port()
        self.procs.append(start_uvicorn(port, {**self.env, **env}, app=APP))
        self.ports.append(port)
        return port

    def effects(self, ref: str) -> list[str]:
        """The charge ids of `ref`'s rows (B: charges made; A: orders recorded)."""
        engine = create_engine(self.url)
        table = effects_table(self.env["EFFECTS_TABLE"])
        try:
            with engine.connect() as conn:
                query = select(table.c.charge).where(table.c.ref == ref)
                return [row[0] for row in conn.execute(query)]
        finally:
            engine.dispose()


@dataclass
class Services:
    a: Service
    b: Service
    control: redis.Redis

    def until(self, condition: Callable[[], Any], what: str, timeout: float = 20) -> Any:
        deadline = time.monotonic() + timeout
        while not (value := condition()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)
        return value

    def b_runs(self, ref: str) -> int:
        return int(self.control.get(f"runs:b:{ref}") or 0)


def new_service(postgres: Postgres, role: str, redis_url: str, **env: str) -> Service:
    database = postgres.new_database()
    url = postgres.url(database, "psycopg")
    engine = create_engine(url)
    effects_table("effects").metadata.create_all(engine)
    SqlRecords(postgres.url(database), table="records").table.metadata.create_all(engine)
    engine.dispose()
    env = {
        "ROLE": role,
        "REDIS_URL": redis_url,
        "DATABASE_URL": postgres.url(database),
        "RECORDS_TABLE": "records",
        "EFFECTS_TABLE": "effects",
        "LEASE_SECONDS": str(LEASE_SECONDS),
        **env,
    }
    return Service(role, url, env)


@pytest.fixture
def services(postgres: Postgres, redis_server: Server) -> Iterator[Services]:
    b = new_service(postgres, "b", redis_server.url)
    a = new_service(postgres, "a", redis_server.url)
    control = redis_server.sync_client()
    try:
        a.env["B_URL"] = f"http://127.0.0.1:{b.start()}"
        a.start()
        yield Services(a, b, control)
    finally:
        for proc in a.procs + b.procs:
            with_cont(proc.pid)
            stop(proc)
        control.close()


def with_cont(pid: int) -> None:
    """A stopped process cannot end: let it go on first."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def order(port: int, key: str, ref: str, mode: str | None = None) -> httpx.Response:
    """The client's POST /orders to A, as a client of A's API sends it (a key of its own)."""
    with httpx.Client(timeout=60) as client:
        return client.post(
            f"http://127.0.0.1:{port}/orders",
            json={"ref": ref, "mode": mode},
            headers={"Idempotency-Key": key},
        )


def run_key() -> tuple[str, str, bytes]:
    """A fresh order: its ref, A's key for it, and the name of A's claim on it."""
    key = f"order-{secrets.token_hex(6)}"
    return key, key, key_names(b"a", b"", key.encode()).claim


def assert_one_effect_each_side(s: Services, ref: str, second: httpx.Response) -> None:
    assert second.status_code == 201, second.text
    answer = second.json()
    assert answer["run"] == 2  # A's handler ran again...
    assert answer["replayed"] is True  # ...and B answered it from its record
    assert s.b_runs(ref) == 1  # B's handler ran once
    assert s.b.effects(ref) == [answer["charge"]]  # one charge in B's database
    assert s.a.effects(ref) == [answer["charge"]]  # one order in A's, with that charge
    first_answer = s.control.get(f"answered:{ref}:1")
    assert first_answer is not None and first_answer.decode() == answer["charge"]


def assert_answered_by_the_second_run(late: httpx.Response, second: httpx.Response) -> None:
    """The first run's commit met the second run's row in A's database: it rolled back
    and answers with the second run's result, as a replay."""
    assert late.status_code == 201, late.text
    assert late.json() == second.json() and late.headers["idempotent-replayed"] == "true"


def test_a_run_whose_claim_was_deleted_charges_once(services: Services) -> None:
    s = services
    key, ref, claim = run_key()
    port = s.a.ports[0]
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(order, port, key, ref, "hold")
        s.until(lambda: s.control.get(f"answered:{ref}:1"), "B's answer to the first run")
        assert s.control.delete(claim) == 1  # an operator, or a store that lost the key
        second = order(port, key, ref, "hold")
        s.control.rpush(f"go:{ref}", 1)
        late = first.result(timeout=60)
    assert_one_effect_each_side(s, ref, second)
    assert_answered_by_the_second_run(late, second)


def test_a_worker_stopped_past_its_lease_charges_once(services: Services) -> None:
    s = services
    key, ref, claim = run_key()
    port = s.a.ports[0]
    other_port = s.a.start()  # a second worker of A, which the retry reaches
    paused = s.a.procs[0].pid
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(order, port, key, ref, "hold")
        s.until(lambda: s.control.get(f"answered:{ref}:1"), "B's answer to the first run")
        os.kill(paused, signal.SIGSTOP)
        try:
            s.until(lambda: not s.control.exists(claim), "the paused run's lease to run out")
            second = order(other_port, key, ref, "hold")
        finally:
            os.kill(paused, signal.SIGCONT)
        s.control.rpush(f"go:{ref}", 1)
        late = first.result(timeout=60)
    assert_one_effect_each_side(s, ref, second)
    assert_answered_by_the_second_run(late, second)


def test_a_run_that_failed_after_b_answered_charges_once(services: Services) -> None:
    s = services
    key, ref, _ = run_key()
    port = s.a.ports[0]
    failed = order(port, key, ref, "raise")
    assert failed.status_code == 500
    assert s.a.effects(ref) == []  # rolled back with the run
    second = order(port, key, ref, "raise")  # the client's retry: the key was released
    assert_one_effect_each_side(s, ref, second)
    again = order(port, key, ref, "raise")  # and a third request is A's stored answer
    assert again.json() == second.json() and again.headers["idempotent-replayed"] == "true"
