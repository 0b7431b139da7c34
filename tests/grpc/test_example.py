"""The example app's gRPC service (example_app/rpc.py) on a real grpc.aio server: one
charge per request_id, the duplicate answered with the first call's bytes (from the
database once the store lost them), refusals kept, calls without an id charged each time;
and ``python -m example_app.rpc`` as a process, stopped by SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc

from example_app.payments import Database, ledger_view
from example_app.rpc import pb2, pb2_grpc, serve
from goblin_idem import RedisStore
from tests.support.procs import output_of, spawn
from tests.support.servers import Server, free_port

CHARGE = "/example.payments.v1.Payments/Charge"


@contextlib.asynccontextmanager
async def service(store: RedisStore) -> AsyncIterator[tuple[Database, grpc.aio.Channel]]:
    database = Database()
    server, port = await serve(store, database, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield database, channel
    finally:
        await server.stop(None)
        await database.aclose()


async def charge(channel: grpc.aio.Channel, **fields: Any) -> tuple[Any, bytes | None, str | None]:
    """The call's status, its response bytes as they came, and its replayed trailer."""
    request = pb2.ChargeRequest(
        **{"account": "acct_1", "amount_cents": 500, "currency": "EUR", **fields}
    )
    call = channel.unary_unary(CHARGE, request_serializer=lambda m: m.SerializeToString())(request)
    try:
        reply = await call
    except grpc.aio.AioRpcError as exc:
        reply = None
        trailers = exc.trailing_metadata()
        return exc.code(), reply, dict(trailers or ()).get("idempotent-replayed")
    return (
        grpc.StatusCode.OK,
        reply,
        dict(await call.trailing_metadata()).get("idempotent-replayed"),
    )


async def test_one_charge_per_request_id_even_with_the_store_flushed(store: RedisStore) -> None:
    async with service(store) as (database, channel):
        first = await charge(channel, request_id="order-1")
        again = await charge(channel, request_id="order-1")
        await store.client.flushall()  # type: ignore[union-attr]
        flushed = await charge(channel, request_id="order-1")
        ledger = await ledger_view(database.engine, "acct_1")
    assert first[0] == grpc.StatusCode.OK and first[2] is None
    assert again[1] == first[1] == flushed[1] and again[2] == flushed[2] == "true"
    assert ledger["payments_total"] == 1
    assert ledger["accounts"]["acct_1"]["by_key"] == {"order-1": ["pay_000001"]}


async def test_refusals_are_kept_and_calls_without_an_id_charge_each_time(
    store: RedisStore,
) -> None:
    async with service(store) as (database, channel):
        refused = [await charge(channel, request_id="order-2", currency="euro") for _ in range(2)]
        plain = [await charge(channel) for _ in range(2)]
        ledger = await ledger_view(database.engine, "acct_1")
    assert [r[0] for r in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert [r[2] for r in refused] == [None, "true"]
    assert [p[0] for p in plain] == [grpc.StatusCode.OK] * 2 and plain[0][1] != plain[1][1]
    assert ledger["payments_total"] == 2 and ledger["accounts"]["acct_1"]["by_key"] == {}


def test_the_service_runs_as_a_process_and_stops_on_sigterm(
    redis_server: Server, tmp_path: Any
) -> None:
    port = free_port()
    env = {
        "REDIS_URL": redis_server.url,
        "GOBLIN_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'example.db'}",
    }
    proc = spawn(["-m", "example_app.rpc", "--port", str(port)], env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = pb2_grpc.PaymentsStub(channel)
            request = pb2.ChargeRequest(
                request_id=f"proc-{os.getpid()}", account="acct_2", amount_cents=7, currency="EUR"
            )
            first, again = stub.Charge(request), stub.Charge(request)
        assert first == again and first.account == "acct_2"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        said = output_of(proc)
    assert f"gRPC payments on 127.0.0.1:{port}" in said and "Traceback" not in said
