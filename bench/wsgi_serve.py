"""One WSGI benchmark app: a trivial JSON POST handler, bare or behind one idempotency
variant, as gunicorn imports it (``wsgi_serve:app``). Configured by environment:
WSGI_VARIANT (one of VARIANTS), REDIS_URL; DATABASE_URL for the ``flasksql`` variants,
whose handler inserts one row with Flask-SQLAlchemy and commits it (with goblin-idem's
records, ``flasksql-records``, in the run's transaction, with the record); DJANGO_DB
(``postgresql://user@host:port/name``, with a table ``orders``) for the ``djangodb-*`` ones.

`POST /orders` is the handler under test (it counts its own runs); `GET /__stats` reports
that count, so the driver can check that a replay never ran the handler. The ``djangodb-*``
handler also inserts the order's row through Django's connection: bare, behind goblin-idem
on the store alone, and with ``RECORDS: "django"`` (the row and the record in one commit).
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

VARIANTS = (
    "flask-bare",
    "flask-goblin",
    "flask-goblin-cache",
    "flasksql-bare",
    "flasksql-goblin",
    "flasksql-records",
    "django-bare",
    "django-goblin",
    "django-goblin-cache",
    "django-peer",
    "django-answer",
    "djangodb-bare",
    "djangodb-goblin",
    "djangodb-records",
)
REPLAY_CACHE_BYTES = 4 << 20  # the -cache variants': replays from memory, 4 MiB
STATS = {"handler_calls": 0}
VARIANT = os.environ.get("WSGI_VARIANT", "flask-bare")
REDIS_URL = os.environ.get("REDIS_URL", "")


def store() -> Any:
    """The goblin variants' store: Redis, with the replay cache for the -cache variants."""
    from goblin_idem import RedisStore

    if VARIANT.endswith("-cache"):
        return RedisStore.from_url(REDIS_URL, replay_cache_bytes=REPLAY_CACHE_BYTES)
    return RedisStore.from_url(REDIS_URL)


def flask_app() -> Any:
    from flask import Flask, jsonify, request

    app = Flask(__name__)

    @app.post("/orders")
    def orders() -> Any:
        STATS["handler_calls"] += 1
        data = request.get_json()
        return jsonify(id=STATS["handler_calls"], sku=data["sku"]), 201

    @app.get("/__stats")
    def stats() -> Any:
        return jsonify(STATS)

    if VARIANT.startswith("flask-goblin"):
        from goblin_idem.flask import Idempotency

        Idempotency(app, store=store())
    return app


def flasksql_app() -> Any:
    """Flask-SQLAlchemy: one row per order, committed by the view (``db.session.commit()``);
    with records, that commit is a savepoint and the run commits the row with its record."""
    from flask import Flask, jsonify, request
    from flask_sqlalchemy import SQLAlchemy

    db = SQLAlchemy()

    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "bench_orders"
        id = db.Column(db.Integer, primary_key=True)
        sku = db.Column(db.String(32), nullable=False)
        qty = db.Column(db.Integer, nullable=False)

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["DATABASE_URL"]
    db.init_app(app)

    @app.post("/orders")
    def orders() -> Any:
        STATS["handler_calls"] += 1
        data = request.get_json()
        order = Order(sku=data["sku"], qty=data["qty"])
        db.session.add(order)
        db.session.commit()
        return jsonify(id=order.id, sku=order.sku), 201

    @app.get("/__stats")
    def stats() -> Any:
        return jsonify(STATS)

    with app.app_context():
        db.create_all()
        if VARIANT != "flasksql-bare":
            from goblin_idem import RedisStore
            from goblin_idem.flask import Idempotency
            from goblin_idem.sql import SyncSqlRecords

            records = None
            if VARIANT == "flasksql-records":
                records = SyncSqlRecords(db.engine)
                records.create_table()
            Idempotency(app, store=RedisStore.from_url(REDIS_URL), records=records)
    return app


def django_app() -> Any:
    """A one-module Django project; the peer (django-idempotency-key) stores responses in a
    django-redis cache and locks the lookup with its Redis lock, as its documentation says
    for several processes, and replays with the original status."""
    import django
    from django.conf import settings
    from django.core.wsgi import get_wsgi_application

    middleware: list[str] = []
    extra: dict[str, Any] = {"DATABASES": {}, "INSTALLED_APPS": []}
    if VARIANT.startswith("django-goblin") or VARIANT == "djangodb-goblin":
        middleware = ["goblin_idem.django.IdempotencyMiddleware"]
        extra["GOBLIN_IDEM"] = {"STORE": store()}
    elif VARIANT == "djangodb-records":
        middleware = ["goblin_idem.django.IdempotencyMiddleware"]
        extra["GOBLIN_IDEM"] = {"STORE": store(), "RECORDS": "django"}
        extra["INSTALLED_APPS"] = ["goblin_idem.django"]
    elif VARIANT == "django-answer":
        middleware = [f"{__name__}.Answer"]
    if VARIANT.startswith("djangodb"):
        url = urlsplit(os.environ["DJANGO_DB"])
        extra["DATABASES"] = {
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.path.lstrip("/"),
                "USER": url.username,
                "HOST": url.hostname,
                "PORT": str(url.port),
                "CONN_MAX_AGE": None,  # a connection per thread, kept
            }
        }
    elif VARIANT == "django-peer":
        middleware = ["idempotency_key.middleware.IdempotencyKeyMiddleware"]
        extra |= {
            "CACHES": {
                "default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": REDIS_URL}
            },
            "IDEMPOTENCY_KEY": {
                "CONFLICT_STATUS_CODE": None,
                "STORAGE": {
                    "CLASS": "idempotency_key.storage.CacheKeyStorage",
                    "CACHE_NAME": "default",
                },
                "LOCK": {
                    "CLASS": "idempotency_key.locks.redis.MultiProcessRedisLock",
                    "LOCATION": REDIS_URL,
                },
            },
        }
    settings.configure(
        SECRET_KEY="bench only",
        DEBUG=False,
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=middleware,
        USE_TZ=True,
        **extra,
    )
    django.setup()
    if VARIANT == "djangodb-records":
        from django.core.management import call_command

        call_command("migrate", "goblin_idem", verbosity=0)  # the records' table
    globals()["urlpatterns"] = _urlpatterns()  # before the app: goblin-idem's loads them
    return get_wsgi_application()


class Answer:
    """django-answer: a middleware that answers every keyed request at once with a response
    it makes (no store, no view), which no replay inside MIDDLEWARE can beat: Django's own
    handling of a request and a response, for wsgi_instructions.py."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        from django.http import HttpResponse

        if "HTTP_IDEMPOTENCY_KEY" not in request.META:
            return self.get_response(request)
        return HttpResponse(b'{"id": 1, "sku": "A-1"}', status=201, headers=ANSWERED)


ANSWERED = {"Content-Type": "application/json", "Idempotent-Replayed": "true"}


def _orders(request: Any) -> Any:
    from django.http import JsonResponse

    STATS["handler_calls"] += 1
    data = json.loads(request.body)
    if VARIANT.startswith("djangodb"):
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO orders (sku, qty) VALUES (%s, %s) RETURNING id",
                [data["sku"], data["qty"]],
            )
            return JsonResponse({"id": cursor.fetchone()[0], "sku": data["sku"]}, status=201)
    return JsonResponse({"id": STATS["handler_calls"], "sku": data["sku"]}, status=201)


def _stats(request: Any) -> Any:
    from django.http import JsonResponse

    return JsonResponse(STATS)


def _urlpatterns() -> list[Any]:
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    view = csrf_exempt(_orders)
    if VARIANT == "django-peer":  # keys optional, as they are for the others
        from idempotency_key.decorators import idempotency_key

        view = idempotency_key(optional=True)(view)
    return [path("orders", view), path("__stats", _stats)]


if VARIANT.startswith("django"):
    app = django_app()
elif VARIANT.startswith("flasksql"):
    app = flasksql_app()
else:
    app = flask_app()
