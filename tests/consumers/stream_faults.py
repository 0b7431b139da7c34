"""Randomized faults over a Redis Streams consumer group, on real servers: the scenario of
``tests/consumers/test_stream_faults.py`` and ``bench/consumer_faults.py``.

A throwaway PostgreSQL, a redis-server holding the stream (the broker, never restarted) and
another without persistence holding the claims and results (the store), and `workers`
consumer processes (`stream_fault_worker`) in one group, each writing a row per message to
``effects``. A producer publishes `messages` message ids, and again a share of them
(`duplicates`, a producer's retries) at random later moments. Meanwhile a seeded fault
schedule, at random moments, restarts the store empty (every claim and result gone; once
for certain with every worker, when every id has been published once) or
SIGKILLs a worker (started again at once), and every worker SIGKILLs itself with
`kill_chance` per message when about to ack (its effect committed, its entry pending). When
the faults stop, every worker is alive again and the group has acked every entry, the rows
are counted: a second row for a message id is a duplicate effect, an id without one is lost.

With records (``records=True``) the rows commit in the run's transaction with its record
(``goblin_idem.sql``), and the expected duplicates are 0; without, each row commits on its
own before the result is stored: the control, where a restarted store lets a copy run again.
Every process runs on 127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio

from goblin_idem.sql import SqlRecords
from tests.support.postgres import start_postgres
from tests.support.procs import spawn, stop
from tests.support.servers import Server, start_server

STREAM = "payments"


@dataclass(frozen=True)
class Options:
    seed: int = 20261207
    messages: int = 400
    duplicates: float = 0.25  # the share of ids published again later
    duration: float = 15.0  # seconds of publishing and faults
    workers: int = 2
    fault_gap: float = 1.5  # mean seconds between faults
    kill_chance: float = 0.01  # per message, a worker's SIGKILL before its ack
    records: bool = True


@dataclass
class Outcome:
    options: dict[str, Any]
    published: int = 0
    distinct: int = 0
    effects: int = 0
    duplicates: int = 0  # rows past the first of an id
    lost: int = 0  # ids without a row
    faults: Counter[str] = field(default_factory=Counter)
    settled: bool = False  # every entry acked before the deadline
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "faults": dict(self.faults)}


def run(options: Options) -> Outcome:
    outcome = Outcome(asdict(options))
    started = time.monotonic()
    postgres = start_postgres()
    broker = store = None
    workers: dict[int, Any] = {}
    try:
        database = postgres.new_database()
        url = postgres.url(database)
        postgres.psql(
            "CREATE TABLE effects (message_id text NOT NULL, entry_id text NOT NULL, "
            "worker text NOT NULL)",
            database,
        )
        asyncio.run(_create_records_table(url))
        broker, store = start_server("redis"), start_server("redis")

        def start_worker(i: int, generation: int) -> None:
            args = ["-m", "tests.consumers.stream_fault_worker", broker.url, store.url, url]
            seed = str(options.seed * 1000 + i * 100 + generation)
            args += [STREAM, f"w{i}", "1" if options.records else "0", seed]
            workers[i] = spawn([*args, str(options.kill_chance)], {}, stderr=subprocess.DEVNULL)

        for i in range(options.workers):
            start_worker(i, 0)
        asyncio.run(_drive(options, outcome, broker, store, workers, start_worker))
        rows = postgres.psql("SELECT message_id, count(*) FROM effects GROUP BY 1", database)
        counts = {line.split("|")[0]: int(line.split("|")[1]) for line in rows.splitlines()}
        outcome.effects = sum(counts.values())
        outcome.duplicates = sum(n - 1 for n in counts.values())
        outcome.lost = outcome.distinct - len(counts)
    finally:
        for proc in workers.values():
            stop(proc)
        for server in (broker, store):
            if server is not None:
                server.stop()
        postgres.stop(fast=True)
        postgres.remove()
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


async def _create_records_table(url: str) -> None:
    records = SqlRecords(url)
    await records.create_table()
    await records.aclose()


async def _drive(
    options: Options,
    outcome: Outcome,
    broker: Server,
    store: Server,
    workers: dict[int, Any],
    start_worker: Any,
) -> None:
    rng = random.Random(options.seed)
    client = broker.client()
    ids = [f"m{i}" for i in range(options.messages)]
    again = rng.sample(ids, round(len(ids) * options.duplicates))
    # (when, id): every id once in the first two thirds, its copy any time after it
    plan = [(options.duration * 2 / 3 * i / len(ids), m) for i, m in enumerate(ids)]
    first = {m: t for t, m in plan}
    plan += [(rng.uniform(first[m], options.duration), m) for m in again]
    plan.sort()
    outcome.published, outcome.distinct = len(plan), len(ids)
    begin = time.monotonic()
    generation = 0

    async def faults() -> None:
        nonlocal generation
        while time.monotonic() - begin < options.duration:
            await asyncio.sleep(rng.expovariate(1 / options.fault_gap))
            if rng.random() < 0.5:
                store.restart()  # no persistence: every claim and result gone
                outcome.faults["store restarted empty"] += 1
            else:
                i = rng.randrange(options.workers)
                stop(workers[i], signal.SIGKILL)
                generation += 1
                start_worker(i, generation)
                outcome.faults["worker SIGKILLed"] += 1

    async def settle(seconds: float) -> bool:
        """Until the group acked every entry (True), or `seconds` passed; a worker that
        killed itself is started again meanwhile."""
        nonlocal generation
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for i, proc in list(workers.items()):
                if proc.poll() is not None:  # killed itself before an ack
                    outcome.faults["worker SIGKILLed itself before its ack"] += 1
                    generation += 1
                    start_worker(i, generation)
            if await _all_acked(client):
                return True
            await asyncio.sleep(0.2)
        return False

    fault_task = asyncio.create_task(faults())
    restarted = False
    for when, message_id in plan:
        delay = begin + when - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the producer's schedule, not a wait for an event
        if not restarted and when >= options.duration * 2 / 3:
            # once for certain, when every id published so far is acked (before the last
            # copies): the store restarted empty and every worker with it, as in a redeploy
            # during a store's failover
            await settle(60)
            store.restart()
            for i in list(workers):
                stop(workers[i], signal.SIGKILL)
                generation += 1
                start_worker(i, generation)
            outcome.faults["store and every worker restarted"] += 1
            restarted = True
        await client.xadd(STREAM, {"message_id": message_id})
    await fault_task
    outcome.settled = await settle(90)
    await client.aclose()


async def _all_acked(client: redis.asyncio.Redis) -> bool:
    groups = await client.xinfo_groups(STREAM)
    return bool(groups) and groups[0]["pending"] == 0 and groups[0]["lag"] == 0
