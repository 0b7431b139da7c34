"""Statuses that say a request was not processed are not its outcome: nothing is stored and
the key is released, so the retry runs the handler. End to end: a FastAPI app under uvicorn
on redis-server (tests.support.apps.outcome_app), called by httpx and by this project's own
retrying transport; the option that changes the rule, on the middleware, on a route mark and
through the WSGI adapter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import redis
from flask import Flask

from goblin_idem import IdempotencyMiddleware, RedisStore, idempotent
from goblin_idem.client import AsyncIdempotentTransport, RetryPolicy
from goblin_idem.flask import Idempotency
from tests.support.procs import APPS, start_uvicorn, stop
from tests.support.servers import Server, free_port
from tests.support.wsgi import call

BODY = b'{"amount": 500}'
NOT_PROCESSED = (401, 403, 408, 423, 425, 429)


@pytest.fixture
async def served(redis_server: Server) -> AsyncIterator[httpx.AsyncClient]:
    await redis_server.client().flushall()
    port = free_port()
    proc = start_uvicorn(port, {"REDIS_URL": redis_server.url}, app=f"{APPS}.outcome_app:app")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            yield http
    finally:
        stop(proc)


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


async def test_a_status_that_says_nothing_ran_is_not_kept(served: httpx.AsyncClient) -> None:
    """Each refusal reaches its client as the app sent it (Retry-After included); the retry
    with the same key runs the handler, and that run's 201 is what duplicates replay."""
    for status in NOT_PROCESSED:
        headers = {"Idempotency-Key": f"k-{status}"}
        first = await served.post(f"/refuse/{status}", content=BODY, headers=headers)
        assert first.status_code == status and first.headers["retry-after"] == "1"
        assert not replayed(first)
        retry = await served.post(f"/refuse/{status}", content=BODY, headers=headers)
        assert retry.status_code == 201, (status, retry.text)
        assert not replayed(retry) and retry.json()["run"] == 2
        again = await served.post(f"/refuse/{status}", content=BODY, headers=headers)
        assert again.status_code == 201 and replayed(again) and again.content == retry.content
    counters = (await served.get("/stats")).json()
    assert (counters["released"], counters["replayed"]) == (len(NOT_PROCESSED), 6)


async def test_the_retrying_transport_gets_the_second_runs_answer(
    served: httpx.AsyncClient,
) -> None:
    """AsyncIdempotentTransport retries a 429 after its Retry-After, with the same key: the
    handler runs again and the call ends with that run's 201, not the 429 replayed."""
    transport = AsyncIdempotentTransport(policy=RetryPolicy(budget=None, max_delay=2))
    async with httpx.AsyncClient(
        base_url=served.base_url, transport=transport, timeout=10
    ) as client:
        response = await client.post("/refuse/429", content=BODY)
    assert response.status_code == 201 and response.json()["run"] == 2
    assert not replayed(response)


async def test_a_route_mark_keeps_its_refusals(served: httpx.AsyncClient) -> None:
    """``@idempotent(outcome=range(100, 500))``: the route's 429 is its outcome, replayed
    with its Retry-After to every retry, and the handler runs once."""
    headers = {"Idempotency-Key": "kept-429"}
    first = await served.post("/kept/429", content=BODY, headers=headers)
    again = await served.post("/kept/429", content=BODY, headers=headers)
    assert first.status_code == again.status_code == 429
    assert replayed(again) and again.headers["retry-after"] == "1"
    assert again.content == first.content


async def test_the_middlewares_outcome_option(redis_server: Server) -> None:
    """``outcome={201, 429}`` on the middleware: a 429 is stored and replayed, a 401 (not
    named) is released."""
    await redis_server.client().flushall()
    port = free_port()
    env = {"REDIS_URL": redis_server.url, "OUTCOME": "201,429"}
    proc = start_uvicorn(port, env, app=f"{APPS}.outcome_app:app")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for status, kept in ((429, True), (401, False)):
                headers = {"Idempotency-Key": f"o-{status}"}
                first = await http.post(f"/refuse/{status}", content=BODY, headers=headers)
                again = await http.post(f"/refuse/{status}", content=BODY, headers=headers)
                assert first.status_code == status
                assert (again.status_code, replayed(again)) == (
                    (status, True) if kept else (201, False)
                )
    finally:
        stop(proc)


def test_the_wsgi_adapter_takes_the_option(redis_server: Server) -> None:
    """Flask, through the WSGI middleware, on redis-server: a 429 released by default, and
    stored with ``outcome=``."""
    redis.Redis.from_url(redis_server.url).flushall()
    runs: list[int] = []

    def make(**options: object) -> Flask:
        app = Flask(__name__)

        @app.post("/pay")
        def pay() -> tuple[str, int, dict[str, str]]:
            runs.append(1)
            return ("slow down", 429, {"Retry-After": "1"}) if len(runs) == 1 else ("paid", 201, {})

        Idempotency(app, store=RedisStore.from_url(redis_server.url), **options)
        return app

    default = make()
    assert call(default.wsgi_app, "POST", "/pay", BODY, key="w-1").code == 429
    assert call(default.wsgi_app, "POST", "/pay", BODY, key="w-1").code == 201
    runs.clear()
    kept = make(outcome=lambda status: status < 500)
    assert call(kept.wsgi_app, "POST", "/pay", BODY, key="w-2").code == 429
    again = call(kept.wsgi_app, "POST", "/pay", BODY, key="w-2")
    assert again.code == 429 and again.header("Idempotent-Replayed") == "true"
    assert len(runs) == 1


@pytest.mark.parametrize(
    ("outcome", "error", "words"),
    [
        ("429", TypeError, ["outcome", "function of the status", "range(200, 300)"]),
        (429, TypeError, ["outcome", "collection of statuses"]),
        ([200, "201"], TypeError, ["outcome", "statuses (int)", "a str"]),
        ([200, 99], ValueError, ["outcome", "99", "100 to 599"]),
        ([], ValueError, ["outcome", "no status", "leave it out"]),
        (lambda status: "yes", TypeError, ["outcome", "True or False", "a str"]),
        (lambda status: 1 / 0, ValueError, ["outcome", "ZeroDivisionError", "100 to 599"]),
        (lambda status: False, ValueError, ["outcome", "false for every status"]),
    ],
)
def test_a_wrong_outcome_is_refused_at_startup(
    outcome: object, error: type[Exception], words: list[str]
) -> None:
    async def app(scope: object, receive: object, send: object) -> None: ...

    for build in (
        lambda: IdempotencyMiddleware(app, outcome=outcome),
        lambda: idempotent(outcome=outcome),
    ):
        with pytest.raises(error) as caught:
            build()
        for word in words:
            assert word in str(caught.value)


def test_outcome_and_store_server_errors_are_one_choice() -> None:
    async def app(scope: object, receive: object, send: object) -> None: ...

    with pytest.raises(ValueError, match="drop store_server_errors"):
        IdempotencyMiddleware(app, outcome=range(200, 600), store_server_errors=True)
