"""Django's ORM records under the randomized faults of tests/reliability/sql_faults.py:
Redis restarted without persistence, gunicorn workers SIGKILLed, and SIGKILLed right after
a commit (tests/reliability/django_faults.py).

With ``RECORDS: "django"`` on PostgreSQL no fault may pay twice: one payment row per key,
every 2xx answer of a key the same bytes naming that row, a committed record for every
answered key. ``bench/sql_faults.py --stack django`` runs it at a chosen size and seed, and
without records for the contrast.
"""

from __future__ import annotations

from pathlib import Path

from tests.reliability.report import pick, record
from tests.reliability.sql_faults import Options, run
from tests.reliability.test_sql_faults import SEED


def test_random_faults_pay_each_key_once_through_django_s_orm(tmp_path: Path) -> None:
    opts = Options(
        seed=SEED,
        keys=pick(120, 1000),
        duration=pick(12.0, 60.0),
        fault_gap=pick(1.2, 1.5),
        stack="django",
        dir=tmp_path,
    )
    outcome = run(opts)
    record(
        "djangofaults",
        "Django ORM records: Redis restarted without persistence, gunicorn workers killed "
        "(also right after their commit), random schedule",
        outcome.figures,
        checks=[
            "exactly one payment row per key (0 duplicate effects)",
            "every key got a 2xx; every 2xx answer of a key the same bytes, naming its row",
            "a committed record for every key answered 2xx",
            "each key sent once more to every worker after the faults: the same bytes",
        ],
        notes=[
            f"seed {opts.seed}; 3 gunicorn masters, each with one gthread worker (4 threads), "
            "on PostgreSQL (psycopg), lease 2 s, each key sent by 2 clients at once, retried "
            "after 409, 5xx and connection errors"
        ],
    )
    assert outcome.failures == [], "\n".join(outcome.failures[:30])
    assert outcome.duplicate_effects == 0
    faults = outcome.figures["faults"]
    assert faults["redis_restart"] + faults["worker_kill"] + faults["kill_after_commit"] > 0
