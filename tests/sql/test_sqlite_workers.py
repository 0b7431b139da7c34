"""SQL records on one SQLite file under ``uvicorn --workers 2``, every run holding the write
lock for a while (it works after its write): each answer is the run's 201, or 503
``database-unavailable`` for a run that could not have the lock in time; never a plain 500
("database is locked"), never a request left unanswered, and one payment per 201."""

from __future__ import annotations

from pathlib import Path

from tests.sql.sqlite_load import run
from tests.support.servers import Server


def test_two_workers_on_one_sqlite_file_answer_201_or_503(
    tmp_path: Path, redis_server: Server
) -> None:
    outcome = run(tmp_path, redis_server.url, requests=160, clients=12, work_ms=0, hold_ms=60)
    assert set(outcome.answers) <= {"201", "503 database-unavailable"}, outcome.as_dict()
    assert outcome.answers.get("201", 0) == outcome.created == outcome.payments
    assert "Traceback" not in outcome.log, outcome.log[-3000:]
