"""IdempotencyMiddleware, rule by rule, on MemoryStore and on real Redis/Valkey servers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.types import Message, Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore, Store, idempotent
from goblin_idem._keys import key_names
from goblin_idem.records._format import decode
from tests.support.asgi import Handler, problem, request
from tests.support.backends import Backend, stored_items
from tests.support.servers import Server, free_port
from tests.support.waits import until

# A key that no log line or stored byte could contain by chance.
RAW_KEY = "order-7f3a9c-raw-key"


# -- the main flow, on every store ------------------------------------------------------------


async def test_first_request_runs_and_duplicates_replay_byte_for_byte(store: Store) -> None:
    handler = Handler(headers=[(b"content-type", b"application/json"), (b"x-trace", b"1")])
    mw = IdempotencyMiddleware(handler, store=store)
    first = await request(mw, key="k1", body=b'{"amount": 100}')
    assert (first.status, first.body) == (201, b"run 1")
    for _ in range(3):
        again = await request(mw, key="k1", body=b'{"amount": 100}')
        assert again.status == 201
        assert again.body == first.body
        assert again.header("idempotent-replayed") == b"true"
        assert again.without("idempotent-replayed") == [*first.headers, (b"content-length", b"5")]
    assert handler.runs == 1
    assert handler.bodies == [b'{"amount": 100}']
    assert mw.counters.claimed == 1 and mw.counters.replayed == 3


async def test_same_key_other_request_is_422(store: Store) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    assert (await request(mw, key="k", body=b"a", path="/p", query=b"x=1")).status == 201
    for kwargs in (
        {"body": b"b", "path": "/p", "query": b"x=1"},
        {"body": b"a", "path": "/q", "query": b"x=1"},
        {"body": b"a", "path": "/p", "query": b"x=2"},
        {"body": b"a", "path": "/p", "query": b"x=1", "method": "PATCH"},
    ):
        reply = await request(mw, key="k", **kwargs)  # type: ignore[arg-type]
        assert reply.status == 422
        assert problem(reply)["type"] == "urn:goblin-idem:problem:key-reused"
    assert handler.runs == 1 and mw.counters.mismatch == 4


async def test_duplicate_in_flight_gets_409_with_retry_after(store: Store) -> None:
    handler = Handler(gate=asyncio.Event())
    mw = IdempotencyMiddleware(handler, store=store, retry_after_seconds=2)
    first = asyncio.create_task(request(mw, key="k"))
    await until(lambda: handler.runs == 1, what="the first run started")
    racing = await request(mw, key="k")
    assert racing.status == 409 and racing.header("retry-after") == b"2"
    assert problem(racing)["type"] == "urn:goblin-idem:problem:in-flight"
    handler.gate.set()  # type: ignore[union-attr]
    assert (await first).status == 201
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"
    assert handler.runs == 1


async def test_wait_seconds_turns_an_in_flight_duplicate_into_a_replay(store: Store) -> None:
    handler = Handler(delay=0.3)
    mw = IdempotencyMiddleware(handler, store=store, wait_seconds=2, poll_interval_seconds=0.02)
    first = asyncio.create_task(request(mw, key="k"))
    await until(lambda: handler.runs == 1, what="the first run started")
    waited = await request(mw, key="k")
    assert waited.status == 201 and waited.header("idempotent-replayed") == b"true"
    assert waited.body == (await first).body
    assert handler.runs == 1


async def test_exception_releases_the_claim_and_propagates(store: Store) -> None:
    handler = Handler(raises=RuntimeError("card network down"))
    mw = IdempotencyMiddleware(handler, store=store)
    with pytest.raises(RuntimeError, match="card network down"):
        await request(mw, key="k")
    handler.raises = None
    assert (await request(mw, key="k")).body == b"run 2"  # the retry ran the work
    assert mw.counters.released == 1


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_server_errors_are_not_stored(store: Store, status: int) -> None:
    handler = Handler(status=status)
    mw = IdempotencyMiddleware(handler, store=store)
    assert (await request(mw, key="k")).status == status
    handler.status = 201
    assert (await request(mw, key="k")).status == 201
    assert handler.runs == 2


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_redirects_that_repeat_the_request_release_the_key(store: Store, status: int) -> None:
    """307 and 308 send the same request elsewhere: the key is released. 301, 302 and 303
    are the request's outcome (a client follows them with a GET), stored and replayed."""
    handler = Handler(status=status, headers=[(b"location", b"/elsewhere")], chunks=[b""])
    mw = IdempotencyMiddleware(handler, store=store)
    assert (await request(mw, key="k")).status == status
    again = await request(mw, key="k")
    if status in (307, 308):
        assert again.header("idempotent-replayed") is None
        assert handler.runs == 2 and mw.counters.released == 2
    else:
        assert again.status == status and again.header("idempotent-replayed") == b"true"
        assert handler.runs == 1 and mw.counters.released == 0


async def test_store_server_errors_option_stores_5xx(store: Store) -> None:
    handler = Handler(status=500)
    mw = IdempotencyMiddleware(handler, store=store, store_server_errors=True)
    assert (await request(mw, key="k")).status == 500
    again = await request(mw, key="k")
    assert again.status == 500 and again.header("idempotent-replayed") == b"true"
    assert handler.runs == 1


async def test_client_errors_are_stored(store: Store) -> None:
    handler = Handler(status=402)
    mw = IdempotencyMiddleware(handler, store=store)
    await request(mw, key="k")
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"
    assert handler.runs == 1


async def test_concurrent_storm_on_one_key_runs_once(store: Store) -> None:
    handler = Handler(delay=0.2, headers=[(b"content-type", b"application/json")])
    mw = IdempotencyMiddleware(handler, store=store, retry_after_seconds=1)
    replies = await asyncio.gather(*(request(mw, key="storm", body=b"x") for _ in range(200)))
    assert handler.runs == 1
    original = [r for r in replies if r.status == 201 and r.header("idempotent-replayed") is None]
    assert len(original) == 1
    for r in replies:
        if r.status == 409:
            assert r.header("retry-after") == b"1"
        else:
            assert (r.status, r.body) == (201, original[0].body)
    after = await request(mw, key="storm", body=b"x")
    assert after.body == original[0].body and after.header("idempotent-replayed") == b"true"


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["", "x" * 256, "tab\there", "nul\x00", "é", "line\r\nbreak", "\x7f"]
)
async def test_invalid_key_is_400_and_runs_nothing(key: str) -> None:
    store = MemoryStore()
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    reply = await request(mw, key=key)
    assert reply.status == 400
    assert problem(reply)["type"] == "urn:goblin-idem:problem:invalid-key"
    assert handler.runs == 0 and len(store) == 0


async def test_two_key_headers_are_400() -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    reply = await request(mw, key="a", headers=[("Idempotency-Key", "b")])
    assert reply.status == 400 and "exactly one" in problem(reply)["detail"]
    assert handler.runs == 0


@pytest.mark.parametrize("key", ["a", "x" * 255, "order 42 {retry}", "~!@#$%^&*()_+"])
async def test_valid_keys(key: str) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    assert (await request(mw, key=key)).status == 201
    assert (await request(mw, key=key)).header("idempotent-replayed") == b"true"


async def test_custom_key_validator() -> None:
    mw = IdempotencyMiddleware(
        Handler(), store=MemoryStore(), key_pattern=lambda k: k.startswith(b"evt_")
    )
    assert (await request(mw, key="evt_1")).status == 201
    assert (await request(mw, key="x")).status == 400


async def test_body_too_large_by_content_length_or_stream() -> None:
    store = MemoryStore()
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store, max_body_bytes=10)
    declared = await request(mw, key="k", body=b"x" * 11, headers=[("content-length", "11")])
    streamed = await request(mw, key="k", body=[b"x" * 6, b"x" * 6])
    for reply in (declared, streamed):
        assert reply.status == 413
        assert problem(reply)["type"] == "urn:goblin-idem:problem:body-too-large"
    assert handler.runs == 0 and len(store) == 0
    assert (await request(mw, key="k", body=[b"x" * 5, b"x" * 5])).status == 201
    assert handler.bodies == [b"x" * 10]


async def test_client_gone_while_sending_the_body_claims_nothing() -> None:
    store = MemoryStore()
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    gone = asyncio.Event()
    gone.set()

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    from tests.support.asgi import http_scope

    await mw(http_scope(headers=[("Idempotency-Key", "k")]), receive, send)
    assert sent == [] and handler.runs == 0 and len(store) == 0


# -- which requests are covered -----------------------------------------------------------------


async def test_requests_without_a_key_pass_through_with_no_store_call() -> None:
    store = MemoryStore()
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    for _ in range(2):
        reply = await request(mw)
        assert reply.status == 201 and reply.header("idempotent-replayed") is None
    assert handler.runs == 2 and len(store) == 0


async def test_uncovered_methods_pass_through_even_with_a_key() -> None:
    handler = Handler(status=200)
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    for method in ("GET", "PUT", "DELETE", "HEAD"):
        await request(mw, method, key="k")
    assert handler.runs == 4
    mw = IdempotencyMiddleware(handler, store=MemoryStore(), methods=["put"])
    await request(mw, "PUT", key="k")
    await request(mw, "PUT", key="k")
    assert handler.runs == 5


async def test_required_rejects_a_missing_key() -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore(), required=True)
    reply = await request(mw, path="/payments")
    assert reply.status == 400
    data = problem(reply)
    assert data["type"] == "urn:goblin-idem:problem:missing-key"
    assert "Idempotency-Key" in data["detail"]
    assert handler.runs == 0 and mw.counters.missing_key == 1


async def test_include_exclude_and_required_paths() -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(
        handler,
        store=MemoryStore(),
        include=["/api/*"],
        exclude=["/api/internal/*"],
        required_paths=["/api/webhooks/*"],
    )
    # outside include, or excluded: no idempotency at all, even with a key
    for path in ("/other", "/api/internal/x"):
        await request(mw, path=path, key="k")
        await request(mw, path=path, key="k")
    assert handler.runs == 4
    assert (await request(mw, path="/api/webhooks/stripe")).status == 400
    assert (await request(mw, path="/api/payments")).status == 201  # optional there
    await request(mw, path="/api/payments", key="k")
    again = await request(mw, path="/api/payments", key="k")
    assert again.header("idempotent-replayed") == b"true"


async def test_non_http_scopes_pass_through_untouched() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    mw = IdempotencyMiddleware(app, store=MemoryStore(), required=True)

    async def nothing() -> Message:
        return {}

    async def ignore(message: Message) -> None:
        return None

    for kind in ("lifespan", "websocket"):
        await mw({"type": kind, "headers": [], "path": "/"}, nothing, ignore)
    assert seen == ["lifespan", "websocket"]


def fastapi_app(store: Store) -> tuple[FastAPI, dict[str, int]]:
    runs = {"plain": 0, "hook": 0, "exempt": 0, "short": 0}
    app = FastAPI()

    @app.post("/plain")
    async def plain() -> dict[str, int]:
        runs["plain"] += 1
        return {"n": runs["plain"]}

    @app.post("/hooks/{provider}")
    @idempotent(required=True)
    async def hook(provider: str) -> dict[str, str]:
        runs["hook"] += 1
        return {"provider": provider}

    @app.post("/exempt")
    @idempotent(enabled=False)
    async def exempt() -> dict[str, int]:
        runs["exempt"] += 1
        return {"n": runs["exempt"]}

    @app.post("/short")
    @idempotent(ttl_seconds=1)
    async def short() -> dict[str, int]:
        runs["short"] += 1
        return {"n": runs["short"]}

    app.add_middleware(IdempotencyMiddleware, store=store)
    return app, runs


async def test_route_decorator_in_fastapi() -> None:
    store = MemoryStore()
    app, runs = fastapi_app(store)
    assert (await request(app, path="/hooks/stripe")).status == 400  # required on this route
    assert (await request(app, path="/hooks/stripe", key="evt_1")).status == 200
    assert (await request(app, path="/hooks/stripe", key="evt_1")).status == 200
    assert runs["hook"] == 1
    assert (await request(app, path="/plain")).status == 200  # optional elsewhere
    for _ in range(2):
        await request(app, path="/exempt", key="k")
    assert runs["exempt"] == 2
    await request(app, path="/short", key="s")
    assert await store.pttl(key_names(b"idem", b"", b"s").result) <= 1000

    async def expired() -> bool:
        return await store.pttl(key_names(b"idem", b"", b"s").result) == -2

    await until(expired, what="the route's 1 s result expired")
    await request(app, path="/short", key="s")
    assert runs["short"] == 2  # the route's 1 s TTL, not the default day


async def test_route_decorator_inside_a_mount() -> None:
    runs = []

    @idempotent(required=True)
    async def hook(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"ok": True})

    inner = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
    app = Starlette(routes=[Mount("/v1", app=inner)])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    assert (await request(app, path="/v1/hook")).status == 400
    assert (await request(app, path="/v1/hook", key="k")).status == 200
    assert (await request(app, path="/v1/hook", key="k")).status == 200
    assert runs == [1]


# -- scope: whose key is it --------------------------------------------------------------------


async def test_callers_with_other_credentials_never_share_a_response(store: Store) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    alice = await request(mw, key="k", headers=[("Authorization", "Bearer alice")])
    bob = await request(mw, key="k", headers=[("Authorization", "Bearer bob")])
    anon = await request(mw, key="k")
    assert [alice.body, bob.body, anon.body] == [b"run 1", b"run 2", b"run 3"]
    again = await request(mw, key="k", headers=[("Authorization", "Bearer alice")])
    assert again.body == b"run 1"


async def test_scope_callable_overrides_credentials() -> None:
    handler = Handler()

    def tenant(scope: Scope) -> str:
        return dict(scope["headers"]).get(b"x-tenant", b"").decode()

    mw = IdempotencyMiddleware(handler, store=MemoryStore(), scope=tenant)
    await request(mw, key="k", headers=[("X-Tenant", "a"), ("Authorization", "one")])
    same = await request(mw, key="k", headers=[("X-Tenant", "a"), ("Authorization", "two")])
    assert same.header("idempotent-replayed") == b"true"
    await request(mw, key="k", headers=[("X-Tenant", "b")])
    assert handler.runs == 2


async def test_fingerprint_headers_option() -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore(), fingerprint_headers=["X-Currency"])
    await request(mw, key="k", headers=[("X-Currency", "EUR")])
    assert (await request(mw, key="k", headers=[("X-Currency", "USD")])).status == 422
    assert (await request(mw, key="k", headers=[("X-Currency", "EUR")])).status == 201


async def test_the_store_never_sees_the_raw_key(backend: Backend) -> None:
    store = backend.store
    mw = IdempotencyMiddleware(Handler(), store=store)
    secret = "customer-4242-order-{x}"
    assert (await request(mw, key=secret)).status == 201
    stored = await stored_items(store)
    assert len(stored) == 2
    for name, value in stored:
        assert secret.encode() not in name + value and b"4242" not in name + value
        assert name.startswith(b"idem:{") and name.count(b"{") == 1


# -- what is stored and replayed ----------------------------------------------------------------


async def test_streaming_response_replays_identically() -> None:
    handler = Handler(chunks=[b"part1,", b"", b"part2,", b"\x00\xffend"])
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    first = await request(mw, key="k")
    assert first.chunks == [b"part1,", b"", b"part2,", b"\x00\xffend"]
    again = await request(mw, key="k")
    assert again.body == first.body
    assert again.header("content-length") == str(len(first.body)).encode()


async def test_streaming_through_starlette() -> None:
    async def numbers(request: Request) -> StreamingResponse:
        async def gen() -> Any:
            for i in range(5):
                yield f"{i}\n".encode()

        return StreamingResponse(gen(), media_type="text/plain")

    app = Starlette(routes=[Route("/s", numbers, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    first = await request(app, path="/s", key="k")
    again = await request(app, path="/s", key="k")
    assert again.body == first.body == b"0\n1\n2\n3\n4\n"
    assert again.header("content-length") == b"10"
    assert again.header("transfer-encoding") is None


async def test_repeated_headers_kept_in_order_and_hop_by_hop_dropped() -> None:
    headers = [
        (b"set-cookie", b"a=1; Path=/"),
        (b"content-type", b"text/plain"),
        (b"set-cookie", b"b=2; HttpOnly"),
        (b"connection", b"keep-alive"),
        (b"transfer-encoding", b"chunked"),
        (b"x-empty", b""),
        (b"set-cookie", b"c=3"),
    ]
    mw = IdempotencyMiddleware(Handler(headers=headers), store=MemoryStore())
    await request(mw, key="k")
    again = await request(mw, key="k")
    assert again.without("idempotent-replayed") == [
        (b"set-cookie", b"a=1; Path=/"),
        (b"content-type", b"text/plain"),
        (b"set-cookie", b"b=2; HttpOnly"),
        (b"x-empty", b""),
        (b"set-cookie", b"c=3"),
        (b"content-length", b"5"),
    ]


@pytest.mark.parametrize("status", [204, 304])
async def test_bodiless_statuses(status: int) -> None:
    mw = IdempotencyMiddleware(
        Handler(status=status, headers=[], chunks=[b""]), store=MemoryStore()
    )
    await request(mw, key="k")
    again = await request(mw, key="k")
    assert (again.status, again.body) == (status, b"")
    assert again.headers == [(b"idempotent-replayed", b"true")]  # no Content-Length added


async def test_head_when_covered() -> None:
    mw = IdempotencyMiddleware(
        Handler(status=200, headers=[(b"content-length", b"42")], chunks=[b""]),
        store=MemoryStore(),
        methods=["HEAD"],
    )
    first = await request(mw, "HEAD", key="k")
    again = await request(mw, "HEAD", key="k")
    assert again.without("idempotent-replayed") == first.headers == [(b"content-length", b"42")]
    assert again.body == b""


async def test_empty_and_binary_request_bodies() -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    await request(mw, key="e", body=b"")
    await request(mw, key="b", body=[b"\x00\x01", b"\xff\xfe"])
    assert handler.bodies == [b"", b"\x00\x01\xff\xfe"]
    assert (await request(mw, key="b", body=b"\x00\x01\xff\xfe")).status == 201
    assert (await request(mw, key="b", body=b"\x00\x01\xff")).status == 422


async def test_response_too_large_is_delivered_but_not_replayed(store: Store) -> None:
    handler = Handler(chunks=[b"x" * 600, b"y" * 600])
    mw = IdempotencyMiddleware(handler, store=store, max_response_bytes=1000)
    first = await request(mw, key="k")
    assert first.body == b"x" * 600 + b"y" * 600  # the client got all of it
    again = await request(mw, key="k")
    assert again.status == 409 and again.header("retry-after") is None
    assert problem(again)["type"] == "urn:goblin-idem:problem:not-replayable"
    assert handler.runs == 1 and mw.counters.too_large == 1


async def test_a_response_of_exactly_max_response_bytes_replays_whole(store: Store) -> None:
    """The limit is inclusive: 1000 bytes (in two chunks) of a 1000-byte limit replay, one
    byte more does not."""
    handler = Handler(chunks=[b"x" * 600, b"y" * 400])
    mw = IdempotencyMiddleware(handler, store=store, max_response_bytes=1000)
    first = await request(mw, key="k-at")
    again = await request(mw, key="k-at")
    assert again.header("idempotent-replayed") == b"true"
    assert again.body == first.body == b"x" * 600 + b"y" * 400
    assert again.header("content-length") == b"1000"
    handler.chunks = [b"x" * 600, b"y" * 401]
    assert len((await request(mw, key="k-over")).body) == 1001
    over = await request(mw, key="k-over")
    assert over.status == 409 and problem(over)["type"].endswith(":not-replayable")
    assert handler.runs == 2 and mw.counters.too_large == 1


async def test_a_mismatch_under_a_not_replayable_key_is_422(store: Store) -> None:
    """Another request under a key whose response was too large to store is a client bug
    (422 key-reused), not a duplicate to be told the work is done (409 not-replayable)."""
    handler = Handler(chunks=[b"x" * 2000])
    mw = IdempotencyMiddleware(handler, store=store, max_response_bytes=1000)
    assert (await request(mw, key="k", body=b"a")).status == 201
    other = await request(mw, key="k", body=b"b")
    assert other.status == 422 and problem(other)["type"].endswith(":key-reused")
    same = await request(mw, key="k", body=b"a")
    assert same.status == 409 and problem(same)["type"].endswith(":not-replayable")
    assert handler.runs == 1 and (mw.counters.mismatch, mw.counters.not_replayable) == (1, 1)


async def test_a_response_over_the_stores_value_limit_is_delivered_but_not_replayed(
    store: Store,
) -> None:
    """Within max_response_bytes, but more than the store takes (its max_value_bytes, at
    most what its server accepts): kept as a response over max_response_bytes is."""
    store.max_value_bytes = 1000  # type: ignore[attr-defined]
    body = secrets.token_bytes(1200)  # that compression cannot shrink
    handler = Handler(chunks=[body[:600], body[600:]])
    mw = IdempotencyMiddleware(handler, store=store, max_response_bytes=10_000)
    first = await request(mw, key="k")
    assert first.body == body
    again = await request(mw, key="k")
    assert again.status == 409 and again.header("retry-after") is None
    assert problem(again)["type"] == "urn:goblin-idem:problem:not-replayable"
    assert handler.runs == 1 and mw.counters.too_large == 1
    assert mw.counters.publish_errors == 0


async def test_a_response_over_the_servers_limit_fails_nothing_else(own_redis: Server) -> None:
    """A server that takes values of 1 MiB at most, and a response of 1 MiB (the default
    max_response_bytes) whose record is larger: it is kept as too large to replay, and the
    requests running with it, whose store calls share its connection, all complete."""
    with own_redis.sync_client() as c:
        c.config_set("proto-max-bulk-len", 1024 * 1024)

    big = secrets.token_bytes(1024 * 1024)  # that compression cannot shrink

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        body = big if scope["path"] == "/big" else b"small"
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body})

    store = RedisStore.from_url(own_redis.url)
    mw = IdempotencyMiddleware(app, store=store)
    try:
        await store.detect()
        paths = ["/small"] * 12 + ["/big"] + ["/small"] * 12
        replies = await asyncio.gather(
            *(request(mw, path=p, key=f"k{i}") for i, p in enumerate(paths))
        )
        assert [r.status for r in replies] == [201] * 25
        assert replies[12].body == big
        again = await asyncio.gather(
            *(request(mw, path=p, key=f"k{i}") for i, p in enumerate(paths))
        )
        assert [r.status for r in again] == [201] * 12 + [409] + [201] * 12
        assert problem(again[12])["type"] == "urn:goblin-idem:problem:not-replayable"
        assert mw.counters.too_large == 1 and mw.counters.publish_errors == 0
        assert mw.counters.store_errors == 0
    finally:
        await store.aclose()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chunks=st.lists(st.binary(max_size=300), min_size=1, max_size=5),
    headers=st.lists(
        st.tuples(
            st.sampled_from([b"set-cookie", b"x-a", b"content-type", b"link", b"vary"]),
            st.binary(max_size=40).filter(lambda v: b"\r" not in v and b"\n" not in v),
        ),
        max_size=6,
    ),
    status=st.sampled_from([200, 201, 202, 400, 402, 404, 409, 422]),
)
async def test_any_response_replays_byte_identical(
    chunks: list[bytes], headers: list[tuple[bytes, bytes]], status: int
) -> None:
    mw = IdempotencyMiddleware(
        Handler(status=status, headers=headers, chunks=chunks), store=MemoryStore()
    )
    first = await request(mw, key="k")
    again = await request(mw, key="k")
    assert (again.status, again.body) == (first.status, first.body) == (status, b"".join(chunks))
    assert again.without("idempotent-replayed", "content-length") == first.headers
    assert again.header("content-length") == str(len(first.body)).encode()


# -- disconnects, cancellation, the held-back final chunk -----------------------------------------


async def test_final_chunk_is_sent_only_after_the_record_is_published() -> None:
    store = MemoryStore()
    seen_at_final: list[bytes | None] = []
    names = key_names(b"idem", b"", b"k")

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            seen_at_final.append(await store.get(names.result))

    mw = IdempotencyMiddleware(Handler(chunks=[b"a", b"b"]), store=store)
    from tests.support.asgi import http_scope

    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError

    await mw(http_scope(headers=[("Idempotency-Key", "k")]), receive, send)
    assert seen_at_final[0] is not None and decode(seen_at_final[0]).body == b"ab"


async def test_app_that_aborts_on_disconnect_releases_the_claim() -> None:
    store = MemoryStore()
    runs = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        runs.append(1)
        await receive()  # the body
        message = await receive()  # blocks until the client leaves
        assert message["type"] == "http.disconnect"
        # the handler gives up without answering

    mw = IdempotencyMiddleware(app, store=store)
    gone = asyncio.Event()
    task = asyncio.create_task(request(mw, key="k", disconnect=gone))
    await until(lambda: runs, what="the app started")
    gone.set()
    await task
    assert mw.counters.released == 1
    assert await store.get(key_names(b"idem", b"", b"k").claim) is None
    assert len(runs) == 1


async def test_cancelled_request_releases_the_claim(store: Store) -> None:
    handler = Handler(delay=5)
    mw = IdempotencyMiddleware(handler, store=store)
    task = asyncio.create_task(request(mw, key="k"))
    await until(lambda: handler.runs == 1, what="the run started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def released() -> bool:
        return await store.get(key_names(b"idem", b"", b"k").claim) is None

    await until(released, what="the shielded release finished")
    assert await store.get(key_names(b"idem", b"", b"k").claim) is None
    handler.delay = 0
    assert (await request(mw, key="k")).body == b"run 2"


async def test_client_that_left_after_a_complete_response_still_gets_its_replay() -> None:
    """The work is done once the app has answered: a retry must replay it, not rerun it."""
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    from tests.support.asgi import http_scope

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection reset by peer")

    with pytest.raises(OSError):
        await mw(http_scope(headers=[("Idempotency-Key", "k")]), receive, send)
    again = await request(mw, key="k")
    assert again.header("idempotent-replayed") == b"true" and handler.runs == 1


# -- leases -------------------------------------------------------------------------------------


async def test_watchdog_keeps_a_long_run_claimed(store: Store) -> None:
    handler = Handler(gate=asyncio.Event())
    mw = IdempotencyMiddleware(handler, store=store, lease_seconds=1)
    first = asyncio.create_task(request(mw, key="k"))
    for renewals in (2, 4, 6, 8):  # well past the 1 s lease: a renewal every third of it
        await until(lambda n=renewals: mw.watchdog.renewals >= n, what=f"{renewals} renewals")
        assert (await request(mw, key="k")).status == 409
    handler.gate.set()  # type: ignore[union-attr]
    assert (await first).status == 201
    assert handler.runs == 1
    assert mw.watchdog.renewals >= 3
    assert len(mw.watchdog) == 0  # nothing left held


async def test_lost_lease_is_logged_and_counted_under_the_key_hash(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """The log and the store name a key by its hash: no log message, stored key name or
    stored value contains the raw key, on any store."""
    store = backend.store
    events: list[tuple[str, str]] = []
    handler = Handler(gate=asyncio.Event())
    mw = IdempotencyMiddleware(
        handler, store=store, lease_seconds=1, on_event=lambda e, h: events.append((e, h))
    )
    names = key_names(b"idem", b"", RAW_KEY.encode())
    with caplog.at_level(logging.DEBUG):
        task = asyncio.create_task(request(mw, key=RAW_KEY))
        await until(lambda: handler.runs == 1, what="the run started")
        await store.set(names.claim, "intruder", px=60_000)  # someone else now holds the key
        await until(lambda: mw.counters.lease_lost, what="the next renewal found the intruder")
        handler.gate.set()  # type: ignore[union-attr]
        assert (await task).status == 201  # the run goes on
    assert mw.counters.lease_lost == 1
    assert ("lease_lost", names.hash) in events
    messages = [r.getMessage() for r in caplog.records]
    assert any(names.hash in m and "lease lost" in m for m in messages), messages
    assert [m for m in messages if RAW_KEY in m] == []
    stored = await stored_items(store)
    assert {name for name, _ in stored} == {names.claim, names.result}
    assert [(n, v) for n, v in stored if RAW_KEY.encode() in n + v] == []


async def test_published_claim_lives_as_long_as_the_result(store: Store) -> None:
    mw = IdempotencyMiddleware(Handler(), store=store, lease_seconds=1, ttl_seconds=60)
    await request(mw, key="k")
    names = key_names(b"idem", b"", b"k")
    assert 59_000 < await store.pttl(names.claim) <= 60_000
    assert 59_000 < await store.pttl(names.result) <= 60_000
    await asyncio.sleep(1.2)  # past the lease: still a replay, never a second run
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"


class SlowRenewals(RedisStore):
    """A RedisStore whose lease renewals reach the server `stall` seconds late, as on a slow
    link: a fault injector around the real thing (every step runs on the server)."""

    stall = 0.3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renewing = asyncio.Event()
        self.renewed = asyncio.Event()

    async def caexpire_many(self, renewals: Any) -> list[int | Exception]:
        self.renewing.set()
        await asyncio.sleep(self.stall)
        try:
            return await super().caexpire_many(renewals)
        finally:
            self.renewed.set()


@pytest.mark.parametrize("path", ["auto-pipelined", "redis-py"])
@pytest.mark.parametrize("mode", ["script", "native"])
async def test_a_renewal_in_flight_at_publish_cannot_shorten_the_published_claim(
    request_: pytest.FixtureRequest, mode: str, path: str
) -> None:
    """The run ends while a renewal of its lease is on its way: the publish must land after
    it, or the late renewal cuts the claim from the result's TTL back to the lease, and the
    key runs again once the lease is over."""
    server: Server = request_.getfixturevalue(
        "redis_native_server" if mode == "native" else "redis_server"
    )
    store = SlowRenewals.from_url(server.url, mode=mode, autopipeline=path == "auto-pipelined")  # type: ignore[arg-type]
    assert isinstance(store, SlowRenewals)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await store.renewing.wait()  # the lease's renewal has been sent
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    mw = IdempotencyMiddleware(
        app, store=store, lease_seconds=1, ttl_seconds=60, namespace=f"slow-{mode}-{path}"
    )
    names = key_names(mw.namespace, b"", b"k")
    try:
        await store.delete(names.claim, names.result)
        assert (await request(mw, key="k")).status == 201
        await asyncio.wait_for(store.renewed.wait(), 5)  # the late renewal has landed
        claim_ttl = await store.pttl(names.claim)
        assert 59_000 < claim_ttl <= 60_000, f"the published claim has {claim_ttl} ms left"
        assert 59_000 < await store.pttl(names.result) <= 60_000
    finally:
        await store.aclose()


# -- the store fails ----------------------------------------------------------------------------


async def test_store_down_is_503_and_the_handler_never_runs() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store, retry_after_seconds=3)
    try:
        reply = await request(mw, key="k")
        assert reply.status == 503 and reply.header("retry-after") == b"3"
        assert problem(reply)["type"] == "urn:goblin-idem:problem:store-unavailable"
        assert handler.runs == 0 and mw.counters.store_errors == 1
        assert (await request(mw)).status == 201  # no key: no store, no problem
    finally:
        await store.aclose()


async def test_fail_open_runs_unprotected() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store, fail_open=True)
    try:
        assert (await request(mw, key="k", body=b"abc")).status == 201
        assert handler.runs == 1 and handler.bodies == [b"abc"]
        assert mw.counters.unprotected == 1
    finally:
        await store.aclose()


async def test_store_stopped_mid_test_then_back() -> None:
    from tests.support.servers import start_server

    server = start_server("redis")
    store = RedisStore.from_url(server.url, socket_timeout=1)
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    try:
        assert (await request(mw, key="a")).status == 201
        server.stop(remove_dir=False)
        assert (await request(mw, key="b")).status == 503
        assert handler.runs == 1
        server.restart()
        assert (await request(mw, key="b")).status == 201  # no app restart needed
        assert handler.runs == 2
    finally:
        await store.aclose()
        server.stop()


async def test_unreadable_record_is_503_not_a_rerun() -> None:
    store = MemoryStore()
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    names = key_names(b"idem", b"", b"k")
    await store.set(names.claim, "t", ex=60)
    await store.set(names.result, b"garbage", ex=60)
    assert (await request(mw, key="k")).status == 503
    assert handler.runs == 0


# -- counting round trips at the server ------------------------------------------------------


async def commands_during(client: Any, action: Callable[[], Any]) -> dict[str, int]:
    """The server's command calls while `action` runs (INFO commandstats after a reset)."""
    await client.execute_command("CONFIG", "RESETSTAT")
    await action()
    stats = await client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}
    calls.pop("config|resetstat", None)
    return calls


class RoundTrips:
    """Counts the writes-then-waits of a store's shared connection: its round trips."""

    def __init__(self, store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
        pipeline = store._pipeline
        assert pipeline is not None
        self.count = 0
        execute = pipeline.execute

        def counted(commands: Any) -> Any:
            self.count += 1
            return execute(commands)

        monkeypatch.setattr(pipeline, "execute", counted)

    def during(self, n: int) -> None:
        assert self.count == n, f"{self.count} round trips, expected {n}"
        self.count = 0


@pytest.fixture
def request_(request: pytest.FixtureRequest) -> pytest.FixtureRequest:
    return request


# The commands (from commandstats) of a new key, a replay and a duplicate in flight.
# Script mode: commandstats also counts the calls a script makes (set/get/pexpire inside
# EVALSHA). New key: the claim step (EVALSHA: set NX; and PTTL of the result, pipelined),
# then the publish, one pipelined MULTI / SET / EVALSHA (get, pexpire) / EXEC. A replay and
# a duplicate in flight: the claim step only (EVALSHA: set NX fails, get result; PTTL).
# Native mode: CLAIM and PTTL, then MULTI / SET / GOBLIN.CAEXPIRE / EXEC pipelined.
# commandstats also counts the GET the module runs inside a command to read a short value
# without changing how it is stored (the token CAEXPIRE compares); a replay's CLAIM reads
# the (short) stored result the same way.
ROUND_TRIP_COMMANDS = {
    "script": (
        {"evalsha": 2, "pttl": 1, "multi": 1, "set": 2, "get": 1, "pexpire": 1, "exec": 1},
        {"evalsha": 1, "set": 1, "get": 1, "pttl": 1},
        {"evalsha": 1, "set": 1, "get": 1, "pttl": 1},
    ),
    "native": (
        {
            "goblin.claim": 1,
            "pttl": 1,
            "multi": 1,
            "set": 1,
            "goblin.caexpire": 1,
            "get": 1,
            "exec": 1,
        },
        {"goblin.claim": 1, "get": 1, "pttl": 1},
        {"goblin.claim": 1, "pttl": 1},
    ),
}


# With the replay cache, a new key sends the same commands (a publish tracks nothing); the
# first replay also fills the cache, in the background (CLIENT CACHING YES, then GET and
# the two keys' PTTLs in one MULTI/EXEC), and later replays are answered from memory: no
# command at all.
CACHE_FILL = {"client|caching": 1, "multi": 1, "get": 1, "pttl": 2, "exec": 1}


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("mode", ["script", "native"])
@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_round_trips_per_request(
    request_: Any, kind: str, mode: str, cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new key takes 2 round trips, a replay 1 (none from the replay cache), a request
    without a key none and a duplicate in flight 1, each with exactly the commands above."""
    new, replay, in_flight = ROUND_TRIP_COMMANDS[mode]
    first_replay, replay_after = replay, ({} if cache else replay)
    if cache:
        first_replay = {k: replay.get(k, 0) + CACHE_FILL.get(k, 0) for k in {*replay, *CACHE_FILL}}
    fixture = f"{kind}_native_server" if mode == "native" else f"{kind}_server"
    server: Server = request_.getfixturevalue(fixture)
    store = RedisStore.from_url(server.url, replay_cache_bytes=4 << 20 if cache else 0)
    assert await store.detect() == mode  # detection loads the scripts: no NOSCRIPT below
    handler, started, go_on = Handler(), asyncio.Event(), asyncio.Event()
    go_on.set()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # The first "slow" run is held until its duplicate was answered, however loaded
        # the machine: a fixed delay let the run finish first under load.
        started.set()
        await go_on.wait()
        await handler(scope, receive, send)

    mw = IdempotencyMiddleware(app, store=store)
    client = store.client
    trips = RoundTrips(store, monkeypatch)
    try:
        await client.flushall()
        assert await commands_during(client, lambda: request(mw, key="new")) == new
        trips.during(2)

        async def replayed() -> None:
            assert (await request(mw, key="new")).status == 201
            pipeline = store._pipeline
            if cache and pipeline is not None:  # its fill, not waited for by the request
                await until(
                    lambda: pipeline.cached(key_names(b"idem", b"", b"new").result) is not None
                )

        assert await commands_during(client, replayed) == first_replay
        trips.during(1)
        assert await commands_during(client, lambda: request(mw, key="new")) == replay_after
        trips.during(0 if cache else 1)
        assert await commands_during(client, lambda: request(mw)) == {}  # no key: nothing
        trips.during(0)

        go_on.clear()
        started.clear()
        first = asyncio.create_task(request(mw, key="slow"))
        await asyncio.wait_for(started.wait(), 10)
        trips.during(1)

        async def duplicate() -> None:
            assert (await request(mw, key="slow")).status == 409

        assert await commands_during(client, duplicate) == in_flight
        trips.during(1)
        go_on.set()
        await first
    finally:
        await store.aclose()


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        IdempotencyMiddleware(Handler(), lease_seconds=0)
    with pytest.raises(ValueError):
        IdempotencyMiddleware(Handler(), ttl_seconds=-1)


async def test_default_store_is_the_embedded_one() -> None:
    mw = IdempotencyMiddleware(Handler())
    assert isinstance(mw.store, MemoryStore)
    await request(mw, key="k")
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"


async def test_counters_and_hook_failures(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def broken(event: str, key_hash: str) -> None:
        seen.append(event)
        raise RuntimeError("metrics down")

    mw = IdempotencyMiddleware(Handler(), store=backend.store, on_event=broken)
    with caplog.at_level(logging.ERROR, logger="goblin_idem.middleware"):
        assert (await request(mw, key="k")).status == 201  # a failing hook fails nothing
        assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"
    assert seen == ["claimed", "replayed"]  # the hook saw each event, and failed each time
    assert [r.getMessage() for r in caplog.records] == ["on_event hook failed"] * 2
    assert mw.counters.as_dict()["claimed"] == 1
    assert mw.counters.as_dict()["replayed"] == 1


async def test_a_claim_that_lapsed_during_the_run_is_retaken_at_publish(store: Store) -> None:
    """A handler that blocks the event loop past its lease: the watchdog could not renew,
    the claim expired; publishing takes it back, so a later duplicate replays."""
    import time

    runs = []

    async def blocking(scope: Scope, receive: Receive, send: Send) -> None:
        runs.append(1)
        await receive()
        time.sleep(1.3)  # noqa: ASYNC251 - blocks the loop on purpose: no renewal can run
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    mw = IdempotencyMiddleware(blocking, store=store, lease_seconds=1, ttl_seconds=60)
    assert (await request(mw, key="k")).status == 201
    names = key_names(b"idem", b"", b"k")
    assert 59_000 < await store.pttl(names.claim) <= 60_000
    again = await request(mw, key="k")
    assert again.header("idempotent-replayed") == b"true" and again.body == b"done"
    assert len(runs) == 1
    assert mw.counters.lease_lost == 1  # counted once


async def test_a_lapsed_claim_that_another_run_took_stays_with_that_run(store: Store) -> None:
    """Run A's claim lapses (deleted here, as its expiry would), run B claims the key and
    runs; then A finishes. A's publish stores its result but must not take the claim back:
    the key stays with B's token and B's lease keeps being renewed. B's publish then finds
    A's result, which stands (duplicates were given it); B's client gets B's response, and
    B's claim lasts no longer than A's result."""
    entered = {run: asyncio.Event() for run in "AB"}
    finish = {run: asyncio.Event() for run in "AB"}
    runs: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        run = dict(scope["headers"])[b"x-run"].decode()
        runs.append(run)
        entered[run].set()
        await finish[run].wait()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": f"run {run}".encode()})

    mw = IdempotencyMiddleware(app, store=store, lease_seconds=1, ttl_seconds=60)
    names = key_names(b"idem", b"", b"k")
    run_a = asyncio.create_task(request(mw, key="k", headers=[("X-Run", "A")]))
    await entered["A"].wait()
    await store.delete(names.claim)  # A's claim lapses
    run_b = asyncio.create_task(request(mw, key="k", headers=[("X-Run", "B")]))
    await entered["B"].wait()
    token_b = await store.get(names.claim)
    assert token_b is not None

    finish["A"].set()
    a = await run_a
    assert (a.status, a.body) == (201, b"run A")
    assert await store.get(names.claim) == token_b, "A's publish took the claim from B"
    renewed = mw.watchdog.renewals
    await until(lambda: mw.watchdog.renewals >= renewed + 2, what="B's lease renewed since")
    assert await store.get(names.claim) == token_b
    assert 0 < await store.pttl(names.claim) <= 1000  # B's lease, renewed by B

    first = await request(mw, key="k", headers=[("X-Run", "C")])
    assert (first.body, first.header("idempotent-replayed")) == (b"run A", b"true")

    finished_b = time.monotonic()
    finish["B"].set()
    b = await run_b
    assert (b.status, b.body, b.header("idempotent-replayed")) == (201, b"run B", None)
    assert await store.get(names.claim) == token_b
    result_ttl, claim_ttl = await store.pttl(names.result), await store.pttl(names.claim)
    # B's claim ends with A's result: its TTL is the result's, read one round trip before
    # it was set, so it may outlast the result by that round trip (B's publish took longer).
    publish_ms = (time.monotonic() - finished_b) * 1000
    assert 58_000 < claim_ttl <= result_ttl + publish_ms + 1
    replay = await request(mw, key="k", headers=[("X-Run", "D")])
    assert (replay.body, replay.header("idempotent-replayed")) == (b"run A", b"true")
    assert runs == ["A", "B"]
    assert mw.counters.superseded == 1


async def test_any_failure_of_the_store_step_is_a_503_not_a_500() -> None:
    """A client library's own bug (not a RedisError) still means "the claim is in doubt"."""

    class Broken(MemoryStore):
        async def claim_unless_done(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'writelines'")

    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=Broken())
    reply = await request(mw, key="k")
    assert reply.status == 503 and problem(reply)["type"].endswith("store-unavailable")
    assert handler.runs == 0 and mw.counters.store_errors == 1
