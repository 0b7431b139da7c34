"""Storm: uvicorn with 4 worker processes on one real Redis, every key sent 10 times at once.

Each real handler run INCRs a counter in the store, so the side effects are counted where
every worker sees them. Every key must have run exactly once, and every answer for a key must
be the one original response (byte for byte) or a 409 in-flight with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

from tests.reliability.report import latency_figures, pick, record
from tests.support.http_pool import HttpPool, Response
from tests.support.procs import Uvicorn
from tests.support.responses import app_headers, header, problem_slug
from tests.support.servers import Server, free_port

WORKERS = 4
KEYS = pick(100, 1000)
DUPLICATES = 10
CONCURRENT_KEYS = pick(6, 10)  # keys in flight at once: up to 60 / 100 requests
BODY = b'{"amount": 100}'


async def test_storm_four_workers_each_key_runs_once(own_redis: Server) -> None:
    port = free_port()
    rng = random.Random()
    run_id = f"{rng.getrandbits(32):08x}"
    keys = [f"storm-{run_id}-{i:05d}" for i in range(KEYS)]
    answers: dict[str, list[tuple[int, list[tuple[bytes, bytes]], bytes, float]]] = {
        k: [] for k in keys
    }
    with Uvicorn(port, {"REDIS_URL": own_redis.url}, workers=WORKERS) as server:
        server.wait_ready()
        workers = server.worker_pids()
        assert len(workers) == WORKERS
        async with HttpPool(server.port, CONCURRENT_KEYS * DUPLICATES) as http:

            async def send(key: str) -> None:
                await asyncio.sleep(rng.uniform(0, 0.04))  # arrivals spread over ~2 runs
                start = time.monotonic()
                reply = await http.post(f"/task/{key}", key, BODY, x_work_ms="20")
                answers[key].append(
                    (reply.status, reply.headers, reply.body, time.monotonic() - start)
                )

            gate = asyncio.Semaphore(CONCURRENT_KEYS)

            async def storm(key: str) -> None:
                async with gate:
                    await asyncio.gather(*(send(key) for _ in range(DUPLICATES)))

            started = time.monotonic()
            await asyncio.gather(*(storm(k) for k in keys))
            duration = time.monotonic() - started

            # Afterwards every key replays its original, from whichever worker answers.
            replies = await asyncio.gather(*(http.post(f"/task/{k}", k, BODY) for k in keys))
            finals: dict[str, Response] = dict(zip(keys, replies, strict=True))
        still_running = server.worker_pids()

    client = own_redis.sync_client()
    try:
        runs = {k: int(client.get(f"runs:{k}") or 0) for k in keys}
    finally:
        client.close()

    statuses: Counter[str] = Counter()
    originals_by_pid: Counter[int] = Counter()
    latencies = []
    for key in keys:
        original = [
            a for a in answers[key] if a[0] == 201 and header(a[1], b"idempotent-replayed") is None
        ]
        assert len(original) == 1, (key, [a[0] for a in answers[key]])
        status, headers, body, _ = original[0]
        originals_by_pid[int(json.loads(body)["pid"])] += 1
        for status, headers, body_, took in answers[key]:
            latencies.append(took)
            if status == 201:
                assert body_ == body, key  # byte-identical
                assert app_headers(headers) == app_headers(original[0][1]), key
                replayed = header(headers, b"idempotent-replayed") == b"true"
                statuses["replayed" if replayed else "original"] += 1
            else:
                assert status == 409, (key, status, body_)
                assert header(headers, b"retry-after") == b"1"
                assert problem_slug(status, headers, body_) == "in-flight"
                statuses["in_flight_409"] += 1
        final = finals[key]
        assert final.status == 201 and final.body == body
        assert final.header(b"idempotent-replayed") == b"true"

    side_effects = sum(runs.values())
    record(
        "storm",
        "Storm: 4 uvicorn workers, concurrent duplicates",
        {
            "workers": WORKERS,
            "keys": KEYS,
            "requests": KEYS * DUPLICATES,
            "duplicates_per_key": DUPLICATES,
            "side_effects": side_effects,
            "duplicate_runs": side_effects - KEYS,
            "originals": statuses["original"],
            "replays": statuses["replayed"],
            "in_flight_409": statuses["in_flight_409"],
            "other_statuses": 0,
            "workers_that_ran_originals": len(originals_by_pid),
            "duration_s": round(duration, 2),
            "requests_per_s": round(KEYS * DUPLICATES / duration),
            **latency_figures("latency", latencies),
        },
        checks=[
            "INCR side effects in the store == keys, each key's counter == 1",
            "per key: exactly one original 201; every other answer byte-identical replay or "
            "409 in-flight problem with Retry-After",
            "a later request for every key replays the original",
        ],
    )
    assert side_effects == KEYS
    assert all(n == 1 for n in runs.values())
    assert set(still_running) == set(workers)  # no worker died under the load
