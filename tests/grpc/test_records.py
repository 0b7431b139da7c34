"""SQL records under the gRPC interceptor: the handler's writes through
goblin_idem.sql.connection() commit with the call's record, a call whose outcome is not
kept rolls them back, and with the store flushed a duplicate is answered from the database
(PostgreSQL with asyncpg and psycopg, SQLite with aiosqlite; Redis and Valkey)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from sqlalchemy import insert

from goblin_idem import MemoryStore
from goblin_idem.grpc import AsyncIdempotencyInterceptor, IdempotencyInterceptor
from goblin_idem.sql import SqlRecords, connection
from tests.grpc.conftest import CHARGE, pb2, pb2_grpc, raw, serving
from tests.sql.conftest import Setup, pg_database  # noqa: F401
from tests.sql.conftest import setup as setup


class Recording(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """Writes a payment row in the run's transaction, then answers as the account says."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.runs = 0

    async def Charge(self, request: Any, context: Any) -> Any:
        self.runs += 1
        conn = await connection()
        await conn.execute(
            insert(self.setup.payments).values(ref=request.request_id, amount=request.amount)
        )
        if request.account == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "failed after the write")
        if request.account == "missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
        return pb2.ChargeReply(charge_id=f"ch_{self.runs}", amount=request.amount)


async def call(channel: grpc.aio.Channel, request: Any) -> tuple[grpc.StatusCode, bytes | None]:
    try:
        return grpc.StatusCode.OK, await raw(channel, CHARGE)(request)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), None


async def test_the_writes_commit_with_the_record_and_the_database_answers_a_duplicate(
    setup: Setup,
) -> None:
    interceptor = AsyncIdempotencyInterceptor(setup.store, records=setup.records)
    service = Recording(setup)
    request = pb2.ChargeRequest(request_id="r-1", amount=7)
    async with serving([interceptor], service) as (_, channel):  # type: ignore[arg-type]
        first = await call(channel, request)
        await setup.store.client.flushall()  # the store lost everything: the database has it
        again = await call(channel, request)
    assert first == again and first[0] == grpc.StatusCode.OK
    assert service.runs == 1 and await setup.payment_count("r-1") == 1
    assert len(await setup.rows()) == 1


async def test_an_outcome_not_kept_rolls_the_writes_back(setup: Setup) -> None:
    interceptor = AsyncIdempotencyInterceptor(setup.store, records=setup.records)
    service = Recording(setup)
    async with serving([interceptor], service) as (_, channel):  # type: ignore[arg-type]
        failed = await call(channel, pb2.ChargeRequest(request_id="r-2", account="fail"))
        missing = [
            await call(channel, pb2.ChargeRequest(request_id="r-3", account="missing"))
            for _ in range(2)
        ]
    assert failed[0] == grpc.StatusCode.UNAVAILABLE and await setup.payment_count("r-2") == 0
    assert [m[0] for m in missing] == [grpc.StatusCode.NOT_FOUND] * 2
    assert await setup.payment_count("r-3") == 1 and service.runs == 2  # NOT_FOUND is kept


def test_the_sync_interceptor_refuses_records_it_cannot_join(tmp_path: Any) -> None:
    records = SqlRecords(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    with pytest.raises(TypeError, match="AsyncIdempotencyInterceptor"):
        IdempotencyInterceptor(MemoryStore(), records=records)
