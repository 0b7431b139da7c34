"""Two services for the derived-key tests: A, whose handler calls B through the client
transport, and B, a card processor. Both run the middleware on one Redis (namespaces ``a``
and ``b``) with SQL records in a database of their own; `ROLE` picks which one ``app`` is.

Environment: ``ROLE`` (``a`` or ``b``), ``REDIS_URL``, ``DATABASE_URL``, ``RECORDS_TABLE``,
``EFFECTS_TABLE``, ``LEASE_SECONDS``; A also ``B_URL``.

B: ``POST /charges`` ``{"ref", "amount"}`` counts its run (``runs:b:<ref>``), writes one
charge row and answers ``{"charge": <a new id>}``.

A: ``POST /orders`` ``{"ref", "mode"}`` counts its run (``runs:a:<ref>``), charges through
B, notes ``answered:<ref>:<run>`` once B answered, writes one order row with B's charge
id, and answers it with whether B replayed it. Its first run then, by `mode`: ``raise``
(fails after B answered), ``hold`` (waits until the test pushes to the list ``go:<ref>``).
"""

from __future__ import annotations

import os
import uuid
from typing import Annotated, Any

import httpx
import redis.asyncio
from fastapi import Depends, FastAPI, Request
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem.client import AsyncIdempotentTransport, RetryPolicy
from goblin_idem.sql import SqlRecords, connection
from tests.support.apps import counting


def effects_table(name: str) -> Table:
    """A's orders and B's charges alike: one row per effect."""
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("ref", String(64), nullable=False),
        Column("charge", String(64), nullable=False),
    )


def build_b(store: RedisStore, records: SqlRecords, charges: Table, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, records=records, **options)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/charges", status_code=201)
    async def charge(
        request: Request, conn: Annotated[AsyncConnection, Depends(connection)]
    ) -> Any:
        body = await request.json()
        counting.count(f"b:{body['ref']}")
        charge_id = uuid.uuid4().hex
        await conn.execute(insert(charges).values(ref=body["ref"], charge=charge_id))
        return {"charge": charge_id}

    return app


def build_a(
    store: RedisStore,
    records: SqlRecords,
    orders: Table,
    b_url: str,
    control: redis.asyncio.Redis,
    **options: Any,
) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, records=records, **options)
    transport = AsyncIdempotentTransport(policy=RetryPolicy(max_attempts=3, base_delay=0.1))
    b = httpx.AsyncClient(transport=transport, base_url=b_url, timeout=30)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/orders", status_code=201)
    async def order(request: Request, conn: Annotated[AsyncConnection, Depends(connection)]) -> Any:
        body = await request.json()
        ref, mode = body["ref"], body.get("mode")
        run = counting.count(f"a:{ref}")
        answer = await b.post(
            "/charges", json={"ref": ref, "amount": 7}, extensions={"idempotency_label": "charge"}
        )
        answer.raise_for_status()
        charge_id = answer.json()["charge"]
        await control.set(f"answered:{ref}:{run}", charge_id)
        await conn.execute(insert(orders).values(ref=ref, charge=charge_id))
        if run == 1 and mode == "raise":
            raise RuntimeError("the order failed after the card was charged")
        if run == 1 and mode == "hold":
            await control.blpop([f"go:{ref}"])  # until the test pushes to it
        return {
            "charge": charge_id,
            "replayed": answer.extensions["idempotency"]["replayed"],
            "key": answer.extensions["idempotency"]["key"],
            "run": run,
        }

    return app


def _from_env() -> FastAPI | None:
    role = os.environ.get("ROLE")
    if role is None:
        return None
    url = os.environ["REDIS_URL"]
    records = SqlRecords(os.environ["DATABASE_URL"], table=os.environ["RECORDS_TABLE"])
    effects = effects_table(os.environ["EFFECTS_TABLE"])
    options = {"lease_seconds": float(os.environ.get("LEASE_SECONDS", "30")), "namespace": role}
    store = RedisStore.from_url(url)
    if role == "b":
        return build_b(store, records, effects, **options)
    control = redis.asyncio.Redis.from_url(url)
    return build_a(store, records, effects, os.environ["B_URL"], control, **options)


app = _from_env()
