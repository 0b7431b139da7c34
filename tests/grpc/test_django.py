"""Django's records on a sync gRPC server: the records project (tests/support/apps/
django_records) serving ``Charge`` under IdempotencyInterceptor with ``DjangoRecords()``, in
a process of its own, on PostgreSQL and on a SQLite file, with Redis as the store. The
handler writes through the ORM; its write and the call's record commit in one atomic block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.django.test_records import Site, make_site
from tests.grpc.conftest import CHARGE, pb2
from tests.sql.conftest import pg_database  # noqa: F401
from tests.support.procs import output_of, spawn
from tests.support.servers import Server, free_port

SERVER = "tests.support.apps.django_records.grpc_server"


@pytest.fixture(params=["sqlite", "postgresql"])
def site(request: pytest.FixtureRequest, tmp_path: Path, redis_server: Server) -> Site:
    database = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    with redis_server.sync_client() as client:
        client.flushall()
    return make_site(tmp_path, redis_server, database)


@contextlib.contextmanager
def serving(site: Site) -> Iterator[grpc.Channel]:
    """The project's gRPC server on a free port, and a channel to it once it answers."""
    port = free_port()
    proc = spawn(["-m", SERVER], {**site.env, "GRPC_PORT": str(port)})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=60)
            except grpc.FutureTimeoutError:
                raise AssertionError(f"the server did not start: {output_of(proc)}") from None
            yield channel
    finally:
        output_of(proc)  # stopped by its PID


def call(channel: grpc.Channel, request: Any) -> tuple[grpc.StatusCode, bytes | None]:
    send = channel.unary_unary(CHARGE, request_serializer=lambda m: m.SerializeToString())
    try:
        return grpc.StatusCode.OK, send(request, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), None


def test_the_orm_write_commits_with_the_record_and_the_database_answers_a_duplicate(
    site: Site, redis_server: Server
) -> None:
    request = pb2.ChargeRequest(request_id="dj-1", amount=7)
    with serving(site) as channel:
        first = call(channel, request)
        with redis_server.sync_client() as client:
            client.flushall()  # the store lost everything: the database has it
        again = call(channel, request)
    assert first[0] == grpc.StatusCode.OK and first == again
    assert site.count("dj-1") == 1 and site.records() == 1


def test_an_outcome_not_kept_rolls_the_orm_write_back(site: Site) -> None:
    with serving(site) as channel:
        failed = [
            call(channel, pb2.ChargeRequest(request_id="dj-2", account="fail")) for _ in range(2)
        ]
        missing = [
            call(channel, pb2.ChargeRequest(request_id="dj-3", account="missing")) for _ in range(2)
        ]
    # Not kept: the key released each time, and neither run's write stayed.
    assert [f[0] for f in failed] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert site.count("dj-2") == 0
    # NOT_FOUND is kept: its write committed with its record, the duplicate ran nothing.
    assert [m[0] for m in missing] == [grpc.StatusCode.NOT_FOUND] * 2
    assert site.count("dj-3") == 1 and site.records() == 1


@pytest.mark.parametrize("site", ["postgresql"], indirect=True)
def test_a_connection_the_database_dropped_is_replaced_at_the_next_call(site: Site) -> None:
    """The server's threads keep their connections between calls: one the database ended
    (a restart, a failover) answers UNAVAILABLE at most once, and the calls after get a
    new one."""
    assert site.postgres is not None
    with serving(site) as channel:
        codes = [call(channel, pb2.ChargeRequest(request_id=f"dj-4-{i}"))[0] for i in range(8)]
        site.postgres.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{site.database}' AND pid <> pg_backend_pid()"
        )
        after = [call(channel, pb2.ChargeRequest(request_id=f"dj-5-{i}"))[0] for i in range(16)]
    assert codes == [grpc.StatusCode.OK] * 8
    assert after[-8:] == [grpc.StatusCode.OK] * 8, after
