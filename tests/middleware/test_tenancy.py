"""Whose key is it, and where the middleware sits: the warning for callers that share the
default scope, the ready scopes for API keys and session cookies, and the order relative to
GZipMiddleware and CORSMiddleware."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, MemoryStore, Store, cookie_scope, header_scope
from tests.support.asgi import Handler, Reply, request

SHARED = "carries no Authorization header"


def shared_scope_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if SHARED in r.getMessage()]


# -- callers that share the default scope ---------------------------------------------------


@pytest.mark.parametrize(
    ("header", "value"),
    [("Cookie", "session_id=s3cr3t-one"), ("X-API-Key", "s3cr3t-one"), ("X-Auth-Token", "s3cr3t")],
)
async def test_a_credential_without_authorization_is_warned_once(
    caplog: pytest.LogCaptureFixture, header: str, value: str
) -> None:
    mw = IdempotencyMiddleware(Handler(), store=MemoryStore())
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        for i in range(3):
            await request(mw, key=f"order-{i}", headers=[(header, value + str(i))])
    warnings = shared_scope_warnings(caplog)
    assert len(warnings) == 1
    assert f"a {header.lower()} header" in warnings[0] and "scope=" in warnings[0]
    assert "s3cr3t" not in warnings[0] and "order-" not in warnings[0]


@pytest.mark.parametrize(
    ("headers", "options"),
    [
        ([("Authorization", "Bearer a"), ("Cookie", "session_id=1")], {}),  # scoped by it
        ([("Cookie", "session_id=1")], {"scope": cookie_scope("session_id")}),  # chosen
        ([("User-Agent", "curl"), ("X-Request-Id", "7")], {}),  # anonymous, no credential
    ],
)
async def test_no_warning_when_the_scope_tells_callers_apart(
    caplog: pytest.LogCaptureFixture, headers: list[tuple[str, str]], options: dict[str, object]
) -> None:
    mw = IdempotencyMiddleware(Handler(), store=MemoryStore(), **options)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        await request(mw, key="k", headers=headers)
    assert shared_scope_warnings(caplog) == []


async def test_the_api_key_scope_separates_key_holders(store: Store) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store, scope=header_scope("X-API-Key"))
    alice = await request(mw, key="k", headers=[("X-API-Key", "key-alice")])
    bob = await request(mw, key="k", headers=[("X-API-Key", "key-bob")])
    again = await request(mw, key="k", headers=[("X-API-Key", "key-alice")])
    assert [alice.body, bob.body, again.body] == [b"run 1", b"run 2", b"run 1"]
    assert again.header("idempotent-replayed") == b"true" and handler.runs == 2


async def test_the_cookie_scope_separates_sessions() -> None:
    handler = Handler(headers=[(b"set-cookie", b"cart=1")])
    mw = IdempotencyMiddleware(handler, store=MemoryStore(), scope=cookie_scope("session_id"))
    one = [("Cookie", "theme=dark; session_id=one")]
    await request(mw, key="k", headers=one)
    other = await request(mw, key="k", headers=[("Cookie", "session_id=two; theme=dark")])
    same = await request(mw, key="k", headers=[("Cookie", 'theme=light; session_id="one"')])
    assert other.body == b"run 2" and other.header("idempotent-replayed") is None
    assert same.body == b"run 1" and same.header("idempotent-replayed") == b"true"


# -- the order relative to GZip and CORS ----------------------------------------------------

PAYLOAD = {"items": ["x" * 40] * 40}  # well above GZipMiddleware's minimum_size


def order_app(goblin_inside: bool, runs: list[int]) -> Starlette:
    async def create(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse(PAYLOAD, status_code=201)

    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    # add_middleware wraps what was added before it: the first added is the innermost.
    outer = [
        (GZipMiddleware, {"minimum_size": 100}),
        (CORSMiddleware, {"allow_origins": ["https://a.example", "https://b.example"]}),
    ]
    if goblin_inside:
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    for cls, options in outer:
        app.add_middleware(cls, **options)  # type: ignore[arg-type]
    if not goblin_inside:
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    return app


async def post_order(app: Starlette, origin: str, encoding: str) -> Reply:
    headers = [("Origin", origin), ("Accept-Encoding", encoding)]
    return await request(app, path="/orders", key="order-1", headers=headers)


def payload_of(reply: Reply) -> object:
    encoded = reply.header("content-encoding") == b"gzip"
    return json.loads(gzip.decompress(reply.body) if encoded else reply.body)


async def test_inside_gzip_and_cors_each_duplicate_gets_its_own_encoding_and_origin() -> None:
    runs: list[int] = []
    app = order_app(goblin_inside=True, runs=runs)
    first = await post_order(app, "https://a.example", "gzip")
    plain = await post_order(app, "https://b.example", "identity")
    zipped = await post_order(app, "https://b.example", "gzip")
    assert first.header("content-encoding") == b"gzip"
    assert plain.header("content-encoding") is None  # this client did not accept gzip
    assert zipped.header("content-encoding") == b"gzip"
    assert plain.header("access-control-allow-origin") == b"https://b.example"
    for reply in (first, plain, zipped):
        assert reply.status == 201 and payload_of(reply) == PAYLOAD
    assert plain.header("idempotent-replayed") == zipped.header("idempotent-replayed") == b"true"
    assert runs == [1]


async def test_outside_gzip_and_cors_a_duplicate_gets_the_first_callers_variant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The wrong order, and what the middleware says about it (once)."""
    runs: list[int] = []
    app = order_app(goblin_inside=False, runs=runs)
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        await post_order(app, "https://a.example", "gzip")
        plain = await post_order(app, "https://b.example", "identity")
        await request(app, path="/orders", key="order-2", headers=[("Accept-Encoding", "gzip")])
    assert plain.header("content-encoding") == b"gzip"  # though the client did not accept it
    assert plain.header("access-control-allow-origin") == b"https://a.example"
    warnings = [r.getMessage() for r in caplog.records if "(its Vary header)" in r.getMessage()]
    assert len(warnings) == 1
    assert "accept-encoding, origin" in warnings[0]
    assert "add IdempotencyMiddleware before it" in warnings[0]
