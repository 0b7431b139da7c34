"""SQL records under randomized faults: Redis restarted without persistence, workers
SIGKILLed, workers SIGKILLed right after a commit (tests/reliability/sql_faults.py).

With ``records=`` on PostgreSQL, no fault may pay twice: exactly one payment row per key,
every 2xx answer of a key the same bytes naming that row, a committed record for every
answered key. ``bench/sql_faults.py`` runs the same scenario with a chosen seed and size,
and without records for the contrast.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from goblin_idem import RedisStore
from goblin_idem._keys import key_names
from goblin_idem.store import CLAIMED
from tests.reliability.report import pick, record
from tests.reliability.sql_faults import Options, run
from tests.support.servers import Server

SEED = int(os.environ.get("GOBLIN_FAULTS_SEED", "20261202"))


def test_random_faults_pay_each_key_once(tmp_path: Path) -> None:
    opts = Options(
        seed=SEED,
        keys=pick(120, 1500),
        duration=pick(12.0, 90.0),
        fault_gap=pick(1.2, 1.5),
        dir=tmp_path,
    )
    outcome = run(opts)
    record(
        "sqlfaults",
        "SQL records: Redis restarted without persistence, workers killed (also right "
        "after their commit), random schedule",
        outcome.figures,
        checks=[
            "exactly one payment row per key (0 duplicate effects)",
            "every key got a 2xx; every 2xx answer of a key the same bytes, naming its row",
            "a committed record for every key answered 2xx",
            "each key sent once more to every worker after the faults: the same bytes",
        ],
        notes=[
            f"seed {opts.seed}; 3 uvicorn workers on PostgreSQL (asyncpg), lease 2 s, each "
            "key sent by 2 clients at once, retried after 409, 5xx and connection errors"
        ],
    )
    assert outcome.failures == [], "\n".join(outcome.failures[:30])
    assert outcome.duplicate_effects == 0
    faults = outcome.figures["faults"]
    assert faults["redis_restart"] + faults["worker_kill"] + faults["kill_after_commit"] > 0


def test_random_faults_pay_each_key_once_with_flask_under_gunicorn(tmp_path: Path) -> None:
    """The same scenario with Flask and Flask-SQLAlchemy under gunicorn, on sync records:
    a killed worker is restarted by its master."""
    opts = Options(
        seed=SEED,
        keys=pick(80, 600),
        duration=pick(10.0, 40.0),
        fault_gap=pick(1.2, 1.5),
        stack="flask",
        dir=tmp_path,
    )
    outcome = run(opts)
    record(
        "sqlfaults-flask",
        "SQL records, Flask with Flask-SQLAlchemy under gunicorn: Redis restarted without "
        "persistence, workers killed (also right after their commit), random schedule",
        outcome.figures,
        checks=[
            "exactly one payment row per key (0 duplicate effects)",
            "every key got a 2xx; every 2xx answer of a key the same bytes, naming its row",
            "a committed record for every key answered 2xx",
        ],
        notes=[
            f"seed {opts.seed}; 3 gunicorn masters, one gthread worker each (4 threads), on "
            "PostgreSQL (psycopg), lease 2 s, each key sent by 2 clients at once"
        ],
    )
    assert outcome.failures == [], "\n".join(outcome.failures[:30])
    assert outcome.duplicate_effects == 0
    faults = outcome.figures["faults"]
    assert faults["redis_restart"] + faults["worker_kill"] + faults["kill_after_commit"] > 0


async def test_a_claim_lost_in_a_restart_is_logged_by_its_key_hash(
    redis_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen in this scenario's worker logs after a Redis restart: the claim was gone while
    its result was stored (published back from the database)."""
    names = next(
        n
        for n in (key_names(b"idem", b"", f"pay-{i}".encode()) for i in range(10_000))
        if b"\n" in n.claim
    )
    store = RedisStore.from_url(redis_server.url)
    try:
        assert await store.claim(names.claim, names.result, "tok", 30) is CLAIMED
        assert await store.publish(names.result, b"record", 60_000, names.claim, "tok") == 1
        await store.delete(names.claim)  # what a restart without persistence loses first
        with caplog.at_level(logging.WARNING, logger="goblin_idem.store"):
            reply = await store.claim_unless_done(names.claim, names.result, "other", 30)
        assert reply == b"record"
        (line,) = [r.getMessage() for r in caplog.records if "was gone" in r.getMessage()]
        assert names.hash in line and "\n" not in line
    finally:
        await store.client.delete(names.claim, names.result)  # type: ignore[union-attr]
        await store.aclose()


def test_random_faults_pay_each_key_once_with_postgresql_alone(tmp_path: Path) -> None:
    """The claims in PostgreSQL too, no Redis at all: PostgreSQL restarted (a crash) with
    keys in flight, workers killed, also right after their commit."""
    opts = Options(
        seed=SEED,
        keys=pick(120, 1500),
        duration=pick(12.0, 90.0),
        fault_gap=pick(1.5, 2.0),
        store="postgres",
        dir=tmp_path,
    )
    outcome = run(opts)
    record(
        "sqlfaults-postgres",
        "SQL records and PostgresStore in one PostgreSQL, no Redis: PostgreSQL restarted "
        "(immediate shutdown), workers killed (also right after their commit), random schedule",
        outcome.figures,
        checks=[
            "exactly one payment row per key (0 duplicate effects)",
            "every key got a 2xx; every 2xx answer of a key the same bytes, naming its row",
            "a committed record for every key answered 2xx",
            "each key sent once more to every worker after the faults: the same bytes",
        ],
        notes=[
            f"seed {opts.seed}; 3 uvicorn workers, the store and the records on one "
            "PostgreSQL (asyncpg, commits synced), lease 2 s"
        ],
    )
    assert outcome.failures == [], "\n".join(outcome.failures[:30])
    assert outcome.duplicate_effects == 0
    faults = outcome.figures["faults"]
    assert (
        faults["postgres_restart"] > 0 and faults["worker_kill"] + faults["kill_after_commit"] > 0
    )
