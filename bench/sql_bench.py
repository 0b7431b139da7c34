"""Round trips of a run's record commit on PostgreSQL, per driver.

    python3 bench/sql_bench.py [--latency-ms 20] [--runs 5]

A throwaway PostgreSQL (tests/support/postgres.py) is reached through the test suite's
loopback proxy with `latency` added each way, so a round trip costs twice that; a run's
closing commit (`RunTransaction.commit`: the record's insert and the COMMIT) is timed and
divided by it. Two cases: the handler wrote through ``connection()`` first (its
transaction already begun: the usual one), and the handler wrote nothing (the commit opens
the transaction itself). And the lookup a won claim makes, for a key with no row.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from goblin_idem._recording import RecordRow
from goblin_idem.sql import SqlRecords
from tests.support.postgres import start_postgres
from tests.support.proxy import Proxy

DRIVERS = ("asyncpg", "psycopg")


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


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    one_way = args.latency_ms / 1000
    postgres = start_postgres()
    try:
        database = postgres.new_database()
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
    finally:
        postgres.remove()


if __name__ == "__main__":
    asyncio.run(main())
