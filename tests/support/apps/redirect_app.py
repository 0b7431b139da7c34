"""A FastAPI app whose POSTs reach their handler through a redirect, under the middleware.

- ``POST /orders/`` is the handler: each real run INCRs ``runs:orders`` in the store and
  answers 201 with a nonce no other run could produce. ``POST /orders`` (no trailing slash)
  gets FastAPI's 307 to it, as any route declared with its slash does.
- ``POST /old-orders`` answers 308 Permanent Redirect to ``/orders/`` (a moved route).
- ``GET /stats``: the middleware's counters.

Configured by environment: REDIS_URL.
"""

from __future__ import annotations

import os
import secrets

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse

from goblin_idem import IdempotencyMiddleware, RedisStore

store = RedisStore.from_url(os.environ["REDIS_URL"])
app = FastAPI()


@app.get("/health")
async def health() -> PlainTextResponse:
    return PlainTextResponse("ok")


@app.get("/stats")
async def stats() -> JSONResponse:
    return JSONResponse(IdempotencyMiddleware.of(app).counters.as_dict())


@app.post("/orders/")
async def create_order() -> JSONResponse:
    run = await store.client.incr("runs:orders")
    return JSONResponse({"run": run, "nonce": secrets.token_hex(8)}, status_code=201)


@app.post("/old-orders")
async def moved() -> RedirectResponse:
    return RedirectResponse("/orders/", status_code=308)


app.add_middleware(IdempotencyMiddleware, store=store)
