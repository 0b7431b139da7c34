"""Round trips of a run's record commit on PostgreSQL, per driver.

    python3 bench/sql_bench.py [--latency-ms 20] [--runs 5] [--messages | --instructions]
                               [--sync]

A throwaway PostgreSQL (tests/support/postgres.py) is reached through the test suite's
loopback proxy with `latency` added each way, so a round trip costs twice that; a run's
closing commit (`RunTransaction.commit`: the record's insert and the COMMIT) is timed and
divided by it. Two cases: the handler wrote through ``connection()`` first (its
transaction already begun: the usual one), and the handler wrote nothing (the commit opens
the transaction itself). And the lookup a won claim makes, for a key with no row. And a
new key's whole run as the middleware makes it (the lookup that keeps its connection for
the run, one INSERT through ``session()``, the commit), beside the same INSERT in an
AsyncSession of the app's own that commits (no records).

`--messages` prints, for that whole run and driver, what the client sent in each round
trip (PostgreSQL's frontend messages: Q a query as text, P/B/E a statement parsed, bound,
executed, S a sync), read by a forwarder of its own with no latency.

`--instructions` counts this process's instructions per new key's whole run, with records
and without (valgrind's callgrind, in a child process per count: 30 runs, then 130, the
difference over 100; the server's work is not in them).

`--sync` measures that whole run on a sync Engine instead (psycopg: `SyncSqlRecords`, the
WSGI, Flask and sync gRPC adapters' records), as those adapters make it: the lookup and
the INSERT through ``goblin_idem.sql.sync.connection()`` in the request's thread (a
``session()`` adds its savepoint's two), the steps around them on the loop thread
(`goblin_idem._threads`), beside the same INSERT in a Session of the app's own that
commits. With `--messages` or `--instructions` only.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Column, Integer, MetaData, Table, Text, create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from goblin_idem._recording import RecordRow, kept
from goblin_idem._threads._exchange import Exchange
from goblin_idem._threads._loop import loop_thread
from goblin_idem._threads._records import ThreadedRecords, ThreadedTransaction
from goblin_idem.sql import SqlRecords, SyncSqlRecords, sync
from tests.support.postgres import start_postgres
from tests.support.proxy import Proxy

DRIVERS = ("asyncpg", "psycopg")
ORDERS = Table(
    f"bench_orders_{secrets.token_hex(3)}",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("sku", Text),
    Column("qty", Integer),
)
INSERT = ORDERS.insert().values(sku="A-1", qty=2).returning(ORDERS.c.id)


async def measure(url: str, runs: int, handler_wrote: bool) -> list[float]:
    engine = create_async_engine(url, pool_size=1)
    records = SqlRecords(engine, table=f"bench_{secrets.token_hex(3)}")
    await records.create_table()
    times = []
    for _ in range(runs + 1):  # the first one warms the pool (connects)
        tx = records.transaction()
        if handler_wrote:
            conn = await tx.connection()
            await conn.execute(text("SELECT 1"))
        start = time.perf_counter()
        row = RecordRow(b"k:" + secrets.token_bytes(8), "h", bytes(16), b"GI" * 100, 60_000)
        await tx.commit(row)
        times.append(time.perf_counter() - start)
    await engine.dispose()
    return times[1:]


async def measure_lookup(url: str, runs: int) -> list[float]:
    engine = create_async_engine(url, pool_size=1)
    records = SqlRecords(engine, table=f"bench_{secrets.token_hex(3)}")
    await records.create_table()
    times = []
    for _ in range(runs + 1):  # the first one warms the pool (connects)
        start = time.perf_counter()
        await records.lookup(b"k:" + secrets.token_bytes(8))
        times.append(time.perf_counter() - start)
    await engine.dispose()
    return times[1:]


async def bare_run(engine: AsyncEngine) -> None:
    """The INSERT in an AsyncSession of the app's own, which commits."""
    async with AsyncSession(engine) as s:
        (await s.execute(INSERT)).scalar_one()
        await s.commit()


async def recorded_run(records: SqlRecords) -> None:
    """A new key's run as the middleware makes it: the lookup (its connection kept for the
    run), the INSERT through the run's session, the record's commit."""
    key = b"k:" + secrets.token_bytes(8)
    found, looked = await records.lookup_for_run(key)
    assert found is None
    kept.set(looked)
    run = records.transaction(lambda: "POST /orders")
    token = run.enter()
    try:
        s = await run.session()
        (await s.execute(INSERT)).scalar_one()
        await run.commit(RecordRow(key, "ab" * 32, bytes(16), b"GI" * 80, 60_000))
    finally:
        run.leave(token)


async def made(url: str) -> tuple[AsyncEngine, dict[str, Callable[[], Awaitable[None]]]]:
    """An engine of one pooled connection, the tables, and the two kinds of run on it."""
    engine = create_async_engine(url, pool_size=1, max_overflow=0)
    records = SqlRecords(engine, table=f"bench_{secrets.token_hex(3)}")
    await records.create_table()
    async with engine.begin() as conn:
        await conn.run_sync(ORDERS.metadata.create_all)
    return engine, {
        "no records": lambda: bare_run(engine),
        "records": lambda: recorded_run(records),
    }


def sync_bare_run(engine: Engine) -> None:
    """The INSERT in a Session of the app's own, which commits."""
    with Session(engine) as s:
        s.execute(INSERT).scalar_one()
        s.commit()


def sync_recorded_run(records: ThreadedRecords) -> None:
    """A new key's run as the sync adapters make it: the loop thread's steps (the lookup,
    the commit) crossing to this thread, the request's, where the INSERT is written."""
    key = b"k:" + secrets.token_bytes(8)

    async def steps() -> None:
        assert await records.lookup(key) is None
        run = records.transaction(lambda: "POST /orders")
        await Exchange.running().call(sync_write, run)  # type: ignore[union-attr]
        await run.commit(RecordRow(key, "ab" * 32, bytes(16), b"GI" * 80, 60_000))

    exchange = Exchange(loop_thread())
    exchange.start(steps())
    exchange.wait()


def sync_write(run: ThreadedTransaction) -> None:
    work = run.begin()
    token = work.enter()
    try:
        sync.connection().execute(INSERT).scalar_one()
    finally:
        work.leave(token)


async def made_sync(url: str) -> tuple[Engine, dict[str, Callable[[], Awaitable[None]]]]:
    """`made` on a sync Engine: each run in a thread of its own, as a sync server's."""
    engine = create_engine(url, pool_size=1, max_overflow=0)
    records = SyncSqlRecords(engine, table=f"bench_{secrets.token_hex(3)}")
    records.create_table()
    ORDERS.metadata.create_all(engine)
    threaded = ThreadedRecords(records)
    return engine, {
        "no records": lambda: asyncio.to_thread(sync_bare_run, engine),
        "records": lambda: asyncio.to_thread(sync_recorded_run, threaded),
    }


async def made_for(url: str, synced: bool) -> tuple[Any, dict[str, Callable[[], Awaitable[None]]]]:
    """`made`, or `made_sync` for a sync Engine (`synced`); its engine disposed by `disposed`."""
    return await (made_sync(url) if synced else made(url))


async def disposed(engine: Any) -> None:
    done = engine.dispose()
    if done is not None:
        await done


async def measure_runs(url: str, runs: int) -> dict[str, list[float]]:
    """Each kind of run `runs` times, after as many (at least 6) to warm up: psycopg
    prepares a statement from its fifth execution on a connection."""
    engine, kinds = await made(url)
    times: dict[str, list[float]] = {}
    for name, run in kinds.items():
        for _ in range(max(runs, 6)):
            await run()
        times[name] = []
        for _ in range(runs):
            start = time.perf_counter()
            await run()
            times[name].append(time.perf_counter() - start)
    await engine.dispose()
    return times


async def show_messages(url: str, messages: Messages, driver: str, synced: bool) -> None:
    engine, kinds = await made_for(url, synced)
    for name, run in kinds.items():
        for _ in range(6):  # connected, and psycopg's statements prepared
            await run()
        messages.take()
        await run()
        trips = messages.take()
        shown = " | ".join(" ".join(trip) for trip in trips)
        print(f"{driver:8} {name:10} {len(trips)} round trips: {shown}")
    await disposed(engine)


class Messages:
    """A loopback forwarder to PostgreSQL that notes the client's messages, split where
    the client sent again after an answer (a round trip)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.trips: list[list[str]] = []
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._pair, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]

    async def _pair(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        state: dict[str, Any] = {"answered": True, "started": False, "buf": b""}

        async def up() -> None:
            while data := await client_r.read(65536):
                if state["answered"]:
                    self.trips.append([])
                    state["answered"] = False
                state["buf"] += data
                self._parse(state)
                server_w.write(data)
            server_w.close()

        async def down() -> None:
            while data := await server_r.read(65536):
                state["answered"] = True
                client_w.write(data)
            client_w.close()

        await asyncio.gather(up(), down(), return_exceptions=True)

    def _parse(self, state: dict[str, Any]) -> None:
        buf = state["buf"]
        while True:
            if not state["started"]:  # the startup packet (and SSL/GSS requests): no type
                if len(buf) < 8 or len(buf) < struct.unpack("!I", buf[:4])[0]:
                    break
                size, code = struct.unpack("!II", buf[:8])
                buf = buf[size:]
                state["started"] = code not in (80877103, 80877104)
                continue
            if len(buf) < 5 or len(buf) < 1 + struct.unpack("!I", buf[1:5])[0]:
                break
            kind, size = chr(buf[0]), struct.unpack("!I", buf[1:5])[0]
            body, buf = buf[5 : 1 + size], buf[1 + size :]
            if kind in "QP":
                query = body.split(b"\0", 2)[1 if kind == "P" else 0].decode()
                words = "+".join(p.split()[0] for p in query.split(";") if p.strip())
                self.trips[-1].append(f"{kind}({words})")
            elif kind in "BES":
                self.trips[-1].append(kind)
        state["buf"] = buf

    def take(self) -> list[list[str]]:
        trips, self.trips = self.trips, []
        return trips


INSTRUCTION_RUNS = (30, 130)


def instructions(url: str, kind: str, synced: bool) -> float:
    """Instructions per run of `kind` (callgrind, a child process per count)."""
    totals = []
    for runs in INSTRUCTION_RUNS:
        with tempfile.NamedTemporaryFile(suffix=".callgrind") as out:
            command = [sys.executable, __file__, "--child", url, kind, str(runs)]
            command += ["--sync"] if synced else []
            subprocess.run(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}", *command],
                check=True,
                capture_output=True,
            )
            found = re.search(rb"^(?:summary|totals): (\d+)", out.read(), re.M)
            assert found is not None, "no totals in callgrind's output"
            totals.append(int(found[1]))
    return (totals[1] - totals[0]) / (INSTRUCTION_RUNS[1] - INSTRUCTION_RUNS[0])


async def child(url: str, kind: str, runs: int, synced: bool) -> None:
    """`runs` runs of `kind`, after as many as `measure_runs` warms up with."""
    engine, kinds = await made_for(url, synced)
    for _ in range(6 + runs):
        await kinds[kind]()
    await disposed(engine)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--messages", action="store_true")
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # URL KIND RUNS
    args = parser.parse_args()
    if args.child:
        url, kind, runs = args.child
        return await child(url, kind, int(runs), args.sync)
    if args.sync and not (args.messages or args.instructions):
        parser.error("--sync goes with --messages or --instructions")
    drivers = ("psycopg",) if args.sync else DRIVERS
    one_way = args.latency_ms / 1000
    postgres = start_postgres()
    try:
        database = postgres.new_database()
        if args.instructions:
            for driver in drivers:
                for kind in ("no records", "records"):
                    count = instructions(postgres.url(database, driver), kind, args.sync)
                    print(f"{driver:8} {kind:10} {count:,.0f} instructions per new key")
            return
        if args.messages:
            messages = Messages(postgres.port)
            for driver in drivers:
                url = postgres.url(database, driver).replace(
                    f":{postgres.port}/", f":{messages.port}/"
                )
                await show_messages(url, messages, driver, args.sync)
            return
        with Proxy(postgres.port) as proxy:
            proxy.latency = (one_way, one_way)
            for driver in DRIVERS:
                url = postgres.url(database, driver).replace(
                    f":{postgres.port}/", f":{proxy.port}/"
                )
                for wrote in (True, False):
                    times = await measure(url, args.runs, wrote)
                    trips = statistics.median(times) / (2 * one_way)
                    case = "handler wrote first" if wrote else "handler wrote nothing"
                    print(f"{driver:8} {case:22} commit: {trips:.1f} round trips")
                trips = statistics.median(await measure_lookup(url, args.runs)) / (2 * one_way)
                print(f"{driver:8} {'a new key':22} lookup: {trips:.1f} round trips")
                for name, times in (await measure_runs(url, args.runs)).items():
                    trips = statistics.median(times) / (2 * one_way)
                    case = f"a new key, {name}"
                    print(f"{driver:8} {case:22} whole run: {trips:.1f} round trips")
    finally:
        postgres.remove()


if __name__ == "__main__":
    asyncio.run(main())
