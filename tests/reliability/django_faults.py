"""The Django stack of the fault run (`sql_faults`, ``stack="django"``): the records project
(tests/support/apps/django_records) under gunicorn (`sql_faults.GunicornDjango`), on
PostgreSQL, with ``RECORDS: "django"`` (or without records, the control: each view's payment
commits on its own). Its database is made by Django's migrations.
"""

from __future__ import annotations

from tests.support.postgres import Postgres
from tests.support.wsgi import run_until_exit

from .sql_faults import Options

APP = "tests.support.apps.django_records.wsgi:application"
SETTINGS = "tests.support.apps.django_records.settings"


def prepare(postgres: Postgres, redis_url: str, opts: Options) -> dict[str, str]:
    """A new database with the project's tables (its payments and goblin_idem's records);
    the workers' environment."""
    database = postgres.new_database()
    env = {
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DJANGO_DB": f"postgresql://postgres@127.0.0.1:{postgres.port}/{database}",
        "REDIS_URL": redis_url,
        "LEASE_SECONDS": str(opts.lease),
        "RECORDS": "1" if opts.records else "0",
    }
    code, said = run_until_exit(["-m", "django", "migrate", "--run-syncdb", "-v", "0"], env)
    if code != 0:
        raise RuntimeError(f"migrate failed: {said}")
    return env
