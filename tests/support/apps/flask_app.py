"""A Flask app for the sync integration's tests, served by gunicorn or in process:
REDIS_URL names the store (the embedded MemoryStore if unset), LEASE_SECONDS its lease.
Runs are counted by tests.support.apps.counting (``runs:<key>``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from flask import Blueprint, Flask, Response, jsonify, request
from flask.views import MethodView

from goblin_idem import MemoryStore, RedisStore, Store, current_claim
from goblin_idem.flask import Idempotency, idempotent
from goblin_idem.webhooks import GitHub, StandardWebhooks, webhook
from tests.support.apps import counting
from tests.support.apps.webhook_app import GITHUB_SECRETS, STANDARD_SECRETS


def key() -> str:
    return request.headers.get("Idempotency-Key", "-")


def create_app(store: Store | None = None, **options: Any) -> Flask:
    app = Flask(__name__)

    @app.get("/health")
    def health() -> str:
        return "ok"

    @app.post("/work")
    def work() -> Any:
        """Counts its run, works for the Work-Ms header's milliseconds (a header, so that a
        retry of the request may work less), checks its claim, answers 201."""
        run = counting.count(key())
        counting.note(f"pid:{key()}", os.getpid())  # the worker a test may kill mid-run
        time.sleep(int(request.headers.get("Work-Ms", "0")) / 1000)
        claim = current_claim()
        if claim is not None:
            claim.ensure_owned()
        return jsonify(pid=os.getpid(), run=run, body=request.get_json(silent=True)), 201

    @app.post("/stream")
    def stream() -> Response:
        counting.count(key())
        size = int(request.args.get("kb", "4"))
        return Response((b"x" * 1024 for _ in range(size)), status=201)

    @app.post("/required")
    @idempotent(required=True)
    def required() -> Any:
        return jsonify(run=counting.count(key())), 201

    @app.post("/exempt")
    @idempotent(enabled=False)
    def exempt() -> Any:
        return jsonify(run=counting.count(key())), 201

    @idempotent(required=True)
    class Payments(MethodView):
        def post(self) -> Any:
            return jsonify(run=counting.count(key())), 201

    class Refunds(MethodView):
        @idempotent(required=True)
        def post(self) -> Any:
            return jsonify(run=counting.count(key())), 201

        def patch(self) -> Any:
            return jsonify(run=counting.count(key()))

    app.add_url_rule("/payments", view_func=Payments.as_view("payments"))
    app.add_url_rule("/refunds", view_func=Refunds.as_view("refunds"))
    shop = Blueprint("shop", __name__, url_prefix="/shop")

    @shop.post("/orders/<int:order>")
    @idempotent(required=True, lease_seconds=5)
    def order(order: int) -> Any:
        return jsonify(run=counting.count(key()), order=order), 201

    app.register_blueprint(shop)

    @app.post("/hooks/standard")
    @webhook(StandardWebhooks(secrets=STANDARD_SECRETS))
    def standard_hook() -> Any:
        event = request.get_json(force=True)
        return jsonify(run=counting.count(f"hook:{event['ref']}"), size=len(request.data))

    @app.post("/hooks/github")
    @webhook(GitHub(secrets=GITHUB_SECRETS))
    def github_hook() -> Any:
        event = request.get_json(force=True)
        return jsonify(run=counting.count(f"hook:{event['ref']}"), size=len(request.data))

    Idempotency(app, store=store, **options)
    return app


def create_configured() -> Flask:
    """An app factory's app: its options in app.config (``GOBLIN_IDEM_*``: the store's URL,
    another key header, every route requiring a key, and FLASK_CONFIG's JSON object) and in
    ``init_app``'s arguments."""
    app = Flask(__name__)
    app.config["GOBLIN_IDEM_STORE"] = os.environ.get("REDIS_URL", "memory")
    app.config["GOBLIN_IDEM_HEADER"] = "X-Request-Key"
    app.config["GOBLIN_IDEM_REQUIRED"] = True
    app.config.update(json.loads(os.environ.get("FLASK_CONFIG", "{}")))  # a test's own

    @app.get("/health")
    def health() -> str:
        return "ok"

    @app.post("/work")
    def work() -> Any:
        return jsonify(run=counting.count(request.headers.get("X-Request-Key", "-"))), 201

    extension = Idempotency()
    extension.init_app(app, lease_seconds=int(os.environ.get("LEASE_SECONDS", "30")))
    return app


def _store() -> Store:
    """REDIS_URL's store, with a replay cache of REPLAY_CACHE_BYTES if set."""
    url = os.environ.get("REDIS_URL")
    budget = int(os.environ.get("REPLAY_CACHE_BYTES", "0"))
    return RedisStore.from_url(url, replay_cache_bytes=budget) if url else MemoryStore()


app = create_app(_store(), lease_seconds=int(os.environ.get("LEASE_SECONDS", "30")))
configured = create_configured()
