"""``GOBLIN_IDEM["STORE"] = "postgres"``: the records project under gunicorn with PostgreSQL
as its only server: the claims in the project's own database (the table made by
``migrate``), the records and the payments beside them. No Redis is asked anything."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from goblin_idem import PostgresStore
from goblin_idem.django import _settings
from tests.django.test_records import Site, post, sites  # noqa: F401
from tests.support.postgres import Postgres

ONLY_POSTGRES = json.dumps({"STORE": "postgres"})
pytestmark = pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")


def test_a_django_project_runs_exactly_once_on_postgresql_alone(
    sites: Callable[..., Site],  # noqa: F811
    postgres: Postgres,
) -> None:
    site = sites(postgres, GOBLIN_SETTINGS=ONLY_POSTGRES, REDIS_URL="redis://127.0.0.1:1/0")
    assert site.rows("SELECT count(*) FROM goblin_idem_keys") == [("0",)]  # migrated
    port = site.serve(threads=4).port
    key = f"k-{secrets.token_hex(4)}"
    first = post(port, key, "r1")
    assert first.status == 201 and not first.replayed
    for _ in range(3):
        again = post(port, key, "r1")
        assert again.status == 201 and again.replayed and again.body == first.body
    assert post(port, key, "other-ref").status == 422  # the key reused for another payment
    assert site.count("r1") == 1 and site.records() == 1
    # the claim and the published result are rows of the project's database
    assert int(site.rows("SELECT count(*) FROM goblin_idem_keys")[0][0]) >= 2


def test_postgres_needs_a_postgresql_default_database() -> None:
    with override_settings(
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    ):
        with pytest.raises(ImproperlyConfigured, match="needs the 'default' database to be"):
            _settings.postgres_url("default")


@pytest.mark.parametrize(
    ("database", "url"),
    [
        (
            {"NAME": "app", "USER": "u@x", "PASSWORD": "p/w", "HOST": "db", "PORT": "6432"},
            "postgresql://u%40x:p%2Fw@db:6432/app",
        ),
        ({"NAME": "app", "USER": "u"}, "postgresql://u@localhost/app"),
        (
            {"NAME": "app", "HOST": "/run/postgresql", "PORT": "5433"},
            "postgresql:///app?host=%2Frun%2Fpostgresql&port=5433",
        ),
    ],
)
def test_the_store_url_is_the_projects_database(database: dict[str, str], url: str) -> None:
    setting = {"ENGINE": "django.db.backends.postgresql", **database}
    with override_settings(DATABASES={"default": setting}):
        assert _settings.postgres_url("default") == url
        store = _settings._made("postgres")
        assert isinstance(store, PostgresStore)
