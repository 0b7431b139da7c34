"""A card processor under the middleware, for the tests of the keys a run sends it: each
call that reaches its handler is a charge, so a key sent twice for two calls shows as one
charge answered twice.

``POST /charges`` (any query string) ``{"account", "amount"}``: a new charge id from the
store's server (``card:ids``), pushed onto ``card:charges:<account>``, and answered as
``{"charge", "account", "amount", "query"}``. ``GET /charges/{account}``: the account's
charge ids, oldest first. Every POST that reaches the app, keyed or not, first increments
``card:requests``. Environment: ``REDIS_URL``.
"""

from __future__ import annotations

import os

import redis.asyncio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, RedisStore

_url = os.environ["REDIS_URL"]
_control = redis.asyncio.Redis.from_url(_url)


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def charge(request: Request) -> JSONResponse:
    body = await request.json()
    number = await _control.incr("card:ids")
    charge_id = f"ch_{number}"
    await _control.rpush(f"card:charges:{body['account']}", charge_id)
    answer = {"charge": charge_id, "account": body["account"], "amount": body["amount"]}
    return JSONResponse({**answer, "query": request.url.query}, status_code=201)


async def charges(request: Request) -> JSONResponse:
    ids = await _control.lrange(f"card:charges:{request.path_params['account']}", 0, -1)
    return JSONResponse([i.decode() for i in ids])


class Requests:
    """Counts every POST that reaches the app, before the middleware sees it."""

    def __init__(self, app: object) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            await _control.incr("card:requests")
        await self.app(scope, receive, send)  # type: ignore[operator]


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/charges", charge, methods=["POST"]),
        Route("/charges/{account}", charges),
    ],
    middleware=[
        Middleware(Requests),
        Middleware(IdempotencyMiddleware, store=RedisStore.from_url(_url), namespace="card"),
    ],
)
