"""A payments app for sync SQL records (goblin_idem.sql with a sync Engine), two ways: Flask
with Flask-SQLAlchemy (``flask_app``: its views use ``db.session`` and commit, as such
apps do; ``flask_first_app`` the same in the order users write first: the extension before
``db.init_app``, its records on an engine of their own) and a plain WSGI app writing
through ``goblin_idem.sql.sync.session()`` (``wsgi_app``). For tests/sql and the fault
run, in process (`build_flask`, `build_wsgi`) or under gunicorn, built from the
environment: ``REDIS_URL``, ``DATABASE_URL`` (a sync URL: postgresql+psycopg://,
sqlite://), ``RECORDS_TABLE``, ``PAYMENTS_TABLE``,
``LEASE_SECONDS``; ``RECORDS=0`` for the middleware without records (the view's own
commit alone); ``KILL_AFTER_COMMIT=1`` or ``KILL_AFTER_COMMIT_FILE`` as in sql_app (the
process SIGKILLs itself right after a run's commit, before the store hears of it); and
``GATE_DIR``, where a ``gate`` run says it got there (``reached-<ref>-<n>``, n counting
the runs of that ref) after its write and waits for ``go-<ref>-<n>``.

``POST /payments`` takes JSON ``{"ref", "amount", "mode"}`` and answers 201 with the
payment's row id. Modes: ``gate``; ``raise`` (after its write); ``500`` (plain WSGI:
any status, such as ``303`` or ``404``, answered after its write); ``own`` (the write
committed through a connection of the app's own: not covered, the WARNING); ``bound``
(plain WSGI: an object added to the app's own Session on ``connection()``, never
flushed).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import Table, create_engine, insert
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, registry

from goblin_idem import RedisStore, Store
from goblin_idem._recording import RecordRow
from goblin_idem.flask import Idempotency
from goblin_idem.sql import SyncSqlRecords
from goblin_idem.sql import sync as sql_sync
from goblin_idem.sql.sync import SyncRun
from goblin_idem.wsgi import IdempotencyMiddleware
from tests.support.apps.sql_app import _kill_now, payments_table


class Payment:
    """A payment row, mapped per app onto its table (`mapped`)."""

    id: int | None
    ref: str
    amount: int

    def __init__(self, ref: str, amount: int) -> None:
        self.ref, self.amount = ref, amount


def mapped(payments: Table) -> type[Payment]:
    kind = type("Payment", (Payment,), {})
    registry().map_imperatively(kind, payments)
    return kind


def gate(ref: str) -> None:
    """A ``gate`` run's stop, between processes: files in GATE_DIR."""
    where = Path(os.environ["GATE_DIR"])
    n = 0
    while True:
        try:
            os.close(os.open(where / f"reached-{ref}-{n}", os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            n += 1
    go = where / f"go-{ref}-{n}"
    deadline = time.monotonic() + 30
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class KillingRun(SyncRun):
    def commit(self, row: RecordRow) -> bytes | None:
        other = super().commit(row)
        if _kill_now():  # committed, and the store never hears of it
            os.kill(os.getpid(), signal.SIGKILL)
        return other


class KillingRecords(SyncSqlRecords):
    def work(self, where: Callable[[], str] | None) -> SyncRun:
        return KillingRun(self, where)


def _answer(ref: str, payment: int | None) -> dict[str, Any]:
    return {"ref": ref, "payment": payment, "run": uuid.uuid4().hex}


def build_flask(
    store: Store,
    url: str,
    records_table: str | None,
    payments: Table,
    *,
    extension_first: bool = False,
    **options: Any,
) -> Flask:
    """Flask-SQLAlchemy as its users write it; `records_table` None: no records. With
    `extension_first`, in the order users write first: the extension, with records on an
    engine of their own (``SyncSqlRecords(url)``), then ``db.init_app(app)``."""
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # "ref" first, as sql_app's
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    db = SQLAlchemy()
    if extension_first:
        assert records_table is not None
        first = SyncSqlRecords(url, table=records_table)
        if _killing():
            first = KillingRecords(create_engine(url), table=records_table)
        Idempotency(app, store=store, records=first, **options)
    db.init_app(app)
    kind = mapped(payments)

    @app.get("/health")
    def health() -> str:
        return "ok"

    @app.post("/payments")
    def pay() -> Any:
        body = request.get_json()
        mode = body.get("mode")
        if mode == "own":
            with db.engine.begin() as conn:
                conn.execute(insert(payments).values(ref=body["ref"], amount=body["amount"]))
            return jsonify(_answer(body["ref"], None)), 201
        payment = kind(body["ref"], body["amount"])
        db.session.add(payment)
        db.session.commit()
        if records_table is None and _kill_now():  # the view's commit is the only one
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "gate":
            gate(body["ref"])
        if mode == "raise":
            raise RuntimeError("the view failed after its commit")
        if mode == "500":
            return jsonify(error="failed"), 500
        return jsonify(_answer(body["ref"], payment.id)), 201

    if extension_first:
        return app
    with app.app_context():
        records: SyncSqlRecords | None = None
        if records_table is not None and _killing():
            records = KillingRecords(db.engine, table=records_table)
        elif records_table is not None:
            records = SyncSqlRecords(db.engine, table=records_table)  # what an app passes
        Idempotency(app, store=store, records=records, **options)
    return app


def build_wsgi(store: Store, records: SyncSqlRecords, payments: Table, **options: Any) -> Any:
    """A plain WSGI app writing through goblin_idem.sql.sync."""
    kind = mapped(payments)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/health":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        size = int(environ.get("CONTENT_LENGTH") or 0)
        body = json.loads(environ["wsgi.input"].read(size))
        mode = body.get("mode")
        payment = kind(body["ref"], body["amount"])
        if mode == "own":  # before the run's write: on SQLite, that one holds the write lock
            with records.engine.begin() as conn:
                conn.execute(insert(payments).values(ref=body["ref"] + "-own", amount=1))
        if mode == "bound":  # the app's own session on the run's connection, not flushed
            Session(bind=sql_sync.connection()).add(payment)
            answer = _answer(body["ref"], None)
        else:
            s = sql_sync.session()
            s.add(payment)
            s.flush()
            answer = _answer(body["ref"], payment.id)
        if mode == "gate":
            gate(body["ref"])
        if mode == "raise":
            raise RuntimeError("the app failed after its write")
        status = "201 Created"
        if mode and mode.isdigit():  # that status, after the write
            status = f"{mode} {HTTPStatus(int(mode)).phrase}"
        start_response(status, [("Content-Type", "application/json")])
        return [json.dumps(answer).encode()]

    return IdempotencyMiddleware(app, store=store, records=records, **options)


def _killing() -> bool:
    return os.environ.get("KILL_AFTER_COMMIT") == "1" or "KILL_AFTER_COMMIT_FILE" in os.environ


def _from_env() -> tuple[Flask | None, Flask | None, Any]:
    if "DATABASE_URL" not in os.environ:
        return None, None, None
    store = RedisStore.from_url(os.environ["REDIS_URL"])
    url = os.environ["DATABASE_URL"]
    payments = payments_table(os.environ["PAYMENTS_TABLE"])
    lease = float(os.environ.get("LEASE_SECONDS", "30"))
    table = None if os.environ.get("RECORDS") == "0" else os.environ["RECORDS_TABLE"]
    flask = build_flask(store, url, table, payments, lease_seconds=lease)
    flask_first = None
    if table is not None:
        flask_first = build_flask(
            store, url, table, payments, extension_first=True, lease_seconds=lease
        )
    engine: Engine = create_engine(url)
    kind_of = KillingRecords if _killing() else SyncSqlRecords
    plain = build_wsgi(
        store,
        kind_of(engine, table=os.environ["RECORDS_TABLE"]),
        payments,
        lease_seconds=lease,
    )
    return flask, flask_first, plain


flask_app, flask_first_app, wsgi_app = _from_env()
