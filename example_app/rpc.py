"""`python -m example_app.rpc [--port 50051]`: the example app's payments as a gRPC service.

``Payments.Charge`` (example_app/payments_service.proto) charges the same ledger as ``POST
/payments``: a row of ``payments`` written through the run's connection, under
`AsyncIdempotencyInterceptor` with the app's `SqlRecords`. So the row commits with the
call's outcome, and a duplicate (the same ``request_id``, AIP-155's field) gets the first
call's reply, from the database if the store lost it; a refusal (INVALID_ARGUMENT) is kept
and replayed too. A call without a ``request_id`` charges in a transaction of its own,
every time.

Settings come from the environment as for ``python -m example_app``: ``REDIS_URL`` (unset:
the embedded MemoryStore), ``GOBLIN_DATABASE_URL`` (the HTTP app's URL: one ledger for
both; unset, a new SQLite file removed at exit), ``GOBLIN_LEASE_SECONDS`` and
``GOBLIN_TTL_SECONDS``. The .proto is compiled at import by grpcio-tools.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from goblin_idem import MemoryStore, RedisStore, Store
from goblin_idem.grpc import AsyncIdempotencyInterceptor

from .app import NAME, redact
from .payments import Database, charge, writes

__all__ = ["Payments", "main", "pb2", "pb2_grpc", "serve"]

logger = logging.getLogger("example_app.rpc")

PROTO = Path(__file__).with_name("payments_service.proto")
DEFAULT_PORT = 50051


def _compiled() -> tuple[ModuleType, ModuleType]:
    """payments_service_pb2 and its _grpc module, compiled from `PROTO` into a temporary
    directory (removed at exit), as ``python -m grpc_tools.protoc`` would."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise ImportError(
            "example_app.rpc compiles example_app/payments_service.proto at start: "
            "pip install grpcio-tools"
        ) from None
    out = tempfile.mkdtemp(prefix="example-app-protos-")
    atexit.register(shutil.rmtree, out, True)
    status = protoc.main(
        [
            "protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed ({status}) on {PROTO}")
    sys.path.insert(0, out)
    return (
        importlib.import_module("payments_service_pb2"),
        importlib.import_module("payments_service_pb2_grpc"),
    )


pb2, pb2_grpc = _compiled()


class Payments(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """``Charge``: the checks of ``POST /payments``' body, then one payment in the ledger."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def Charge(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if not re.fullmatch(NAME, request.account):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"account must match {NAME}")
        if not 0 < request.amount_cents <= 10**12:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "amount_cents must be > 0")
        if not re.fullmatch(r"[A-Z]{3}", request.currency):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "currency must be ISO 4217")
        async with writes(self.database.engine) as conn:  # under a request_id: the run's
            payment = await charge(
                conn,
                request.account,
                request.amount_cents,
                request.currency,
                request.request_id or None,
            )
        return pb2.Payment(
            id=payment.id,
            account=payment.account,
            amount_cents=payment.amount_cents,
            currency=payment.currency,
            created=payment.created,
        )


async def serve(
    store: Store,
    database: Database,
    address: str = f"127.0.0.1:{DEFAULT_PORT}",
    *,
    lease_seconds: float = 30,
    ttl_seconds: float = 86_400,
) -> tuple[grpc.aio.Server, int]:
    """The service started on `address` (its tables made), and the port it is bound to."""
    await database.create_tables()
    interceptor = AsyncIdempotencyInterceptor(
        store, records=database.records, lease_seconds=lease_seconds, ttl_seconds=ttl_seconds
    )
    server = grpc.aio.server(interceptors=[interceptor])
    pb2_grpc.add_PaymentsServicer_to_server(Payments(database), server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port


async def _run(host: str, port: int, environ: Mapping[str, str]) -> None:
    redis_url = environ.get("REDIS_URL") or None
    store: Store = RedisStore.from_url(redis_url) if redis_url else MemoryStore()
    database = Database(environ.get("GOBLIN_DATABASE_URL") or None)
    server, bound = await serve(
        store,
        database,
        f"{host}:{port}",
        lease_seconds=int(environ.get("GOBLIN_LEASE_SECONDS", "30")),
        ttl_seconds=int(environ.get("GOBLIN_TTL_SECONDS", "86400")),
    )
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    where = redact(redis_url) if redis_url else "the embedded MemoryStore"
    logger.info(
        "gRPC payments on %s:%d (store: %s; database: %s)", host, bound, where, database.where
    )
    try:
        await stopping.wait()
    finally:
        await server.stop(5)
        await database.aclose()
        if isinstance(store, RedisStore):
            await store.aclose()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app.rpc")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 50051)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    asyncio.run(_run(args.host, args.port, environ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
