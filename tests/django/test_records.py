"""``RECORDS: "django"`` on real servers: the records project (tests/support/apps/
django_records) under gunicorn with gthread workers, on PostgreSQL and on a SQLite file,
with Redis as the store. The views write through Django's ORM; their writes and the
record commit in one atomic block, before the response leaves."""

from __future__ import annotations

import http.client
import json
import re
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import override_settings

from goblin_idem._keys import key_names
from goblin_idem.django import IdempotencyMiddleware
from tests.support.postgres import Postgres, start_postgres
from tests.support.procs import output_of
from tests.support.proxy import Proxy
from tests.support.servers import Server, free_port
from tests.support.waits import until_sync
from tests.support.wsgi import Gunicorn, run_until_exit

SETTINGS = "tests.support.apps.django_records.settings"
APP = "tests.support.apps.django_records.wsgi:application"
PAYMENTS = "payments"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    def problem(self) -> str:
        return str(json.loads(self.body)["type"])


def post(port: int, key: str | None, ref: str, **extra: object) -> Reply:
    """POST /payments of `ref` (amount 7, and `extra`'s fields), with `key` if given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    try:
        conn.request(
            "POST",
            "/payments",
            body=json.dumps({"ref": ref, "amount": 7, **extra}),
            headers=headers,
        )
        response = conn.getresponse()
        return Reply(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    finally:
        conn.close()


@dataclass
class Site:
    """The records project on one database, its tables made; `serve` starts gunicorn."""

    env: dict[str, str]
    tmp: Path
    postgres: Postgres | None = None
    database: str = ""
    servers: list[Gunicorn] = field(default_factory=list)

    def migrate(self) -> None:
        code, said = run_until_exit(["-m", "django", "migrate", "--run-syncdb", "-v0"], self.env)
        assert code == 0, said

    def serve(self, threads: int = 4, worker_class: str = "gthread", **env: str) -> Gunicorn:
        """gunicorn, one worker; with one thread (or the sync worker), every request after
        the first meets the connection the one before left (it must be clean)."""
        server = Gunicorn(
            APP,
            free_port(),
            {**self.env, **env},
            worker_class=worker_class,
            workers=1,
            threads=threads,
        )
        self.servers.append(server)
        return server.wait_ready()

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        if self.postgres is not None:
            out = self.postgres.psql(query, self.database)
            return [tuple(line.split("|")) for line in out.splitlines()]
        with sqlite3.connect(self.database) as conn:
            return list(conn.execute(query))

    def count(self, ref: str) -> int:
        return int(self.rows(f"SELECT count(*) FROM {PAYMENTS} WHERE ref = '{ref}'")[0][0])

    def records(self) -> int:
        return int(self.rows("SELECT count(*) FROM goblin_idem_records")[0][0])


def make_site(tmp: Path, redis: Server, postgres: Postgres | None, **env: str) -> Site:
    if postgres is None:
        database = str(tmp / "app.db")
        url = f"sqlite:///{database}"
    else:
        database = postgres.new_database()
        url = f"postgresql://postgres@127.0.0.1:{postgres.port}/{database}"
    base = {
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DJANGO_DB": url,
        "REDIS_URL": redis.url,
        "GATE_DIR": str(tmp),
        "HOOK_LOG": str(tmp / "hooks.log"),
    }
    site = Site({**base, **env}, tmp, postgres, database)
    site.migrate()
    return site


@pytest.fixture
def sites(tmp_path: Path, redis_server: Server) -> Iterator[Callable[..., Site]]:
    made: list[Site] = []

    def make(postgres: Postgres | None, **env: str) -> Site:
        site = make_site(tmp_path, redis_server, postgres, **env)
        made.append(site)
        return site

    yield make
    for site in made:
        for server in site.servers:
            server.stop()


def flush(redis: Server) -> None:
    with redis.sync_client() as r:
        r.flushall()


def wait_for(path: Path, timeout: float = 30) -> None:
    until_sync(path.exists, timeout, f"{path.name} appeared")


def in_thread(fn: Callable[[], Reply]) -> Callable[[], Reply]:
    """`fn` started in a thread; the function returned waits for its reply."""
    box: list[Reply] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()

    def result() -> Reply:
        thread.join(60)
        assert box, "the request did not end"
        return box[0]

    return result


@pytest.mark.parametrize(
    ("vendor", "atomic_requests", "worker_class"),
    [("postgresql", "0", "gthread"), ("sqlite", "1", "sync")],
    ids=["pg-gthread", "sqlite-atomic-requests-sync"],
)
def test_the_database_replays_a_run_after_the_store_lost_it(
    vendor: str,
    atomic_requests: str,
    worker_class: str,
    sites: Callable[..., Site],
    redis_server: Server,
    request: pytest.FixtureRequest,
) -> None:
    """A completed run, then the store flushed: the record committed with the view's ORM
    writes replays it, one payment. A view's nested atomic() blocks (in ATOMIC_REQUESTS's
    on SQLite) are savepoints in the run's transaction; its on_commit callbacks run after
    the record committed, and not at all for a run rolled back (a 500). A request without
    a key commits as Django commits it. Under gunicorn's gthread and sync workers."""
    postgres = request.getfixturevalue("postgres") if vendor == "postgresql" else None
    site = sites(postgres, ATOMIC_REQUESTS=atomic_requests)
    port = site.serve(threads=1, worker_class=worker_class).port
    key = f"k-{secrets.token_hex(4)}"
    first = post(port, key, "r1", mode="hook")
    assert first.status == 201 and not first.replayed
    flush(redis_server)
    again = post(port, key, "r1", mode="hook")
    assert again.status == 201 and again.replayed and again.body == first.body
    assert site.count("r1") == 1 and site.records() == 1
    nested = post(port, f"n-{key}", "r2", mode="nested")
    assert nested.status == 201
    assert site.count("r2") == 1 and site.count("r2-undone") == 0
    failed = post(port, f"f-{key}", "r3", mode="500")
    assert failed.status == 500
    assert site.count("r3") == 0 and site.records() == 2
    keyless = post(port, None, "r4", mode="hook")
    assert keyless.status == 201 and site.count("r4") == 1 and site.records() == 2
    hooks = (site.tmp / "hooks.log").read_text().splitlines()
    assert hooks == ["r1 recorded", "r4 unrecorded"]


def test_an_on_commit_callback_that_raises_leaves_the_committed_answer(
    sites: Callable[..., Site], postgres: Postgres, redis_server: Server
) -> None:
    """A callback that raises runs after the COMMIT: the run's payment and record stand,
    its client gets its 201 (replayed from the database too), and the error is logged; the
    callbacks after it do not run, as Django does."""
    site = sites(postgres)
    server = site.serve(threads=1)
    key = f"raises-{secrets.token_hex(4)}"
    first = post(server.port, key, "h1", mode="hook-raises")
    assert first.status == 201 and site.count("h1") == 1 and site.records() == 1
    flush(redis_server)
    again = post(server.port, key, "h1", mode="hook-raises")
    assert again.status == 201 and again.replayed and again.body == first.body
    keyless = post(server.port, None, "h2", mode="hook")  # the thread's connection: clean
    assert keyless.status == 201 and site.count("h2") == 1
    said = output_of(server.proc)
    assert "an on_commit callback raised after the run committed" in said, said
    assert (site.tmp / "hooks.log").read_text().splitlines() == ["h2 unrecorded"]


@pytest.mark.parametrize(
    "second", ["commits-first", "commits-first-store-lost-it", "commits-second"]
)
def test_a_claim_lost_mid_run_makes_one_payment_and_one_answer(
    second: str, sites: Callable[..., Site], postgres: Postgres, redis_server: Server
) -> None:
    """The claim deleted while the first run waits after its write: a duplicate claims the
    key and runs too. Whichever commits second finds the key's row, rolls back its payment
    and answers the other's response: one payment, both clients the same answer. The log
    says which run's commit was refused, also when the store lost the duplicate's result
    before the first run published (it then finds the duplicate's claim)."""
    site = sites(postgres)
    server = site.serve()
    port = server.port
    key = f"lost-{secrets.token_hex(4)}"
    first = in_thread(lambda: post(port, key, "lost", mode="gate"))
    wait_for(site.tmp / "lost.entered.1")
    with redis_server.sync_client() as r:
        assert r.delete(key_names(b"idem", b"", key.encode()).claim) == 1
    duplicate = in_thread(lambda: post(port, key, "lost", mode="gate"))
    wait_for(site.tmp / "lost.entered.2")
    order = ["1", "2"] if second == "commits-second" else ["2", "1"]
    (site.tmp / f"lost.go.{order[0]}").touch()
    done_first = (duplicate if order[0] == "2" else first)()
    if second == "commits-first-store-lost-it":
        with redis_server.sync_client() as r:
            assert r.delete(key_names(b"idem", b"", key.encode()).result) == 1
    (site.tmp / f"lost.go.{order[1]}").touch()
    done_second = (first if order[0] == "2" else duplicate)()
    assert done_first.status == done_second.status == 201
    assert done_first.body == done_second.body
    assert not done_first.replayed and done_second.replayed
    assert site.count("lost") == 1 and site.records() == 1
    said = output_of(server.proc)
    refused = [line for line in said.splitlines() if "this run's commit was refused" in line]
    assert len(refused) == 1, said  # the run that committed second
    assert "its writes through Django's ORM on the database 'default' rolled back" in refused[0]
    # The first run, if it committed first, found the claim taken when it published.
    assert (
        "its commit will find this run's record, so its writes through Django's ORM on "
        "the database 'default' roll back" in said
    ) == (second == "commits-second"), said


def test_a_worker_killed_after_its_commit_replays_once_after_the_lease(
    sites: Callable[..., Site], postgres: Postgres
) -> None:
    """SIGKILL right after the commit (an on_commit callback), before the store heard of
    it: the store holds only the claim, the database the record. After the lease the
    record is replayed; the payment was made once."""
    site = sites(postgres, LEASE_SECONDS="1")
    marker = site.tmp / "kill"
    marker.touch()
    port = site.serve(KILL_AFTER_COMMIT_FILE=str(marker)).port
    key = f"kill-{secrets.token_hex(4)}"
    with pytest.raises((http.client.HTTPException, OSError)):
        post(port, key, "killed")
    assert site.count("killed") == 1 and site.records() == 1
    replies = []

    def answered() -> bool:
        try:
            replies.append(post(port, key, "killed"))
        except OSError:
            replies.append(Reply(0, {}, b""))
        return replies[-1].status not in (0, 409)

    until_sync(answered, 30, "gunicorn's new worker answered, the dead run's lease ended", 0.1)
    reply = replies[-1]
    assert reply.status == 201 and reply.replayed
    assert json.loads(reply.body)["ref"] == "killed"
    assert site.count("killed") == 1


def test_a_commit_refused_by_a_deferred_constraint_answers_503_and_the_retry_runs(
    sites: Callable[..., Site], postgres: Postgres
) -> None:
    """The view's writes pass, its COMMIT fails (a unique constraint checked at COMMIT):
    503 not-committed, no payment, no record, and the key free for the retry."""
    site = sites(postgres)
    site.rows("INSERT INTO django_records_ticket (code) VALUES ('taken')")
    port = site.serve(threads=1).port
    key = f"deferred-{secrets.token_hex(4)}"
    refused = post(port, key, "d1", mode="ticket", code="taken")
    assert refused.status == 503 and refused.problem().endswith("not-committed")
    assert site.count("d1") == 0 and site.records() == 0
    site.rows("DELETE FROM django_records_ticket")
    retried = post(port, key, "d1", mode="ticket", code="taken")
    assert retried.status == 201 and not retried.replayed
    assert site.count("d1") == 1 and site.records() == 1


@pytest.mark.parametrize(
    ("vendor", "atomic_requests"),
    [("postgresql", "1"), ("sqlite", "1"), ("postgresql", "0")],
    ids=["pg-atomic-requests", "sqlite-atomic-requests", "pg"],
)
def test_a_view_that_marked_its_transaction_for_rollback_gets_no_record(
    vendor: str, atomic_requests: str, sites: Callable[..., Site], request: pytest.FixtureRequest
) -> None:
    """``transaction.set_rollback(True)`` after the write, then 201: the run's writes are
    undone, so its record must not commit either (a replay would describe a payment that
    does not exist). 503 not-committed, nothing kept, and the retry runs. With
    ATOMIC_REQUESTS the mark is on Django's block around the view, rolled back (and the
    mark gone) before the run commits."""
    postgres = request.getfixturevalue("postgres") if vendor == "postgresql" else None
    site = sites(postgres, ATOMIC_REQUESTS=atomic_requests)
    port = site.serve(threads=1).port
    key = f"undone-{secrets.token_hex(4)}"
    undone = post(port, key, "u1", mode="set-rollback")
    assert undone.status == 503 and undone.problem().endswith("not-committed")
    assert site.count("u1") == 0 and site.records() == 0
    again = post(port, key, "u1", mode="set-rollback")  # the key was freed: it runs again
    assert again.status == 503 and site.records() == 0
    kept = post(port, key, "u1")
    assert kept.status == 201 and not kept.replayed
    assert site.count("u1") == 1 and site.records() == 1


def test_the_database_stopped_before_the_commit_answers_503_and_the_retry_runs(
    sites: Callable[..., Site],
) -> None:
    postgres = start_postgres()
    try:
        site = sites(postgres)
        port = site.serve(threads=1).port
        key = f"stopped-{secrets.token_hex(4)}"
        running = in_thread(lambda: post(port, key, "s1", mode="gate"))
        wait_for(site.tmp / "s1.entered.1")
        postgres.stop(fast=True)  # what was committed stays
        (site.tmp / "s1.go.1").touch()
        reply = running()
        assert reply.status == 503 and reply.problem().endswith("database-unavailable")
        postgres.start()
        assert site.count("s1") == 0 and site.records() == 0
        again = post(port, key, "s1")
        assert again.status == 201 and not again.replayed
        assert site.count("s1") == 1 and site.records() == 1
    finally:
        for server in site.servers:
            server.stop()
        postgres.remove()


@pytest.mark.parametrize(
    ("psycopg", "mode"),
    [("3", "gate-then-try"), ("2", "gate-then-try"), ("2", "gate-then-save")],
    ids=["psycopg-cursor", "psycopg2-cursor", "psycopg2-orm"],
)
def test_a_connection_lost_under_the_view_answers_503_database_unavailable(
    psycopg: str, mode: str, sites: Callable[..., Site], postgres: Postgres
) -> None:
    """The view's connection cut at TCP while it waits after its write (a proxy's reset:
    no word from the server); it then tries a write it can do without and catches the
    error. Its commit meets a closed connection: psycopg's OperationalError, psycopg2's
    InterfaceError ("connection already closed"), or (the ORM's error having marked the
    block for rollback) no statement at all; each is the database unavailable: 503
    database-unavailable, nothing kept, and the retry runs."""
    site = sites(postgres)
    with Proxy(postgres.port) as proxy:
        through = f"postgresql://postgres@127.0.0.1:{proxy.port}/{site.database}"
        port = site.serve(threads=1, DJANGO_DB=through, PSYCOPG=psycopg).port
        key = f"cut-{secrets.token_hex(4)}"
        running = in_thread(lambda: post(port, key, "c1", mode=mode))
        wait_for(site.tmp / "c1.entered.1")
        assert proxy.reset() >= 1
        (site.tmp / "c1.go.1").touch()
        reply = running()
        assert reply.status == 503 and reply.problem().endswith("database-unavailable")
        assert site.count("c1") == 0 and site.records() == 0
        again = post(port, key, "c1")
        assert again.status == 201 and not again.replayed
        assert site.count("c1") == 1 and site.records() == 1


@pytest.mark.parametrize("mode", ["other", "own"])
def test_a_write_through_another_connection_to_the_database_is_warned_once(
    mode: str, sites: Callable[..., Site], postgres: Postgres
) -> None:
    """The gap, told: a keyed view that also writes through an alias naming the records'
    database (``other``), or through a connection it made itself (``own``), commits that
    write apart from the record. Logged once for the route."""
    site = sites(postgres, OTHER_ALIAS="1")
    server = site.serve()
    for n in range(3):
        key = f"{mode}-{n}-{secrets.token_hex(4)}"
        assert post(server.port, key, f"w{n}", mode=mode).status == 201
    assert post(server.port, f"plain-{secrets.token_hex(4)}", "p").status == 201
    said = output_of(server.proc)
    warnings = [line for line in said.splitlines() if "not the run's" in line]
    assert len(warnings) == 1, said
    alias = "other" if mode == "other" else "default"
    assert "POST /payments" in warnings[0] and f"alias '{alias}'" in warnings[0]
    assert ".using('default')" in warnings[0]
    assert site.count(f"w0-{mode}") == 1  # not covered, and not stopped


BOOT = "from django.core.wsgi import get_wsgi_application; get_wsgi_application()"


@pytest.mark.parametrize(
    ("env", "migrated", "message"),
    [
        ({"RECORDS_APP": "0"}, True, r"add 'goblin_idem.django' to INSTALLED_APPS"),
        ({}, False, r"table 'goblin_idem_records' does not exist .* migrate goblin_idem"),
        (
            {"GOBLIN_SETTINGS": '{"RECORDS_DATABASE": "nowhere"}'},
            True,
            r"names the database 'nowhere', which settings.DATABASES does not define",
        ),
        (
            {"DUMMY_ALIAS": "1", "GOBLIN_SETTINGS": '{"RECORDS_DATABASE": "dummy"}'},
            True,
            r"the database 'dummy' is unknown: set RECORDS_DATABASE to a PostgreSQL or SQLite",
        ),
        (
            {"RECORDS": "0", "GOBLIN_SETTINGS": '{"RECORDS_DATABASE": "default"}'},
            True,
            r"\['RECORDS_DATABASE'\] names the database of \"RECORDS\": \"django\", which is not",
        ),
    ],
    ids=["app-not-installed", "not-migrated", "unknown-alias", "vendor", "database-alone"],
)
def test_records_that_cannot_work_stop_the_startup(
    env: dict[str, str],
    migrated: bool,
    message: str,
    tmp_path: Path,
    redis_server: Server,
) -> None:
    """Each configuration that cannot work is ImproperlyConfigured when Django loads its
    middleware (a gunicorn worker fails to boot), saying what to change."""
    base = {
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DJANGO_DB": f"sqlite:///{tmp_path / 'app.db'}",
        "REDIS_URL": redis_server.url,
    }
    if migrated:
        code, said = run_until_exit(["-m", "django", "migrate", "-v0"], base)
        assert code == 0, said
    code, said = run_until_exit(["-c", BOOT], {**base, **env})
    assert code != 0
    assert "ImproperlyConfigured" in said, said
    assert re.search(message, said), said


def test_records_in_django_are_refused_under_asgi() -> None:
    async def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse(status=201)

    with (
        override_settings(GOBLIN_IDEM={"STORE": "memory", "RECORDS": "django"}),
        pytest.raises(ImproperlyConfigured, match=r"served under ASGI: serve it with its WSGI"),
    ):
        IdempotencyMiddleware(view)
    # The project's own WSGI application, to serve (it said "gunicorn myproject.wsgi").
    for setting, command in [
        ("shop.wsgi.application", "gunicorn shop.wsgi"),
        ("shop.serving.app", "gunicorn shop.serving:app"),
    ]:
        with (
            override_settings(
                GOBLIN_IDEM={"STORE": "memory", "RECORDS": "django"}, WSGI_APPLICATION=setting
            ),
            pytest.raises(ImproperlyConfigured, match=rf"application \({re.escape(command)}\)"),
        ):
            IdempotencyMiddleware(view)


IN_A_TEST_CASE = """
import django

django.setup()
from django.core.management import call_command
from django.db import transaction
from django.test import Client

from tests.support.apps.django_records.models import Payment

call_command("migrate", "--run-syncdb", verbosity=0)
with transaction.atomic():  # as django.test.TestCase runs each test
    client, headers = Client(), {"Idempotency-Key": "in-a-test-case"}
    body = {"ref": "t", "amount": 1}
    one = client.post("/payments", data=body, content_type="application/json", headers=headers)
    two = client.post("/payments", data=body, content_type="application/json", headers=headers)
    assert one.status_code == two.status_code == 201, (one.status_code, one.content)
    assert two["Idempotent-Replayed"] == "true" and two.content == one.content
    assert Payment.objects.filter(ref="t").count() == 1
    transaction.set_rollback(True)
"""


def test_a_keyed_view_in_a_test_case_s_atomic_block_runs_once(tmp_path: Path) -> None:
    """django.test.TestCase wraps each test in an atomic block: the run's block is then a
    savepoint, released at its commit, and the key's record holds within the test."""
    env = {"DJANGO_SETTINGS_MODULE": SETTINGS, "DJANGO_DB": f"sqlite:///{tmp_path / 't.db'}"}
    code, said = run_until_exit(["-c", IN_A_TEST_CASE], env)
    assert code == 0, said
