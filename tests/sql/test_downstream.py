"""Exactly-once across a hop: service A's handler charges a card at service B through the
client transport (tests/support/apps/downstream_app.py), both under uvicorn with the
middleware on one redis-server and SQL records in a PostgreSQL database each.

A's run is made to run twice — its claim deleted mid-run, its worker SIGSTOPped past its
lease, its first run failing after B answered — and the second run sends B the key the
first one sent (derived from A's claim): B's handler runs once, A's second run gets B's
replayed answer, and each database holds one effect. Then the same with `once` on a plain
function calling B: called here (a deleted claim, a failed first run) and as a Celery task
whose worker is killed after B answered."""

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
from celery import Celery
from sqlalchemy import create_engine, select

from goblin_idem import RedisStore
from goblin_idem._keys import key_names
from goblin_idem._threads._loop import loop_thread
from goblin_idem.sql import SyncSqlRecords
from tests.support.apps.downstream_app import effects_table
from tests.support.apps.downstream_worker import NAME, make_pay
from tests.support.postgres import Postgres
from tests.support.procs import spawn, start_uvicorn, stop
from tests.support.servers import Server, free_port
from tests.support.sql import create_tables_sync

APP = "tests.support.apps.downstream_app:app"
WORKER = "tests.support.apps.downstream_worker"
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
    records = SyncSqlRecords(url, table="records")
    create_tables_sync(records, effects_table("effects"))
    records.close()
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
    port = s.a.start()
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
    port = s.a.start()
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
    port = s.a.start()
    failed = order(port, key, ref, "raise")
    assert failed.status_code == 500
    assert s.a.effects(ref) == []  # rolled back with the run
    second = order(port, key, ref, "raise")  # the client's retry: the key was released
    assert_one_effect_each_side(s, ref, second)
    again = order(port, key, ref, "raise")  # and a third request is A's stored answer
    assert again.json() == second.json() and again.headers["idempotent-replayed"] == "true"


# -- `once` on a plain function calling B (tests/support/apps/downstream_worker.py) --


def once_claim(ref: str) -> bytes:
    return key_names(b"once", NAME.encode(), ref.encode()).claim


def assert_b_charged_once(s: Services, ref: str, value: dict[str, Any]) -> None:
    assert value["run"] == 2 and value["replayed"] is True, value
    assert s.b_runs(ref) == 1
    assert s.b.effects(ref) == [value["charge"]]
    first_answer = s.control.get(f"answered:{ref}:1")
    assert first_answer is not None and first_answer.decode() == value["charge"]


@pytest.fixture
def pay(services: Services, redis_server: Server) -> Iterator[Callable[..., Any]]:
    store = RedisStore.from_url(redis_server.url)
    yield make_pay(store, services.a.env["B_URL"], services.control)
    loop_thread().run(store.aclose())  # where the sync `once` used it


def test_a_once_run_whose_claim_was_deleted_charges_once(
    services: Services, pay: Callable[..., Any]
) -> None:
    s = services
    ref = f"event-{secrets.token_hex(6)}"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(pay, ref, "hold")
        s.until(lambda: s.control.get(f"answered:{ref}:1"), "B's answer to the first run")
        assert s.control.delete(once_claim(ref)) == 1
        second = pay(ref, "hold")
        s.control.rpush(f"go:{ref}", 1)
        late = first.result(timeout=60)
    # The first run returns its own value (the second's stands in the store): B's one charge.
    assert late == {"charge": second["charge"], "replayed": False, "run": 1}
    assert_b_charged_once(s, ref, second)
    assert pay(ref, "hold") == second  # the second run's value, stored


def test_a_once_run_that_failed_after_b_answered_charges_once(
    services: Services, pay: Callable[..., Any]
) -> None:
    s = services
    ref = f"event-{secrets.token_hex(6)}"
    with pytest.raises(RuntimeError, match="after the card was charged"):
        pay(ref, "raise")
    assert_b_charged_once(s, ref, pay(ref, "raise"))  # the task's retry


def celery_worker(services: Services, redis_url: str) -> subprocess.Popen[bytes]:
    args = ["-m", "celery", "-A", WORKER, "worker", "--pool", "threads", "--concurrency", "1"]
    args += ["--without-heartbeat", "--without-gossip", "--without-mingle"]
    args += ["--loglevel", "warning", "--hostname", f"w{time.monotonic_ns()}@%h"]
    return spawn(args, {"REDIS_URL": redis_url, "B_URL": services.a.env["B_URL"]})


def test_a_celery_task_redelivered_after_b_answered_charges_once(
    services: Services, redis_server: Server
) -> None:
    s = services
    ref = f"event-{secrets.token_hex(6)}"
    client = Celery("client", broker=redis_server.url, backend=redis_server.url)
    first = celery_worker(s, redis_server.url)
    try:
        result = client.send_task("pay", args=[ref, "hold"])
        s.until(lambda: s.control.get(f"answered:{ref}:1"), "B's answer to the first run", 30)
        first.send_signal(signal.SIGKILL)  # charged at B, nothing stored, not acknowledged
        first.wait(10)
    finally:
        stop(first)
    second = celery_worker(s, redis_server.url)
    try:
        value = result.get(timeout=60)  # redelivered; run again once the lease ran out
    finally:
        stop(second)
        client.close()
    assert_b_charged_once(s, ref, value)
