"""A FastAPI app protected by IdempotencyMiddleware, with a toy ledger to prove it.

The middleware has SQL records (`goblin_idem.sql.SqlRecords`): a charge is a row of the
``payments`` table written through the run's connection, so it commits with the stored
response in one transaction, and a store that lost its data replays from the database.
The database is SQLite unless a URL is given (`example_app.payments.Database`).

Routes:

- ``POST /payments``: charge an account (201, ``Location``) at the fake card processor
  (`example_app.card`) and in the ledger; ``?delay_ms=`` slows it down, ``?fail_once=true``
  fails a key's first run (500) after the card was charged.
- ``GET /card/charges``: what the card processor charged.
- ``GET /payments/{id}``: one payment, from the database.
- ``POST /webhooks/{provider}``: a provider's event, a Standard Webhooks delivery: its
  signature verified before anything is claimed, keyed by its ``webhook-id``;
  ``charge`` events charge the ledger once.
- ``POST /orders``, ``GET /orders/{id}``, ``PATCH /orders/{id}`` with ``If-Match``:
  optimistic concurrency with compare-and-set; an order keeps the TTL it was created with.
- ``POST /jobs/{name}``: a short job run under a `goblin_idem.Lock`; a concurrent start
  of the same job gets 409.
- ``GET /ledger``, ``GET /stats``: the payments per account and key, from the database;
  what the middleware did.
- ``POST /demo/dead-worker`` (``demo_routes=True``): take a claim for a key the way the
  middleware does and abandon it, as a worker killed mid-request leaves it.
- ``POST /demo/flush-store`` (``demo_routes=True``): empty the store, as a Redis restarted
  without persistence (or FLUSHALL) does; the database keeps what committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.types import Message

from goblin_idem import (
    CLAIMED,
    IdempotencyMiddleware,
    Lock,
    LockNotOwnedError,
    MemoryStore,
    RedisStore,
    Store,
    Watchdog,
    idempotent,
)
from goblin_idem._keys import DEFAULT_KEY_PATTERN, credentials_scope, key_names, valid_key
from goblin_idem.webhooks import StandardWebhooks, webhook

from .card import CardProcessor
from .payments import Database, charge, get_payment, ledger_view, writes

__all__ = [
    "TEST_WEBHOOK_SECRET",
    "app_from_env",
    "create_app",
    "describe_store",
    "find_middleware",
    "serving",
]

logger = logging.getLogger("example_app")

PROBLEM_BASE = "urn:example-app:problem:"
NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_DELAY_MS = 10_000
MAX_JOB_MS = 5_000
# The webhook route's signing secret unless GOBLIN_WEBHOOK_SECRET names another: a test
# value, published in docs/example-app.md so that the demo (and a reader) can sign events.
TEST_WEBHOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


# -- request bodies ----------------------------------------------------------------------


class PaymentIn(BaseModel):
    account: str = Field(pattern=NAME)
    amount_cents: int = Field(gt=0, le=10**12)
    currency: str = Field(pattern=r"^[A-Z]{3}$")


class WebhookEvent(BaseModel):
    id: str = Field(min_length=1, max_length=255)
    type: str = Field(min_length=1, max_length=100)
    data: dict[str, Any] = Field(default_factory=dict)


class OrderIn(BaseModel):
    item: str = Field(min_length=1, max_length=100)
    quantity: int = Field(gt=0, le=1000)
    ttl_seconds: int = Field(default=3600, gt=0, le=30 * 86_400)


class OrderPatch(BaseModel):
    item: str | None = Field(default=None, min_length=1, max_length=100)
    quantity: int | None = Field(default=None, gt=0, le=1000)
    status: Literal["open", "paid", "shipped", "cancelled"] | None = None


class DeadWorkerIn(BaseModel):
    key: str = Field(min_length=1, max_length=255)
    lease_seconds: int | None = Field(default=None, gt=0, le=3600)


# -- helpers -----------------------------------------------------------------------------


def problem(
    status: int, slug: str, title: str, detail: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An RFC 9457 problem+json response of this app (the middleware has its own types)."""
    return JSONResponse(
        {"type": PROBLEM_BASE + slug, "title": title, "status": status, "detail": detail},
        status_code=status,
        headers=dict(headers or {}),
        media_type="application/problem+json",
    )


def etag_of(value: bytes) -> str:
    """A strong ETag: a hash of the stored bytes."""
    return '"' + hashlib.blake2b(value, digest_size=8).hexdigest() + '"'


def if_match_allows(header: str, etag: str) -> bool:
    """RFC 9110 If-Match: ``*`` or a list of strong tags (a weak tag never matches)."""
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or etag in tags


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


def describe_store(store: Store) -> dict[str, str]:
    """kind (memory / redis) and mode (embedded / native / script / auto before detection)."""
    if isinstance(store, MemoryStore):
        return {"kind": "memory", "mode": "embedded"}
    if isinstance(store, RedisStore):
        return {"kind": "redis", "mode": store.mode}
    return {"kind": type(store).__name__, "mode": "unknown"}


def find_middleware(app: FastAPI) -> IdempotencyMiddleware:
    """The IdempotencyMiddleware serving the app (see `IdempotencyMiddleware.of`)."""
    return IdempotencyMiddleware.of(app)


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[FastAPI]:
    """Run `app`'s whole ASGI lifespan (its middleware's startup included) in this process,
    as a server does; for the demo and tests, which call it through httpx's ASGITransport."""
    incoming: asyncio.Queue[Message] = asyncio.Queue()
    outgoing: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, incoming.get, outgoing.put))
    await incoming.put({"type": "lifespan.startup"})
    started = await outgoing.get()
    if started["type"] != "lifespan.startup.complete":
        await task
        raise RuntimeError(started.get("message", "the app's startup failed"))
    try:
        yield app
    finally:
        await incoming.put({"type": "lifespan.shutdown"})
        await outgoing.get()
        await task


# -- the app -----------------------------------------------------------------------------


def create_app(
    store: Store | None = None,
    *,
    redis_url: str | None = None,
    lease_seconds: int = 30,
    ttl_seconds: int = 86_400,
    job_lease_ms: int = 1_000,
    demo_routes: bool = True,
    database_url: str | None = None,
    sql_records: bool = True,
    webhook_secrets: Sequence[str] = (TEST_WEBHOOK_SECRET,),
) -> FastAPI:
    """A fresh app on `store` (default: a MemoryStore, or a RedisStore for `redis_url`),
    with its records and payments in the database at `database_url` (default: a new SQLite
    file, removed at shutdown). Its lifespan creates the tables, before the middleware
    checks its records table (it does once the app's own startup is done).
    ``sql_records=False`` leaves the records to the store alone, to show what they prevent:
    the payments stay in the database, but a flushed store lets a key charge again.
    `webhook_secrets` are the webhook route's Standard Webhooks secrets (``whsec_...``).

    A store the app creates itself is checked at startup and closed at shutdown by the
    middleware; one passed in is left open.
    """
    owns_store = store is None
    if store is None:
        store = RedisStore.from_url(redis_url) if redis_url else MemoryStore()
    the_store: Store = store
    where = f" at {redact(redis_url)}" if redis_url and owns_store else ""
    database = Database(database_url)
    engine = database.engine
    card = CardProcessor()
    failed_once: set[str] = set()  # ?fail_once=true: the keys whose first run failed

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await database.create_tables()
        except Exception as exc:
            await database.aclose()
            raise RuntimeError(
                f"example_app: cannot create the tables in {database.where}: {exc}"
            ) from exc
        # The middleware's store check has run: the store is known, and its mode.
        info = describe_store(the_store)
        logger.info(
            "example_app: store=%s%s mode=%s lease=%ds ttl=%ds",
            info["kind"],
            where,
            info["mode"],
            lease_seconds,
            ttl_seconds,
        )
        if sql_records:
            logger.info("example_app: payments and records in %s", database.where)
        else:
            logger.info("example_app: payments in %s; records in the store only", database.where)
        try:
            async with serving(card.app):
                yield
        finally:
            await card.aclose()
            await database.aclose()

    app = FastAPI(title="goblin-idem example", lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware,
        store=the_store,
        lease_seconds=lease_seconds,
        ttl_seconds=ttl_seconds,
        close_store=owns_store,
        records=database.records if sql_records else None,
    )
    app.state.store = the_store
    app.state.database = database
    app.state.card = card

    # -- payments --

    @app.post("/payments", status_code=201)
    async def create_payment(
        body: PaymentIn,
        request: Request,
        delay_ms: Annotated[int, Query(ge=0, le=MAX_DELAY_MS)] = 0,
        fail_once: bool = False,
    ) -> JSONResponse:
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)  # the slow part comes before any write
        key = request.headers.get("idempotency-key")
        # The card processor first: under a key, the transport sends it a key derived from
        # this run's claim, so a second run of this payment is answered from its record.
        await card.charge(body.account, body.amount_cents, body.currency)
        if fail_once and key is not None and key not in failed_once:
            failed_once.add(key)  # a crash after the card charge, before the payment's write
            return problem(
                500, "failed-after-charge", "The payment failed", "Retry with the same key."
            )
        async with writes(engine) as conn:
            payment = await charge(conn, body.account, body.amount_cents, body.currency, key)
        return JSONResponse(
            payment.as_dict(), status_code=201, headers={"Location": f"/payments/{payment.id}"}
        )

    @app.get("/card/charges")
    async def card_charges(account: Annotated[str | None, Query(pattern=NAME)] = None) -> Any:
        """What the fake card processor charged (an account's, or all)."""
        return {"charges": card.charges_of(account)}

    @app.get("/payments/{payment_id}")
    async def read_payment(payment_id: Annotated[str, Path(pattern=NAME)]) -> Response:
        payment = await get_payment(engine, payment_id)
        if payment is None:
            return problem(404, "not-found", "No such payment", f"{payment_id} does not exist.")
        return JSONResponse(payment)

    # -- webhooks: Standard Webhooks deliveries, verified, keyed by their webhook-id --

    @app.post("/webhooks/{provider}")
    @webhook(StandardWebhooks(secrets=list(webhook_secrets)))
    async def receive_webhook(
        provider: Annotated[str, Path(pattern=NAME)], event: WebhookEvent, request: Request
    ) -> Response:
        key = request.headers.get("webhook-id") or request.headers.get("svix-id")
        if event.type != "charge":
            return JSONResponse({"event": event.id, "provider": provider, "processed": "ignored"})
        try:
            data = PaymentIn.model_validate(event.data)
        except ValidationError as exc:
            return problem(422, "invalid-event", "The charge event's data is not valid", str(exc))
        async with writes(engine) as conn:
            payment = await charge(conn, data.account, data.amount_cents, data.currency, key)
        return JSONResponse(
            {
                "event": event.id,
                "provider": provider,
                "processed": "charged",
                "payment": payment.as_dict(),
            }
        )

    # -- orders: optimistic concurrency with CAS; the TTL set at creation is kept --

    def order_key(order_id: str) -> str:
        return f"orders:{order_id}"

    async def order_response(value: bytes, status: int, order_id: str) -> JSONResponse:
        ttl_ms = await the_store.pttl(order_key(order_id))
        return JSONResponse(
            {**json.loads(value), "ttl_ms": ttl_ms},
            status_code=status,
            headers={"ETag": etag_of(value), "Location": f"/orders/{order_id}"},
        )

    def order_gone(order_id: str) -> JSONResponse:
        return problem(404, "not-found", "No such order", f"{order_id} does not exist or expired.")

    @app.post("/orders", status_code=201)
    async def create_order(body: OrderIn) -> JSONResponse:
        order_id = "ord_" + secrets.token_hex(6)
        doc = {
            "id": order_id,
            "item": body.item,
            "quantity": body.quantity,
            "status": "open",
            "version": 1,
        }
        value = json.dumps(doc, sort_keys=True).encode()
        await the_store.set(order_key(order_id), value, px=body.ttl_seconds * 1000)
        return await order_response(value, 201, order_id)

    @app.get("/orders/{order_id}")
    async def read_order(order_id: Annotated[str, Path(pattern=NAME)]) -> Response:
        value = await the_store.get(order_key(order_id))
        if value is None:
            return order_gone(order_id)
        return await order_response(value, 200, order_id)

    @app.patch("/orders/{order_id}")
    async def update_order(
        order_id: Annotated[str, Path(pattern=NAME)], changes: OrderPatch, request: Request
    ) -> Response:
        if_match = request.headers.get("if-match")
        if if_match is None:
            return problem(
                428,
                "if-match-required",
                "If-Match is required",
                "Send the ETag of the order you read as If-Match.",
            )
        key = order_key(order_id)
        current = await the_store.get(key)
        if current is None:
            return order_gone(order_id)
        if not if_match_allows(if_match, etag_of(current)):
            return problem(
                412,
                "stale",
                "The order changed since you read it",
                "Read it again (its current ETag is in the ETag header) and reapply.",
                {"ETag": etag_of(current)},
            )
        doc = json.loads(current)
        doc.update(changes.model_dump(exclude_none=True))
        doc["version"] += 1
        new = json.dumps(doc, sort_keys=True).encode()
        if not await the_store.cas(key, current, new):  # changed between GET and CAS
            latest = await the_store.get(key)
            if latest is None:
                return order_gone(order_id)
            return problem(
                412,
                "stale",
                "The order changed while you updated it",
                "Read it again and reapply.",
                {"ETag": etag_of(latest)},
            )
        return await order_response(new, 200, order_id)

    # -- jobs: one run at a time per name, under a Lock renewed by the shared watchdog --

    @app.post("/jobs/{name}")
    async def run_job(
        name: Annotated[str, Path(pattern=NAME)],
        duration_ms: Annotated[int, Query(ge=0, le=MAX_JOB_MS)] = 500,
    ) -> Response:
        lock = Lock(the_store, f"job:{name}", lease_seconds=job_lease_ms / 1000, blocking=False)
        if not await lock.acquire():
            return problem(409, "job-running", "The job is running", f"Job {name} is running.")
        started = time.monotonic()
        try:
            await asyncio.sleep(duration_ms / 1000)  # the job's work
        finally:
            lost = lock.lost
            try:
                await lock.release()
            except LockNotOwnedError:
                lost = True
        if lost:
            return problem(
                500,
                "job-lock-lost",
                "The job lost its lock",
                "The lease expired while the job ran (the store was unreachable); another "
                "start may have run concurrently.",
            )
        return JSONResponse(
            {
                "job": name,
                "ran_ms": round((time.monotonic() - started) * 1000),
                "lease_ms": job_lease_ms,
                "lock_lost": False,
            }
        )

    # -- what happened --

    @app.get("/ledger")
    async def read_ledger(
        account: Annotated[str | None, Query(pattern=NAME)] = None,
    ) -> dict[str, Any]:
        return await ledger_view(engine, account)

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        mw = find_middleware(request.app)
        dog = Watchdog.for_store(the_store)
        return {
            "store": describe_store(the_store),
            "middleware": mw.counters.as_dict(),
            "watchdog": {"leases": len(dog), "renewals": dog.renewals, "lost": dog.lost},
            "config": {
                "lease_seconds": lease_seconds,
                "ttl_seconds": ttl_seconds,
                "job_lease_ms": job_lease_ms,
            },
        }

    if demo_routes:

        @app.post("/demo/dead-worker")
        @idempotent(enabled=False)
        async def dead_worker(body: DeadWorkerIn, request: Request) -> Response:
            """Claim `key` exactly as the middleware would for this caller, then abandon
            the claim: nothing renews, publishes or releases it, as after a worker crash."""
            raw = body.key.encode()
            if not valid_key(raw, DEFAULT_KEY_PATTERN):
                return problem(400, "invalid-key", "Not a valid key", "1-255 printable ASCII.")
            mw = find_middleware(request.app)
            scope = (
                credentials_scope(request.scope["headers"])
                if mw.scope_of is None
                else mw.scope_of(request.scope)
            )
            names = key_names(
                mw.namespace, scope if isinstance(scope, bytes) else scope.encode(), raw
            )
            lease = body.lease_seconds or lease_seconds
            token = f"dead-worker:{secrets.token_hex(8)}"
            reply = await the_store.claim(names.claim, names.result, token, lease)
            if reply is not CLAIMED:
                return problem(409, "key-taken", "The key is already claimed", "Use a fresh key.")
            return JSONResponse(
                {"key": body.key, "hash": names.hash, "token": token, "lease_seconds": lease}
            )

        @app.post("/demo/flush-store")
        @idempotent(enabled=False)
        async def flush_store() -> Response:
            """Empty the store, as a Redis restarted without persistence leaves it: every
            key, claim and stored response gone. The database keeps what committed."""
            if isinstance(the_store, MemoryStore):
                keys = len(the_store)
                await the_store.aclose()  # empties it; it stays usable
            elif isinstance(the_store, RedisStore):
                client: Any = the_store.client
                keys = int(await client.dbsize())
                await client.flushdb()  # this store's database only
            else:
                return problem(
                    501, "cannot-flush", "Cannot flush this store", type(the_store).__name__
                )
            return JSONResponse({"store": describe_store(the_store)["kind"], "flushed_keys": keys})

    return app


def app_from_env(environ: Mapping[str, str] = os.environ) -> FastAPI:
    """The app as ``python -m example_app`` configures it.

    ``REDIS_URL`` (unset: the embedded MemoryStore), ``GOBLIN_LEASE_SECONDS`` (30),
    ``GOBLIN_TTL_SECONDS`` (86400), ``GOBLIN_JOB_LEASE_MS`` (1000), ``GOBLIN_DEMO_ROUTES``
    (1; 0 turns the ``/demo/`` routes off), ``GOBLIN_DATABASE_URL`` (unset: a new SQLite
    file in the temporary directory, removed when the app stops), ``GOBLIN_SQL_RECORDS``
    (1; 0 keeps the records in the store only), ``GOBLIN_WEBHOOK_SECRET`` (the webhook
    route's ``whsec_`` secret; unset: TEST_WEBHOOK_SECRET).
    """
    return create_app(
        redis_url=environ.get("REDIS_URL") or None,
        lease_seconds=int(environ.get("GOBLIN_LEASE_SECONDS", "30")),
        ttl_seconds=int(environ.get("GOBLIN_TTL_SECONDS", "86400")),
        job_lease_ms=int(environ.get("GOBLIN_JOB_LEASE_MS", "1000")),
        demo_routes=environ.get("GOBLIN_DEMO_ROUTES", "1") != "0",
        database_url=environ.get("GOBLIN_DATABASE_URL") or None,
        sql_records=environ.get("GOBLIN_SQL_RECORDS", "1") != "0",
        webhook_secrets=[environ.get("GOBLIN_WEBHOOK_SECRET") or TEST_WEBHOOK_SECRET],
    )
