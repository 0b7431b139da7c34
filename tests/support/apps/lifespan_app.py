"""A FastAPI app for the lifespan tests, served by uvicorn: the store from $REDIS_URL,
``CHECK_STORE=0`` for check_store=False, ``OWN_LIFESPAN=1`` for a lifespan of the app's own
that reports, on stderr, the store mode it finds at startup and its shutdown,
``LOGGING=basic`` for an app that configures logging itself (``logging.basicConfig()``)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from goblin_idem import IdempotencyMiddleware, RedisStore

runs = 0
if os.environ.get("LOGGING") == "basic":
    logging.basicConfig()


@asynccontextmanager
async def own_lifespan(app: FastAPI) -> AsyncIterator[None]:
    store: Any = IdempotencyMiddleware.of(app).store
    print(f"app startup: store mode {store.mode}", file=sys.stderr, flush=True)
    yield
    print("app shutdown", file=sys.stderr, flush=True)


app = FastAPI(lifespan=own_lifespan if os.environ.get("OWN_LIFESPAN") == "1" else None)
app.add_middleware(
    IdempotencyMiddleware,
    store=RedisStore.from_url(os.environ["REDIS_URL"], socket_timeout=2.0),
    check_store=os.environ.get("CHECK_STORE", "1") == "1",
)


@app.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}


@app.post("/pay")
async def pay() -> dict[str, int]:
    global runs
    runs += 1
    return {"run": runs}


@app.get("/counters")
async def counters(request: Request) -> dict[str, int]:
    return IdempotencyMiddleware.of(request.app).counters.as_dict()
