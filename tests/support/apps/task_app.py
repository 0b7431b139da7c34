"""The app the crash, key and reliability tests serve with uvicorn (one or several worker
processes).

``POST /task/{name}`` is the handler under test: each real run appends one line to the side
effect log (``SIDE_LOG``, if set: wall-clock start time, pid, name), INCRs ``runs:{name}`` in
the store (``COUNT_IN_STORE``, on by default), then works for the milliseconds its
``X-Work-Ms`` header asks for (a header, so that a retry without it is the same request) and
answers 201 with a body no other run could produce (a random nonce). ``GET /stats`` gives
this worker's counters. The middleware's events that can lead to a second run or a refusal
are appended to ``EVENT_LOG`` (if set) with the key's hash. Configured by environment:
REDIS_URL, LEASE_SECONDS, SIDE_LOG, EVENT_LOG, COUNT_IN_STORE; ``POSTGRES_STORE_URL``
instead of REDIS_URL serves on a PostgresStore (with ``COUNT_IN_STORE=0``: count by the
side log).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, PostgresStore, RedisStore

store = (
    PostgresStore.from_url(os.environ["POSTGRES_STORE_URL"])
    if "POSTGRES_STORE_URL" in os.environ
    else RedisStore.from_url(os.environ["REDIS_URL"])
)
SIDE_LOG = os.environ.get("SIDE_LOG")
EVENT_LOG = os.environ.get("EVENT_LOG")
COUNT_IN_STORE = os.environ.get("COUNT_IN_STORE", "1") == "1"
LOGGED_EVENTS = frozenset({"publish_errors", "lease_lost", "store_errors", "unprotected"})


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def on_event(event: str, key_hash: str) -> None:
    if EVENT_LOG and event in LOGGED_EVENTS:
        _append(EVENT_LOG, f"{time.time():.6f} {os.getpid()} {event} {key_hash}\n")


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(os.getpid()))


async def stats(request: Request) -> JSONResponse:
    return JSONResponse({"pid": os.getpid(), **middleware().counters.as_dict()})


async def work(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    if SIDE_LOG:
        _append(SIDE_LOG, f"{time.time():.6f} {os.getpid()} {name}\n")
    run = await store.client.incr("runs:" + name) if COUNT_IN_STORE else None
    await asyncio.sleep(int(request.headers.get("x-work-ms", "0")) / 1000)
    nonce = secrets.token_hex(8)
    return JSONResponse(
        {"key": name, "run": run, "pid": os.getpid(), "nonce": nonce},
        status_code=201,
        headers={"x-run-nonce": nonce},
    )


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/stats", stats),
        Route("/task/{name}", work, methods=["POST"]),
    ]
)
app.add_middleware(
    IdempotencyMiddleware,
    store=store,
    lease_seconds=int(os.environ.get("LEASE_SECONDS", "30")),
    on_event=on_event,
)


def middleware() -> IdempotencyMiddleware:
    """The middleware instance Starlette built for this worker."""
    stack = app.middleware_stack
    while stack is not None and not isinstance(stack, IdempotencyMiddleware):
        stack = getattr(stack, "app", None)
    assert isinstance(stack, IdempotencyMiddleware)
    return stack
