"""A FastAPI app whose handlers refuse a key's first request, then run: for the statuses
that say a request was not processed (tests/middleware/test_outcome.py).

- ``POST /refuse/{status}``: each run INCRs ``runs:<status>:<key>`` in the store; a key's
  first run answers `status` (with ``Retry-After: 1``, and ``WWW-Authenticate`` for 401),
  every later run 201 with its run number and a nonce no other run could produce.
- ``POST /kept/{status}``: the same, marked ``@idempotent(outcome=range(100, 500))``, so
  its refusal is stored and replayed as every status below 500 was before 0.3.0.
- ``GET /stats``: the middleware's counters.

Configured by environment: REDIS_URL; OUTCOME, a comma-separated list of statuses, is the
middleware's ``outcome=`` (the default rule without it).
"""

from __future__ import annotations

import os
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from goblin_idem import IdempotencyMiddleware, RedisStore, idempotent

store = RedisStore.from_url(os.environ["REDIS_URL"])
app = FastAPI()


@app.get("/health")
async def health() -> PlainTextResponse:
    return PlainTextResponse("ok")


@app.get("/stats")
async def stats() -> JSONResponse:
    return JSONResponse(IdempotencyMiddleware.of(app).counters.as_dict())


async def _answer(request: Request, status: int) -> JSONResponse:
    key = request.headers.get("idempotency-key", "")
    run = await store.client.incr(f"runs:{status}:{key}")
    if run == 1:
        headers = {"retry-after": "1"}
        if status == 401:
            headers["www-authenticate"] = 'Bearer realm="payments"'
        return JSONResponse({"refused": status}, status_code=status, headers=headers)
    return JSONResponse({"run": run, "nonce": secrets.token_hex(8)}, status_code=201)


@app.post("/refuse/{status}")
async def refuse(request: Request, status: int) -> JSONResponse:
    return await _answer(request, status)


@app.post("/kept/{status}")
@idempotent(outcome=range(100, 500))
async def kept(request: Request, status: int) -> JSONResponse:
    return await _answer(request, status)


_given = os.environ.get("OUTCOME")
app.add_middleware(
    IdempotencyMiddleware,
    store=store,
    outcome=None if not _given else {int(s) for s in _given.split(",")},
)
