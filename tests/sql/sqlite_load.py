"""SQL records on one SQLite file under ``uvicorn --workers N``: new keys sent by concurrent
clients, each run working ``work_ms`` before it writes its payment (with `read_first`,
reading the payments table before: a reader that becomes a writer; with `hold_ms`, working
that long after its write, holding the write lock). What every answer was, and how
many payments the file holds (one per key answered 201, none for a 503). Used by
tests/sql/test_sqlite_workers.py and bench/sqlite_workers.py."""

from __future__ import annotations

import collections
import json
import secrets
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.sql.test_crash import post
from tests.support.apps.sql_app import create_tables
from tests.support.procs import spawn, stop, uvicorn_args, wait_http
from tests.support.servers import free_port

APP = "tests.support.apps.sql_app:app"


@dataclass
class Outcome:
    requests: int
    answers: dict[str, int]  # "201", "503 database-unavailable", "500", "0" (no answer)
    created: int  # keys answered 201
    payments: int  # rows in the payments table
    log: str

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "answers": dict(sorted(self.answers.items())),
            "created": self.created,
            "payments": self.payments,
        }


def run(
    directory: Path,
    redis_url: str,
    *,
    requests: int = 400,
    clients: int = 16,
    work_ms: int = 100,
    read_first: bool = False,
    hold_ms: int = 0,
    workers: int = 2,
) -> Outcome:
    path = directory / f"app-{secrets.token_hex(4)}.db"
    url = f"sqlite+aiosqlite:///{path}"
    create_tables(url, "goblin_idem_records", "payments")
    env = {
        "DATABASE_URL": url,
        "REDIS_URL": redis_url,
        "RECORDS_TABLE": "goblin_idem_records",
        "PAYMENTS_TABLE": "payments",
    }
    port = free_port()
    proc = wait_http(spawn(uvicorn_args(APP, port, "warning", workers), env), port, timeout=30)
    body: dict[str, object] = {"work_ms": work_ms}
    if read_first:
        body["mode"] = "gate-after-read"  # a SELECT of the payments, then the INSERT
    elif hold_ms:
        body.update(mode="hold", hold_ms=hold_ms)  # the INSERT, then work in the transaction

    def send(i: int) -> tuple[int, dict[str, str], bytes]:
        try:
            return post(port, f"k{i}", f"r{i}", body)
        except OSError:  # no answer in 30 s
            return 0, {}, b""

    try:
        with ThreadPoolExecutor(clients) as pool:
            replies = list(pool.map(send, range(requests)))
    finally:
        proc.send_signal(2)
        try:
            log = proc.communicate(timeout=30)[1].decode(errors="replace")
        finally:
            stop(proc)
    answers: collections.Counter[str] = collections.Counter()
    for status, headers, reply in replies:
        kind = ""
        if headers.get("content-type") == "application/problem+json":
            kind = " " + json.loads(reply)["type"].rsplit(":", 1)[1]
        answers[f"{status}{kind}"] += 1
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT count(*) FROM payments").fetchone()[0]
    created = sum(1 for status, _, _ in replies if status == 201)
    return Outcome(requests, dict(answers), created, rows, log)
