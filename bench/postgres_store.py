"""PostgresStore beside RedisStore and the bare app: new key, replay and no key, in one run.

    PYTHONPATH=. python bench/postgres_store.py [--requests 3000] [--concurrency 50]

The middleware runs in this process on a FastAPI app, driven through ASGI (no HTTP server,
so what is measured is the middleware and its store, not a server's parsing); the stores
are a throwaway redis-server (Lua scripts) and a throwaway PostgreSQL 15 whose commits are
synced, as an application's are, PostgresStore on it with and without
``synchronous_commit`` (and, with ``--fast-pg``, a server without fsync). Each scenario runs
every variant in turn, bare app before and after, `--reps` times; the table shows medians
of requests per second and the ratio to RedisStore's. Then the store's steps alone, one at
a time: the median latency of a claim, a publish and a replay's claim, which is where a
request's time goes. Every process started is stopped by PID; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastapi import FastAPI  # noqa: E402

from goblin_idem import IdempotencyMiddleware, PostgresStore, RedisStore  # noqa: E402
from tests.support.asgi import request  # noqa: E402
from tests.support.postgres import start_postgres  # noqa: E402
from tests.support.servers import start_server  # noqa: E402

SCENARIOS = ("new", "replay", "nokey")


def app() -> FastAPI:
    api = FastAPI()

    @api.post("/orders", status_code=201)
    async def create_order() -> dict[str, object]:
        return {"order": 1, "status": "created"}

    return api


async def drive(target: Any, scenario: str, n: int, concurrency: int, run: int) -> float:
    """`n` requests of `scenario`, `concurrency` at a time: requests per second."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        key = {"new": f"new-{run}-{i}", "replay": f"replay-{i % 200}", "nokey": None}[scenario]
        async with sem:
            reply = await request(target, key=key, body=b'{"sku": "A-1"}', path="/orders")
        if reply.status != 201:
            raise SystemExit(f"{scenario}: {reply.status} {reply.body!r}")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - started)


async def steps(store: Any, n: int) -> dict[str, float]:
    """Median microseconds of each step, sent one at a time."""
    times: dict[str, list[float]] = {"claim": [], "publish": [], "replay": []}
    for i in range(n):
        ck, rk = f"s:{i}:c", f"s:{i}:r"
        t0 = time.perf_counter()
        await store.claim_unless_done(ck, rk, "tok", 30)
        t1 = time.perf_counter()
        await store.publish(rk, b"x" * 200, 86_400_000, ck, "tok")
        t2 = time.perf_counter()
        await store.claim_unless_done(ck, rk, "tok2", 30)
        t3 = time.perf_counter()
        times["claim"].append(t1 - t0)
        times["publish"].append(t2 - t1)
        times["replay"].append(t3 - t2)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


async def bench(args: argparse.Namespace, urls: dict[str, str]) -> None:
    stores: dict[str, Any] = {"redis": RedisStore.from_url(urls["redis"])}
    for name, url, synchronous in (
        ("postgres", urls["postgres"], True),
        ("postgres-async-commit", urls["postgres"], False),
        ("postgres-no-fsync", urls.get("postgres-fast"), True),
    ):
        if url is not None:
            store = PostgresStore.from_url(
                url, purge_interval_seconds=None, synchronous_commit=synchronous
            )
            await store.create_table()
            stores[name] = store
    variants: dict[str, Any] = {"bare": app()}
    for name, store in stores.items():
        variants[name] = IdempotencyMiddleware(app(), store=store)
    for name in stores:  # the replay keys, completed
        for i in range(200):
            await request(variants[name], key=f"replay-{i}", body=b'{"sku": "A-1"}', path="/orders")
    for target in variants.values():  # warm-up: connections opened, statements prepared
        for scenario in args.scenarios.split(","):
            await drive(target, scenario, 300, args.concurrency, -1)
    rates: dict[tuple[str, str], list[float]] = {}
    for scenario in args.scenarios.split(","):
        for rep in range(args.reps):
            for name, target in variants.items():
                rate = await drive(target, scenario, args.requests, args.concurrency, rep)
                rates.setdefault((scenario, name), []).append(rate)
    names = list(variants)
    print(
        f"| scenario | {' | '.join(names)} | "
        + " | ".join(f"{n} / redis" for n in names if n.startswith("postgres"))
        + " |"
    )
    print("|---" * (1 + len(names) + sum(n.startswith("postgres") for n in names)) + "|")
    for scenario in args.scenarios.split(","):
        med = {n: statistics.median(rates[(scenario, n)]) for n in names}
        cells = [f"{med[n]:,.0f}/s" for n in names]
        ratios = [f"{med[n] / med['redis']:.2f}x" for n in names if n.startswith("postgres")]
        print(f"| {scenario} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    print()
    print("| store | claim (new key) | publish | claim (replay) |")
    print("|---|---|---|---|")
    for name, store in stores.items():
        t = await steps(store, args.steps)
        print(f"| {name} | {t['claim']:.0f} us | {t['publish']:.0f} us | {t['replay']:.0f} us |")
    for store in stores.values():
        await store.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="requests per run (3000)")
    p.add_argument("--concurrency", type=int, default=50, help="requests at once (50)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    p.add_argument("--steps", type=int, default=500, help="keys for the step latencies (500)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--fast-pg", action="store_true", help="also a PostgreSQL without fsync")
    args = p.parse_args()
    redis = start_server("redis")
    servers = [start_postgres(durable=True)]
    if args.fast_pg:
        servers.append(start_postgres())
    try:
        urls = {
            "redis": redis.url,
            "postgres": f"postgresql://postgres@127.0.0.1:{servers[0].port}/postgres",
        }
        if args.fast_pg:
            urls["postgres-fast"] = f"postgresql://postgres@127.0.0.1:{servers[1].port}/postgres"
        asyncio.run(bench(args, urls))
    finally:
        redis.stop()
        for server in servers:
            server.remove()


if __name__ == "__main__":
    main()
