"""goblin_idem.flask.Idempotency in process: the WSGI middleware around a Flask app, and
``@idempotent`` marks found with Flask's URL map (function views, MethodView classes and
their methods, blueprints). Under gunicorn: tests/wsgi/test_servers.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from flask import Flask

from goblin_idem import MemoryStore, RedisStore
from goblin_idem.flask import Idempotency
from tests.support.apps import counting
from tests.support.apps.flask_app import create_app
from tests.support.servers import Server
from tests.support.webhooks import delivery, event_body, forged
from tests.support.wsgi import call

BODY = b'{"amount": 5}'
JSON = [("Content-Type", "application/json")]


@pytest.fixture
def app() -> Flask:
    return create_app(MemoryStore())


def post(app: Flask, path: str, key: str | None = None, method: str = "POST") -> Any:
    return call(app.wsgi_app, method, path, BODY, JSON, key=key)


def test_a_view_runs_once_per_key_and_is_replayed(app: Flask) -> None:
    first = post(app, "/work", "flask-1")
    again = post(app, "/work", "flask-1")
    assert first.code == 201 and first.json()["body"] == {"amount": 5}
    assert again.body == first.body and again.header("Idempotent-Replayed") == "true"
    assert counting.count("flask-1") == 2  # one run, and this count


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/required", "POST"),
        ("/payments", "POST"),
        ("/refunds", "POST"),
        ("/shop/orders/7", "POST"),
    ],
)
def test_marks_on_views_classes_methods_and_blueprints_require_a_key(
    app: Flask, path: str, method: str
) -> None:
    missing = post(app, path, method=method)
    assert missing.code == 400 and missing.header("Content-Type") == "application/problem+json"
    assert post(app, path, f"{path}-k", method).code == 201


def test_an_unmarked_method_and_an_exempt_view_are_not_required_or_covered(app: Flask) -> None:
    assert post(app, "/refunds", method="PATCH").code == 200  # the class's other method
    assert post(app, "/exempt", "exempt-k").json()["run"] == 1
    assert post(app, "/exempt", "exempt-k").json()["run"] == 2  # enabled=False: not covered
    assert post(app, "/missing", "k").code == 404


def test_init_app_and_refused_options() -> None:
    extension = Idempotency(store=MemoryStore())
    app = Flask(__name__)

    @app.post("/pay")
    def pay() -> tuple[str, int]:
        return "paid", 201

    extension.init_app(app)
    assert call(app.wsgi_app, "POST", "/pay", key="k").code == 201
    assert call(app.wsgi_app, "POST", "/pay", key="k").header("Idempotent-Replayed") == "true"
    with pytest.raises(ValueError, match="ttl_seconds must be >= 1"):
        Idempotency(Flask(__name__), ttl_seconds=0)


@pytest.mark.parametrize("provider", ["standard", "github"])
def test_a_webhook_view_runs_a_genuine_delivery_once_after_a_forged_one(
    redis_server: Server, provider: str
) -> None:
    """``@webhook(provider)`` on a Flask view: the forged delivery (first, with the genuine
    one's id) is refused before the claim; the genuine one runs once and is replayed."""
    app = create_app(RedisStore.from_url(redis_server.url))
    event_id = f"evt_{uuid.uuid4().hex}"
    ref = uuid.uuid4().hex
    genuine = delivery(provider, event_id, event_body(event_id, ref))
    bad = forged(genuine)
    refused = call(app.wsgi_app, "POST", bad.path, bad.body, list(bad.headers.items()))
    assert refused.code == 401 and refused.json()["type"].endswith("webhook-unverified")
    middleware = Idempotency.middleware(app)
    assert middleware.counters.claimed == 0 and middleware.counters.webhook_refused == 1
    first = call(app.wsgi_app, "POST", genuine.path, genuine.body, list(genuine.headers.items()))
    assert first.code == 200 and first.json() == {"run": 1, "size": len(genuine.body)}
    again = call(app.wsgi_app, "POST", genuine.path, genuine.body, list(genuine.headers.items()))
    assert again.body == first.body and again.header("Idempotent-Replayed") == "true"
    assert counting.count(f"hook:{ref}") == 2  # one run, and this count


def test_a_config_key_that_names_no_option_stops_startup() -> None:
    app = Flask(__name__)
    app.config["GOBLIN_IDEM_LEASE"] = 5
    with pytest.raises(
        ValueError, match=r"app.config\['GOBLIN_IDEM_LEASE'\] names no .*LEASE_SECONDS"
    ):
        Idempotency().init_app(app, store=MemoryStore())
    app.config["GOBLIN_IDEM_STORE"] = "postgres://db"
    del app.config["GOBLIN_IDEM_LEASE"]
    with pytest.raises(ValueError, match="GOBLIN_IDEM_STORE"):
        Idempotency(app)


def test_init_app_arguments_win_over_the_constructor_and_the_config() -> None:
    app = Flask(__name__)
    app.config["GOBLIN_IDEM_LEASE_SECONDS"] = 5
    app.config["GOBLIN_IDEM_TTL_SECONDS"] = 60
    Idempotency(lease_seconds=7, store=MemoryStore()).init_app(app, ttl_seconds=90)
    core = Idempotency.middleware(app).core
    assert core.routes.defaults.lease_ms == 7000 and core.routes.defaults.ttl_ms == 90_000


@pytest.mark.parametrize(
    ("where", "told"),
    [
        ("config", r"app.config\['GOBLIN_IDEM_TTL_SECONDS'\]: ttl_seconds must be >= 1"),
        ("constructor", r"Idempotency\(ttl_seconds=...\): ttl_seconds must be >= 1"),
        ("init_app", r"init_app\(ttl_seconds=...\): ttl_seconds must be >= 1"),
    ],
)
def test_a_refused_option_names_the_config_key_or_the_argument(where: str, told: str) -> None:
    """The app's config and both calls may set one option: the error names the one to
    change, as Django's names its settings.GOBLIN_IDEM key."""
    app = Flask(__name__)
    extension = Idempotency(
        store=MemoryStore(), **({"ttl_seconds": 0} if where == "constructor" else {})
    )
    if where == "config":
        app.config["GOBLIN_IDEM_TTL_SECONDS"] = 0
    with pytest.raises(ValueError, match=told):
        extension.init_app(app, **({"ttl_seconds": 0} if where == "init_app" else {}))


def test_a_refused_store_names_where_it_was_given() -> None:
    app = Flask(__name__)
    app.config["GOBLIN_IDEM_STORE"] = 6379
    with pytest.raises(TypeError, match=r"app.config\['GOBLIN_IDEM_STORE'\]: store must be"):
        Idempotency(app)
    with pytest.raises(ValueError, match=r"init_app\(store=...\) must be a store, a redis://"):
        Idempotency().init_app(Flask(__name__), store="localhost:6379")  # type: ignore[arg-type]
