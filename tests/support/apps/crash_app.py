"""A tiny app for the crash test: each real run INCRs a counter in the store, then works for
the milliseconds its X-Work-Ms header asks for
(a header: the fingerprint covers method, path, query and body, so a retry without it is the
same request). Configured by environment: REDIS_URL, LEASE_SECONDS."""

from __future__ import annotations

import asyncio
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, RedisStore

store = RedisStore.from_url(os.environ["REDIS_URL"])


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def work(request: Request) -> JSONResponse:
    runs = await store.client.incr("runs:" + request.path_params["name"])
    await asyncio.sleep(int(request.headers.get("x-work-ms", "0")) / 1000)
    return JSONResponse({"run": runs}, status_code=201)


app = Starlette(routes=[Route("/health", health), Route("/task/{name}", work, methods=["POST"])])
app.add_middleware(
    IdempotencyMiddleware, store=store, lease_seconds=int(os.environ.get("LEASE_SECONDS", "30"))
)
