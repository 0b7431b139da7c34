"""Settings of the records project (see the package docstring)."""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlsplit

if os.environ.get("PSYCOPG") == "2":  # Django's PostgreSQL backend on psycopg2, not psycopg
    sys.modules["psycopg"] = None  # type: ignore[assignment]

SECRET_KEY = "not a secret: tests only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.support.apps.django_records.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
INSTALLED_APPS = ["tests.support.apps.django_records"]
if os.environ.get("RECORDS_APP", "1") == "1":
    INSTALLED_APPS.append("goblin_idem.django")
MIDDLEWARE = ["goblin_idem.django.IdempotencyMiddleware"]


def database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    atomic = os.environ.get("ATOMIC_REQUESTS") == "1"
    if parts.scheme == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parts.path,
            "ATOMIC_REQUESTS": atomic,
            "OPTIONS": {"timeout": 20, "init_command": "PRAGMA journal_mode=WAL"},
        }
    if parts.scheme == "dummy":
        return {"ENGINE": "django.db.backends.dummy"}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "postgres",
        "HOST": parts.hostname,
        "PORT": str(parts.port or 5432),
        "ATOMIC_REQUESTS": atomic,
    }


DATABASES = {"default": database(os.environ.get("DJANGO_DB", "sqlite:///:memory:"))}
if os.environ.get("OTHER_ALIAS") == "1":
    DATABASES["other"] = {**DATABASES["default"], "ATOMIC_REQUESTS": False}
if os.environ.get("DUMMY_ALIAS") == "1":
    DATABASES["dummy"] = database("dummy://")

GOBLIN_IDEM: dict[str, object] = {
    "STORE": os.environ.get("REDIS_URL", "memory"),
    "LEASE_SECONDS": float(os.environ.get("LEASE_SECONDS", "30")),
}
if os.environ.get("RECORDS", "1") == "1":
    GOBLIN_IDEM["RECORDS"] = "django"
GOBLIN_IDEM.update(json.loads(os.environ.get("GOBLIN_SETTINGS", "{}")))
