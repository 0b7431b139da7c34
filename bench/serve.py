"""One benchmark server: a trivial JSON app behind one idempotency middleware variant.

Run by http_bench.py under ``taskset -c 0`` in the benchmark's own environment:

    python bench/serve.py VARIANT --port N [--redis-url URL] [--app starlette|fastapi]

`POST /orders` is the handler under test (it counts its own runs); `GET /__stats` reports
that count, so the driver can check that a replay or an in-flight duplicate never ran the
handler. At startup each variant takes a claim on `INFLIGHT_KEY` that nobody releases, so
every request with that key is an in-flight duplicate (409).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

PATH = "/orders"
STATS_PATH = "/__stats"
BODY = b'{"sku":"A-1","qty":2}'
INFLIGHT_KEY = "bench-inflight"
VARIANTS = (
    "bare",
    "goblin-memory",
    "goblin-script",
    "goblin-native",
    "goblin-native-direct",
    "asgi-idempotency-header",
    "fastapi-idempotency",
)
# On a local 3-primary Redis Cluster (--redis-url names one of its nodes); not in the
# default run, which would take too long with them (name them in --variants).
# goblin-cluster-direct: native mode through redis-py (autopipeline=False), for comparison.
CLUSTER_VARIANTS = (
    "goblin-cluster-native",
    "goblin-cluster-script",
    "goblin-cluster-direct",
    "goblin-cluster-native-cache",
)
# goblin-sql: goblin-native with SQL records (`records=`) in the handler's PostgreSQL; with
# `--handler sql` only, where the other variants' handler commits its own transaction.
SQL_VARIANTS = ("goblin-sql",)
# goblin-native-cache, goblin-cluster-native-cache: goblin-native and goblin-cluster-native
# with the replay cache on (replay_cache_bytes 4 MiB), so that one run shows what the cache
# changes (name them in --variants).
CACHE_VARIANTS = ("goblin-native-cache", "goblin-cluster-native-cache")
# goblin-native-nocache: goblin-native with the replay cache off (replay_cache_bytes=0; the
# others keep the default budget, 1 MiB).
NOCACHE_VARIANTS = ("goblin-native-nocache",)
# answer-only: no idempotency at all, a middleware that answers every request with a key
# with a fixed 201 once it has read the body: the least a replay can cost in this app (its
# outer layers, FastAPI's and Starlette's error middleware, and the server), a floor for
# any middleware's replay (name it in --variants).
FLOOR_VARIANTS = ("answer-only",)
ALL_VARIANTS = tuple(
    dict.fromkeys(
        (
            *VARIANTS,
            *CLUSTER_VARIANTS,
            *SQL_VARIANTS,
            *CACHE_VARIANTS,
            *NOCACHE_VARIANTS,
            *FLOOR_VARIANTS,
        )
    )
)
REDIS_VARIANTS = frozenset(
    {"goblin-script", "goblin-native", "goblin-native-direct", "asgi-idempotency-header"}
) | frozenset((*CLUSTER_VARIANTS, *SQL_VARIANTS, *CACHE_VARIANTS, *NOCACHE_VARIANTS))
NATIVE_VARIANTS = frozenset(
    {"goblin-native", "goblin-native-direct", "goblin-cluster-native", "goblin-cluster-direct"}
) | frozenset((*SQL_VARIANTS, *CACHE_VARIANTS, *NOCACHE_VARIANTS))

# What the handler does and how the middleware is set up, from the command line (main):
# `--body-bytes N` answers N bytes instead of the small JSON; `--handler pg` inserts one row
# into PostgreSQL (asyncpg, `--pg-dsn`) per request, `--handler sql` the same through
# SQLAlchemy (its own transaction; under goblin-sql, the run's, which commits the record
# too), `--handler session` the same through FastAPI's session dependency (the app's own,
# which commits after the handler; under goblin-sql, `Depends(session)`);
# `--compression none` stores bodies as sent.
HANDLER: dict[str, Any] = {"body_bytes": 0, "kind": "json", "pg_dsn": "", "prefill_keys": 0}
ENGINE: list[Any] = []  # --handler sql: the SQLAlchemy engine of the handler (and records)
MIDDLEWARE_OPTIONS: dict[str, Any] = {}
PG_TABLE = "bench_orders"

STATS = {"handler_calls": 0}
PIPELINE: list[Any] = []  # the auto-pipelined store's shared connections (one per primary)

Prepare = Callable[[], Awaitable[None]]


GC = {"gc_collections": 0, "gc_full": 0, "gc_us": 0, "gc_full_us": 0}
_gc_started = [0.0]


def _time_gc(phase: str, info: dict[str, int]) -> None:
    """Count every collection of this process and the time it stopped the loop."""
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    took = int((time.perf_counter() - _gc_started[0]) * 1e6)
    GC["gc_collections"] += 1
    GC["gc_us"] += took
    if info["generation"] == 2:
        GC["gc_full"] += 1
        GC["gc_full_us"] += took


gc.callbacks.append(_time_gc)


def current_stats() -> dict[str, int]:
    """The handler's runs, the garbage collections so far and, for an auto-pipelined
    store, the calls that waited on the store (it batches many requests' commands into one
    write, so the server's read count is not its number of round trips)."""
    stats = {**STATS, **GC}
    if PIPELINE:
        stats["connections_opened"] = sum(getattr(p, "opened", -1) for p in PIPELINE)
    return stats


def count_store_calls(store: Any) -> None:
    """Count each call into RedisStore's shared connection (a cluster store's: each
    primary's, as it is made) as one round trip."""
    from goblin_idem.store import _cluster as executors

    executor = store._executor
    # getattr: PYTHONPATH may name a release without the cluster fast path
    cluster_pipelined = getattr(executors, "ClusterPipelined", None)
    if cluster_pipelined is not None and isinstance(executor, cluster_pipelined):
        STATS["store_calls"] = 0
        make = executor._pipeline_for

        def counted_pipeline(address: tuple[str, int]) -> Any:
            fresh = address not in executor.pipelines
            pipeline = make(address)
            if fresh:
                count_calls(pipeline)
            return pipeline

        executor._pipeline_for = counted_pipeline  # type: ignore[method-assign]
        count_tracked_sends()
        return
    if store._pipeline is not None:
        STATS["store_calls"] = 0
        count_calls(store._pipeline)
        count_tracked_sends()


def count_tracked_sends() -> None:
    """A publish that fills the replay cache goes out on its connection directly, not
    through `execute`: count it as the round trip it is (in the releases whose publish
    filled it; since then only a duplicate's read does, in the background)."""
    from goblin_idem.store import _autopipeline as autopipeline

    tracked = getattr(autopipeline, "TrackedSend", None)  # before or after those: none
    if tracked is None:
        return
    send = tracked.send

    def counted(self: Any, commands: Any) -> Any:
        STATS["store_calls"] += 1
        return send(self, commands)

    tracked.send = counted


def count_calls(pipeline: Any) -> None:
    PIPELINE.append(pipeline)
    execute = pipeline.execute

    def counted(commands: Any) -> Any:
        # a plain function handing back the pipeline's own awaitable: counting must not add
        # a coroutine (and its frame and wake-up) to every store call it measures
        STATS["store_calls"] += 1
        return execute(commands)

    pipeline.execute = counted


def redis_kwargs(no_hiredis: bool) -> dict[str, Any]:
    """Client options: the pure-Python reply parser instead of hiredis when asked."""
    if not no_hiredis:
        return {}
    from redis._parsers import _AsyncRESP2Parser

    return {"parser_class": _AsyncRESP2Parser}


def goblin(variant: str, url: str, no_hiredis: bool) -> tuple[list[Any], Prepare]:
    from starlette.middleware import Middleware

    from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore
    from goblin_idem._keys import key_names

    store: Any
    records: Any = None
    if variant in SQL_VARIANTS:
        from goblin_idem.sql import SqlRecords

        records = SqlRecords(ENGINE[0])
    if variant == "goblin-memory":
        store = MemoryStore()
    else:
        # goblin-native-direct, goblin-cluster-direct: every call through redis-py (the
        # store before auto-pipelining)
        store = RedisStore.from_url(
            url,
            mode="script" if variant.endswith("-script") else "native",
            autopipeline=not variant.endswith("-direct"),
            cluster=variant.startswith("goblin-cluster-"),
            **redis_kwargs(no_hiredis),
            **({"replay_cache_bytes": 4 << 20} if variant in CACHE_VARIANTS else {}),
            **({"replay_cache_bytes": 0} if variant in NOCACHE_VARIANTS else {}),
        )
        count_store_calls(store)

    async def prepare() -> None:
        if records is not None:
            await records.create_table()
        names = key_names(b"idem", b"", INFLIGHT_KEY.encode())
        await store.claim(names.claim, names.result, b"bench-holder", 3600)
        if isinstance(store, MemoryStore):  # completed keys held in the process
            record = b"r" * 160  # about the size of the benchmark's records
            for i in range(HANDLER["prefill_keys"]):
                names = key_names(b"idem", b"", b"prefill-%d" % i)
                await store.claim(names.claim, names.result, b"t", 30)
                await store.publish(names.result, record, 86_400_000, names.claim, b"t")
            gc.collect()

    options = {**MIDDLEWARE_OPTIONS, "records": records}
    return [Middleware(IdempotencyMiddleware, store=store, **options)], prepare


def asgi_idempotency_header(url: str, no_hiredis: bool) -> tuple[list[Any], Prepare]:
    import redis.asyncio
    from idempotency_header_middleware import IdempotencyHeaderMiddleware
    from idempotency_header_middleware.backends.redis import RedisBackend
    from starlette.middleware import Middleware

    backend = RedisBackend(redis.asyncio.from_url(url, **redis_kwargs(no_hiredis)))

    async def prepare() -> None:
        await backend.redis.sadd(backend.KEYS_KEY, INFLIGHT_KEY)

    return [Middleware(IdempotencyHeaderMiddleware, backend=backend)], prepare


def fastapi_idempotency() -> tuple[list[Any], Prepare]:
    from fastapi_idempotency import IdempotencyMiddleware, MemoryStore
    from fastapi_idempotency.middleware import _digest
    from starlette.middleware import Middleware

    store = MemoryStore()

    async def prepare() -> None:
        # its default scope is the client address; the fingerprint must match for a 409
        await store.claim(
            key=_digest("127.0.0.1", INFLIGHT_KEY),
            scope="127.0.0.1",
            fingerprint=_digest("POST", PATH, "", BODY),
            explicit=True,
            lease_seconds=3600,
        )

    # wait_seconds=0: answer an in-flight duplicate with 409 at once, like the others
    # (its default polls for up to 15 s first)
    return [Middleware(IdempotencyMiddleware, store=store, wait_seconds=0)], prepare


class AnswerOnly:
    """The answer-only variant's middleware: a fixed 201 to any request with a key."""

    START: ClassVar[dict[str, Any]] = {
        "type": "http.response.start",
        "status": 201,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"27")],
    }
    BODY: ClassVar[dict[str, Any]] = {
        "type": "http.response.body",
        "body": b'{"id":1,"status":"created"}',
    }

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or all(n != b"idempotency-key" for n, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return
        await receive()
        await send({**self.START, "headers": list(self.START["headers"])})
        await send(dict(self.BODY))


def middleware_for(variant: str, url: str, no_hiredis: bool) -> tuple[list[Any], Prepare]:
    if variant in ("bare", *FLOOR_VARIANTS):
        from starlette.middleware import Middleware

        async def nothing() -> None:
            return None

        return ([Middleware(AnswerOnly)] if variant != "bare" else []), nothing
    if variant.startswith("goblin-"):
        return goblin(variant, url, no_hiredis)
    if variant == "asgi-idempotency-header":
        return asgi_idempotency_header(url, no_hiredis)
    if variant == "fastapi-idempotency":
        return fastapi_idempotency()
    raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(ALL_VARIANTS)}")


def starlette_app(middleware: list[Any], prepare: Prepare) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def create_order(request: Request) -> JSONResponse:
        STATS["handler_calls"] += 1
        return JSONResponse({"id": STATS["handler_calls"], "status": "created"}, 201)

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(current_stats())

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await prepare()
        yield

    routes = [Route(PATH, create_order, methods=["POST"]), Route(STATS_PATH, stats)]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


def fastapi_app(middleware: list[Any], prepare: Prepare) -> Any:
    from fastapi import Depends, FastAPI, Response

    pool: list[Any] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if HANDLER["kind"] == "pg":
            import asyncpg

            dsn = HANDLER["pg_dsn"].replace("+asyncpg", "", 1)  # asyncpg's own form
            pool.append(await asyncpg.create_pool(dsn, min_size=16, max_size=16))
        await prepare()
        yield
        if pool:
            await pool[0].close()

    app = FastAPI(middleware=middleware, lifespan=lifespan)
    padded = b'{"pad":"' + b"x" * max(0, HANDLER["body_bytes"] - 10) + b'"}'

    if HANDLER["kind"] == "pg":

        @app.post(PATH, status_code=201)
        async def insert_order() -> dict[str, object]:
            STATS["handler_calls"] += 1
            row_id = await pool[0].fetchval(
                f"INSERT INTO {PG_TABLE} (sku, qty) VALUES ($1, $2) RETURNING id", "A-1", 2
            )
            return {"id": row_id, "status": "created"}

    elif HANDLER["kind"] in ("sql", "session"):
        from sqlalchemy import Column, Integer, MetaData, Table, Text
        from sqlalchemy.ext.asyncio import AsyncSession

        from goblin_idem.sql import connection, session

        orders = Table(
            PG_TABLE,
            MetaData(),
            Column("id", Integer, primary_key=True),
            Column("sku", Text),
            Column("qty", Integer),
        )
        insert = orders.insert().values(sku="A-1", qty=2).returning(orders.c.id)
        recorded = bool(middleware) and middleware[0].kwargs.get("records") is not None

        async def own_session() -> AsyncIterator[AsyncSession]:
            """The session dependency apps write: committed after the handler."""
            async with AsyncSession(ENGINE[0]) as s:
                yield s
                await s.commit()

        if HANDLER["kind"] == "session":  # FastAPI's session dependency

            @app.post(PATH, status_code=201)
            async def insert_order_session(
                s: AsyncSession = Depends(session if recorded else own_session),  # noqa: B008
            ) -> dict[str, object]:
                STATS["handler_calls"] += 1
                row_id = (await s.execute(insert)).scalar_one()
                return {"id": row_id, "status": "created"}

        else:

            @app.post(PATH, status_code=201)
            async def insert_order_sql() -> dict[str, object]:
                STATS["handler_calls"] += 1
                if recorded:  # in the run's transaction: it commits with the record
                    row_id = (await (await connection()).execute(insert)).scalar_one()
                else:
                    async with ENGINE[0].begin() as conn:
                        row_id = (await conn.execute(insert)).scalar_one()
                return {"id": row_id, "status": "created"}

    elif HANDLER["body_bytes"]:

        @app.post(PATH, status_code=201)
        async def sized_order() -> Response:
            STATS["handler_calls"] += 1
            return Response(padded, 201, media_type="application/json")

    else:

        @app.post(PATH, status_code=201)
        async def create_order() -> dict[str, object]:
            STATS["handler_calls"] += 1
            return {"id": STATS["handler_calls"], "status": "created"}

    @app.get(STATS_PATH)
    async def stats() -> dict[str, int]:
        return current_stats()

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=ALL_VARIANTS)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--app", choices=("starlette", "fastapi"), default="starlette")
    parser.add_argument("--no-hiredis", action="store_true", help="pure-Python reply parser")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after startup")
    parser.add_argument(
        "--gc-threshold", type=int, help="the collector's first threshold (0: no collections)"
    )
    parser.add_argument("--body-bytes", type=int, default=0, help="answer this many bytes")
    parser.add_argument("--handler", choices=("json", "pg", "sql", "session"), default="json")
    parser.add_argument(
        "--pg-dsn",
        default="",
        help="PostgreSQL for --handler pg (postgresql+asyncpg://...), sql and session (its "
        "SQLAlchemy URL: +asyncpg or +psycopg)",
    )
    parser.add_argument("--compression", choices=("zlib", "none"), default="zlib")
    parser.add_argument("--prefill-keys", type=int, default=0, help="MemoryStore: keys held")
    args = parser.parse_args()
    HANDLER.update(body_bytes=args.body_bytes, kind=args.handler, pg_dsn=args.pg_dsn)
    HANDLER["prefill_keys"] = args.prefill_keys
    if args.compression == "none":
        MIDDLEWARE_OPTIONS["compression"] = None
    if args.handler in ("pg", "sql", "session") and args.app != "fastapi":
        raise SystemExit(f"--handler {args.handler} serves the FastAPI app only")
    if args.variant in SQL_VARIANTS and args.handler not in ("sql", "session"):
        raise SystemExit(f"{args.variant} needs --handler sql or session")
    if args.handler in ("sql", "session"):
        from sqlalchemy.ext.asyncio import create_async_engine

        ENGINE.append(create_async_engine(args.pg_dsn, pool_size=16, max_overflow=0))
    if args.variant in REDIS_VARIANTS and not args.redis_url:
        raise SystemExit(f"{args.variant} needs --redis-url")

    import uvicorn

    middleware, prepare = middleware_for(args.variant, args.redis_url, args.no_hiredis)
    build = fastapi_app if args.app == "fastapi" else starlette_app
    app = build(middleware, prepare)
    if args.gc_threshold is not None:  # what a first run's HTTP cost owes to the collector
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    if args.gc_freeze:  # full collections then skip what startup left on the heap
        gc.collect()
        gc.freeze()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
