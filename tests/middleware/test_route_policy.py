"""@idempotent(...) marks on every kind of route, through real Starlette/FastAPI routing.

CI runs this module twice: with the newest FastAPI (whose include_router keeps the router
as one route object) and with the oldest the package supports (which copies each route).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore, Store, idempotent
from goblin_idem._keys import key_names
from tests.support.servers import Server

MISSING_KEY = "urn:goblin-idem:problem:missing-key"


@asynccontextmanager
async def client(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def post(c: httpx.AsyncClient, path: str, key: str | None = None) -> httpx.Response:
    return await c.post(path, headers={"Idempotency-Key": key} if key else {})


def marked_router(runs: dict[str, int], router: Any = None) -> Any:
    """A router (or app) with one route per kind of mark, each counting its runs."""
    router = router if router is not None else APIRouter()

    @router.post("/required")
    @idempotent(required=True)
    async def required() -> dict[str, int]:
        runs["required"] = runs.get("required", 0) + 1
        return {"n": runs["required"]}

    @router.post("/exempt")
    @idempotent(enabled=False)
    async def exempt() -> dict[str, int]:
        runs["exempt"] = runs.get("exempt", 0) + 1
        return {"n": runs["exempt"]}

    @router.post("/plain")
    async def plain() -> dict[str, int]:
        runs["plain"] = runs.get("plain", 0) + 1
        return {"n": runs["plain"]}

    @router.post("/short")
    @idempotent(ttl_seconds=7)
    async def short() -> dict[str, int]:
        runs["short"] = runs.get("short", 0) + 1
        return {"n": runs["short"]}

    return router


async def check_marks(c: httpx.AsyncClient, prefix: str, runs: dict[str, int]) -> None:
    """What every mark must do, wherever its route sits."""
    refused = await post(c, f"{prefix}/required")
    assert refused.status_code == 400 and refused.json()["type"] == MISSING_KEY
    assert "required" not in runs
    for _ in range(2):
        assert (await post(c, f"{prefix}/required", "r1")).json() == {"n": 1}
    for n in (1, 2):
        exempt = await post(c, f"{prefix}/exempt", "e1")
        assert exempt.json() == {"n": n} and "idempotent-replayed" not in exempt.headers
    assert (await post(c, f"{prefix}/plain")).status_code == 200  # no key, not required
    await post(c, f"{prefix}/plain", "p1")
    replay = await post(c, f"{prefix}/plain", "p1")
    assert replay.headers["idempotent-replayed"] == "true" and runs["plain"] == 2


async def result_ttl_ms(store: Store, key: str) -> int:
    return await store.pttl(key_names(b"idem", b"", key.encode()).result)


# -- where a marked route can sit ----------------------------------------------------------


async def test_marks_on_app_routes() -> None:
    runs: dict[str, int] = {}
    app = marked_router(runs, FastAPI())
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    async with client(app) as c:
        await check_marks(c, "", runs)


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_marks_on_an_included_router(prefix: str) -> None:
    runs: dict[str, int] = {}
    store = MemoryStore()
    app = FastAPI()
    app.include_router(marked_router(runs), prefix=prefix)
    app.add_middleware(IdempotencyMiddleware, store=store)
    async with client(app) as c:
        await check_marks(c, prefix, runs)
        await post(c, f"{prefix}/short", "s1")
        assert 0 < await result_ttl_ms(store, "s1") <= 7000  # the route's TTL, not a day


async def test_marks_on_nested_routers() -> None:
    runs: dict[str, int] = {}
    store = MemoryStore()
    outer = APIRouter()
    outer.include_router(marked_router(runs), prefix="/inner")
    app = FastAPI()
    app.include_router(outer, prefix="/outer")
    app.add_middleware(IdempotencyMiddleware, store=store)
    async with client(app) as c:
        await check_marks(c, "/outer/inner", runs)
        await post(c, "/outer/inner/short", "s1")
        assert 0 < await result_ttl_ms(store, "s1") <= 7000


async def test_marks_in_a_mounted_fastapi_app_with_routers() -> None:
    runs: dict[str, int] = {}
    sub = FastAPI()
    sub.include_router(marked_router(runs), prefix="/r")
    app = FastAPI()
    app.mount("/sub", sub)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    async with client(app) as c:
        await check_marks(c, "/sub/r", runs)


async def test_marks_in_a_mounted_starlette_app() -> None:
    runs: list[str] = []

    @idempotent(required=True)
    async def hook(request: Request) -> Response:
        runs.append("hook")
        return JSONResponse({"n": len(runs)})

    inner = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
    app = Starlette(routes=[Mount("/v1", routes=[Mount("/hooks", app=inner)])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    async with client(app) as c:
        assert (await post(c, "/v1/hooks/hook")).status_code == 400
        assert (await post(c, "/v1/hooks/hook", "k")).json() == {"n": 1}
        assert (await post(c, "/v1/hooks/hook", "k")).json() == {"n": 1}
    assert runs == ["hook"]


async def test_the_route_the_router_picks_decides_by_method() -> None:
    """One path, two methods: the mark of the POST route says nothing about the PATCH one."""
    runs: list[str] = []
    router = APIRouter()

    @router.post("/items")
    @idempotent(required=True)
    async def create() -> str:
        runs.append("post")
        return "created"

    @router.patch("/items")
    async def update() -> str:
        runs.append("patch")
        return "updated"

    app = FastAPI()
    app.include_router(router, prefix="/api")
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    async with client(app) as c:
        assert (await c.patch("/api/items")).status_code == 200
        assert (await c.post("/api/items")).status_code == 400
        assert (await c.put("/api/items")).status_code == 405  # not covered, not matched
    assert runs == ["patch"]


async def test_a_marked_route_added_after_the_first_request() -> None:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())

    @app.post("/early")
    async def early() -> str:
        return "early"

    async with client(app) as c:
        assert (await post(c, "/early")).status_code == 200
        router = APIRouter()

        @router.post("/late")
        @idempotent(required=True)
        async def late() -> str:
            return "late"

        app.include_router(router)
        assert (await post(c, "/late")).status_code == 400
        assert (await post(c, "/late", "k")).status_code == 200


async def test_a_route_that_hides_its_endpoint_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A route that matches without naming its endpoint (as FastAPI 0.137.0's included
    routers do) cannot have its marks applied: the middleware says so, once, and applies
    its own options."""

    @idempotent(required=True)
    async def endpoint(request: Request) -> Response:
        return PlainTextResponse("ran")

    class Opaque(BaseRoute):
        def __init__(self) -> None:
            self.inner = Route("/opaque", endpoint, methods=["POST"])

        def matches(self, scope: Scope) -> tuple[Match, Scope]:
            match, _ = self.inner.matches(scope)
            return match, {}

        async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
            await self.inner.handle(scope, receive, send)

    app = Starlette(routes=[Opaque()])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        async with client(app) as c:
            for _ in range(3):
                assert (await post(c, "/opaque")).text == "ran"
    hidden = [r for r in caplog.records if "does not say which endpoint" in r.getMessage()]
    assert len(hidden) == 1 and "Opaque" in hidden[0].getMessage()


# -- on a real Redis ------------------------------------------------------------------------


async def test_router_marks_on_redis(redis_server: Server) -> None:
    runs: dict[str, int] = {}
    store = RedisStore.from_url(redis_server.url)
    try:
        await store.delete(*(key_names(b"idem", b"", k).result for k in (b"r1", b"p1", b"s1")))
        await store.delete(*(key_names(b"idem", b"", k).claim for k in (b"r1", b"p1", b"s1")))
        app = FastAPI()
        app.include_router(marked_router(runs), prefix="/v2")
        app.add_middleware(IdempotencyMiddleware, store=store)
        async with client(app) as c:
            await check_marks(c, "/v2", runs)
            await post(c, "/v2/short", "s1")
            assert 0 < await result_ttl_ms(store, "s1") <= 7000
    finally:
        await store.aclose()
