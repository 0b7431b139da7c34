"""An app as ``gunicorn --preload`` loads it: imported once in the parent, which checks its
store at import (a common way to fail fast on a bad configuration), then forked into
workers. Configured by environment: REDIS_URL, AUTOPIPELINE (1 or 0)."""

from __future__ import annotations

import asyncio
import os
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, RedisStore

store = RedisStore.from_url(
    os.environ["REDIS_URL"], autopipeline=os.environ.get("AUTOPIPELINE", "1") == "1"
)
asyncio.run(store.detect())


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def work(request: Request) -> JSONResponse:
    # Holds its worker's loop, so that concurrent requests are accepted by both workers.
    time.sleep(0.1)  # noqa: ASYNC251
    return JSONResponse({"pid": os.getpid()}, status_code=201)


app = Starlette(routes=[Route("/health", health), Route("/work", work, methods=["POST"])])
app.add_middleware(IdempotencyMiddleware, store=store)
