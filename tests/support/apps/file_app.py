"""A tiny app for the file-response tests: POST /file/{name} counts its run in the store, then
answers a Starlette FileResponse of FILE_DIR/name, which the server sends with
http.response.pathsend when it offers that extension (the X-Pathsend header says whether it
did). Configured by environment: REDIS_URL, FILE_DIR, MAX_RESPONSE_BYTES."""

from __future__ import annotations

import os
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, RedisStore

store = RedisStore.from_url(os.environ["REDIS_URL"])
files = Path(os.environ["FILE_DIR"])


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def file(request: Request) -> FileResponse:
    name = request.path_params["name"]
    await store.client.incr("runs:" + name)
    offered = "http.response.pathsend" in request.scope.get("extensions", {})
    return FileResponse(files / name, headers={"x-pathsend": "offered" if offered else "no"})


app = Starlette(routes=[Route("/health", health), Route("/file/{name}", file, methods=["POST"])])
app.add_middleware(
    IdempotencyMiddleware,
    store=store,
    max_response_bytes=int(os.environ.get("MAX_RESPONSE_BYTES", str(1024 * 1024))),
)
