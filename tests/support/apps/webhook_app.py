"""Webhook receivers of every provider, for tests/webhooks and bench/, built from the
environment: ``REDIS_URL``; with ``DATABASE_URL`` (and ``RECORDS_TABLE``,
``DELIVERIES_TABLE``) SQL records, each run's delivery row committed with its record.

Four marked routes (``/hooks/<provider>``), a GitHub route for two hooks with a secret each
(``/hooks/github-hooks``), a Standard Webhooks receiver configured by path
on the middleware (``/by-path/standard``), a plain keyed route (``/plain``, for the
benchmark) and ``GET /counts`` (how many runs each ``ref`` had: the database's rows with
SQL records, else this process's count). A delivery's JSON body has a ``ref``, and a
``mode`` of ``raise-once`` (the first run of that ref raises) or none.
"""

from __future__ import annotations

import collections
import os
from typing import Any

from fastapi import FastAPI, Request
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.ext.asyncio import create_async_engine

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem.sql import SqlRecords, connection
from goblin_idem.webhooks import GitHub, Shopify, StandardWebhooks, Stripe, webhook

# The endpoints' secrets: the current one first, the one being rotated out second.
STANDARD_SECRETS = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_c2VjcmV0LW9sZC1zdGFuZGFyZA=="]
STRIPE_SECRETS = ["whsec_test_stripe_current", "whsec_test_stripe_previous"]
GITHUB_SECRETS = ["It's a Secret to Everybody", "the previous GitHub secret"]
SHOPIFY_SECRETS = ["shpss_current_test_secret", "shpss_previous_test_secret"]
# Two GitHub hooks on one route, each with its own secret (a repository's, an organisation's).
GITHUB_HOOK_SECRETS = {"1": ["the repository hook's secret"], "2": ["the organisation's secret"]}
MAX_BODY_BYTES = 4096


def deliveries_table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("ref", String(200), nullable=False),
    )


def build(outside: bool = False) -> Any:
    """The receiver; with `outside`, the middleware wraps the app from outside
    (``IdempotencyMiddleware(app, ...)``) instead of ``app.add_middleware``."""
    store = RedisStore.from_url(os.environ["REDIS_URL"])
    records = None
    deliveries = None
    if "DATABASE_URL" in os.environ:
        engine = create_async_engine(os.environ["DATABASE_URL"])
        records = SqlRecords(engine, table=os.environ["RECORDS_TABLE"])
        deliveries = deliveries_table(os.environ["DELIVERIES_TABLE"])
    standard = StandardWebhooks(secrets=STANDARD_SECRETS)
    app = FastAPI()
    options: dict[str, Any] = {
        "store": store,
        "records": records,
        "max_body_bytes": MAX_BODY_BYTES,
        "webhooks": {"/by-path/standard": standard},
    }
    if not outside:
        app.add_middleware(IdempotencyMiddleware, **options)
    runs: collections.Counter[str] = collections.Counter()
    failed: set[str] = set()

    async def handle(request: Request) -> dict[str, Any]:
        event = await request.json()  # the body, read again after its verification
        ref = str(event["ref"])
        if event.get("mode") == "raise-once" and ref not in failed:
            failed.add(ref)
            raise RuntimeError("the handler failed, once")
        if deliveries is not None:
            conn = await connection()
            await conn.execute(insert(deliveries).values(ref=ref))
        runs[ref] += 1
        return {"ref": ref, "size": len(await request.body())}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/counts")
    async def counts() -> dict[str, int]:
        if deliveries is None or records is None:
            return dict(runs)
        query = select(deliveries.c.ref, func.count()).group_by(deliveries.c.ref)
        async with records.engine.connect() as conn:
            return {ref: n for ref, n in await conn.execute(query)}

    @app.post("/hooks/standard")
    @webhook(standard)
    async def standard_hook(request: Request) -> dict[str, Any]:
        return await handle(request)

    @app.post("/hooks/stripe")
    @webhook(Stripe(secrets=STRIPE_SECRETS))
    async def stripe_hook(request: Request) -> dict[str, Any]:
        return await handle(request)

    @app.post("/hooks/github")
    @webhook(GitHub(secrets=GITHUB_SECRETS))
    async def github_hook(request: Request) -> dict[str, Any]:
        return await handle(request)

    @app.post("/hooks/github-hooks")
    @webhook(GitHub(hooks=GITHUB_HOOK_SECRETS))
    async def github_hooks(request: Request) -> dict[str, Any]:
        return await handle(request)

    @app.post("/hooks/shopify")
    @webhook(Shopify(secrets=SHOPIFY_SECRETS))
    async def shopify_hook(request: Request) -> dict[str, Any]:
        return await handle(request)

    @app.post("/by-path/standard")
    async def by_path(request: Request) -> dict[str, Any]:
        return await handle(request)

    @app.post("/plain")
    async def plain(request: Request) -> dict[str, Any]:
        return await handle(request)

    return IdempotencyMiddleware(app, **options) if outside else app


app = build() if "REDIS_URL" in os.environ else None
outer = build(outside=True) if "REDIS_URL" in os.environ else None
