"""Settings of the test project (see the package docstring)."""

from __future__ import annotations

import json
import os

_CACHE = os.environ.get("REPLAY_CACHE_BYTES")
SECRET_KEY = "not a secret: tests only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.support.apps.django_site.urls"
WSGI_APPLICATION = "tests.support.apps.django_site.wsgi.application"
INSTALLED_APPS = ["rest_framework"]
DATABASES: dict[str, object] = {}
USE_TZ = True
MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    "goblin_idem.django.IdempotencyMiddleware",
]
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
}
GOBLIN_IDEM = {
    "STORE": os.environ.get("REDIS_URL", "memory"),
    # with REPLAY_CACHE_BYTES, REDIS_URL's store with a replay cache of that budget
    **({"STORE": "tests.support.apps.django_site.views.cached_store"} if _CACHE else {}),
    "LEASE_SECONDS": int(os.environ.get("LEASE_SECONDS", "30")),
    **json.loads(os.environ.get("GOBLIN_SETTINGS", "{}")),
}
