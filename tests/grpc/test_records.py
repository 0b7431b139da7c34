"""SQL records under the gRPC interceptor: the handler's writes through
goblin_idem.sql.connection() commit with the call's record, a call whose outcome is not
kept rolls them back, and with the store flushed a duplicate is answered from the database
(PostgreSQL with asyncpg and psycopg, SQLite with aiosqlite; Redis and Valkey). The same on
a sync server with a sync Engine (psycopg, pysqlite), through goblin_idem.sql.sync."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from sqlalchemy import create_engine, insert

from goblin_idem import MemoryStore, SqlRecordsError
from goblin_idem.grpc import AsyncIdempotencyInterceptor, IdempotencyInterceptor
from goblin_idem.sql import SqlRecords, SyncSqlRecords, connection, sync
from tests.grpc.conftest import CHARGE, pb2, pb2_grpc, raw, serving
from tests.grpc.test_sync import serving as sync_serving
from tests.sql.conftest import Setup, SyncSetup, pg_database  # noqa: F401
from tests.sql.conftest import setup as setup
from tests.sql.conftest import sync_setup as sync_setup


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


# -- the sync server: records whose transaction is the handler's thread's -----------------


class SyncRecording(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """`Recording` for a sync server, writing through goblin_idem.sql.sync: account
    ``session`` writes through session(), anything else through connection()."""

    def __init__(self, setup: SyncSetup) -> None:
        self.setup = setup
        self.runs = 0
        self.lock = threading.Lock()

    def Charge(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.runs += 1
        row = insert(self.setup.payments).values(ref=request.request_id, amount=request.amount)
        if request.account == "session":
            db = sync.session()
            db.execute(row)
            db.commit()  # a savepoint released: only the run commits
        else:
            sync.connection().execute(row)
        if request.account == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "failed after the write")
        if request.account == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
        if request.account == "raise":
            raise RuntimeError("the handler failed after its write")
        return pb2.ChargeReply(charge_id=f"ch_{self.runs}", amount=request.amount)


def sync_call(channel: grpc.Channel, request: Any) -> tuple[grpc.StatusCode, bytes | None]:
    send = channel.unary_unary(CHARGE, request_serializer=lambda m: m.SerializeToString())
    try:
        return grpc.StatusCode.OK, send(request, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), None


def flush(setup: SyncSetup) -> None:
    with setup.redis.sync_client() as client:
        client.flushall()


@pytest.mark.parametrize("account", ["connection", "session"])
def test_sync_writes_commit_with_the_record_and_the_database_answers_a_duplicate(
    sync_setup: SyncSetup, account: str
) -> None:
    interceptor = IdempotencyInterceptor(sync_setup.store(), records=sync_setup.records)
    service = SyncRecording(sync_setup)
    request = pb2.ChargeRequest(request_id="s-1", account=account, amount=7)
    with sync_serving(interceptor, service) as (_, channel):
        first = sync_call(channel, request)
        flush(sync_setup)  # the store lost everything: the database has it
        again = sync_call(channel, request)
    assert first == again and first[0] == grpc.StatusCode.OK
    assert service.runs == 1 and sync_setup.payment_count("s-1") == 1
    assert len(sync_setup.rows()) == 1


def test_sync_outcomes_not_kept_roll_the_writes_back(sync_setup: SyncSetup) -> None:
    interceptor = IdempotencyInterceptor(sync_setup.store(), records=sync_setup.records)
    service = SyncRecording(sync_setup)
    with sync_serving(interceptor, service) as (_, channel):
        failed = [
            sync_call(channel, pb2.ChargeRequest(request_id="s-2", account="fail"))
            for _ in range(2)
        ]
        raised = sync_call(channel, pb2.ChargeRequest(request_id="s-4", account="raise"))
        missing = [
            sync_call(channel, pb2.ChargeRequest(request_id="s-3", account="missing"))
            for _ in range(2)
        ]
    # Not kept: each call ran (the key released) and nothing of it stayed.
    assert [f[0] for f in failed] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert raised[0] == grpc.StatusCode.UNKNOWN
    assert sync_setup.payment_count("s-2") == 0 and sync_setup.payment_count("s-4") == 0
    # NOT_FOUND is kept: its write committed with it, and the duplicate ran nothing.
    assert [m[0] for m in missing] == [grpc.StatusCode.NOT_FOUND] * 2
    assert sync_setup.payment_count("s-3") == 1 and service.runs == 4
    assert len(sync_setup.rows()) == 1


def test_sync_concurrent_duplicates_write_once(sync_setup: SyncSetup) -> None:
    interceptor = IdempotencyInterceptor(
        sync_setup.store(), records=sync_setup.records, wait_seconds=20
    )
    service = SyncRecording(sync_setup)
    request = pb2.ChargeRequest(request_id="s-5", amount=3)
    with sync_serving(interceptor, service) as (_, channel), ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: sync_call(channel, request), range(20)))
    assert {a[0] for a in answers} == {grpc.StatusCode.OK} and len(set(answers)) == 1
    assert service.runs == 1 and sync_setup.payment_count("s-5") == 1


def test_the_sync_interceptor_refuses_records_it_cannot_join(tmp_path: Any) -> None:
    records = SqlRecords(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    with pytest.raises(TypeError, match=r"sync Engine.*AsyncIdempotencyInterceptor"):
        IdempotencyInterceptor(MemoryStore(), records=records)


def test_the_async_interceptor_refuses_sync_records(tmp_path: Any) -> None:
    records = SyncSqlRecords(create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    with pytest.raises(TypeError, match="AsyncEngine"):
        AsyncIdempotencyInterceptor(MemoryStore(), records=records)


def test_the_sync_interceptor_checks_its_records_table_at_start(tmp_path: Any) -> None:
    records = SyncSqlRecords(create_engine(f"sqlite:///{tmp_path / 'app.db'}"))  # no table made
    with pytest.raises(SqlRecordsError, match=r"create_table\(\)"):
        IdempotencyInterceptor(MemoryStore(), records=records)
