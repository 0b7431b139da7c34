"""Django configured once for the in-process tests: the test project, on the embedded
store (its servers' tests set REDIS_URL in the servers' environment only)."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.apps.django_site.settings")
django.setup()

# PostgreSQL for the records' tests, one server and database per test worker, as tests/sql's.
from tests.sql.conftest import pg_database  # noqa: E402, F401
