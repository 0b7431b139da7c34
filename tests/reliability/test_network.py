"""Slow and flaky network: the suite's own TCP proxy between the middleware and Redis.

The proxy adds latency, stalls connections past the store client's socket timeout (some
stalls also catch new connections) and resets connections, at random, while clients send
every key several times at once and retry it until it completes. Every answer must be the
handler's original, a byte-identical replay of a run of that key, a 409 in-flight or a 503
store-unavailable (both with Retry-After); a key may run a second time only if its response
could not be published (the documented publish-failure case, seen as a ``publish_errors`` or
``lease_lost`` event for its hash).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from tests.reliability.report import latency_figures, pick, record
from tests.support.inproc import CountingApp, Tally, send_once, until_done
from tests.support.proxy import Proxy
from tests.support.servers import Server

KEYS = pick(150, 1500)
DUPLICATES = 3
CHAOS_S = pick(3.0, 30.0)
CONCURRENT_KEYS = 16
LEASE = 2
SOCKET_TIMEOUT = 0.2


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared-connection", "pool"])
async def test_flaky_network_timeouts_end_in_503_or_replay(
    own_redis: Server, autopipeline: bool
) -> None:
    rng = random.Random(4242)
    run_id = f"{random.getrandbits(32):08x}"
    keys = [f"net-{run_id}-{i:05d}" for i in range(KEYS)]
    chaos: Counter[str] = Counter()
    handler = CountingApp(work_s=0.01)
    with Proxy(own_redis.port, seed=7) as proxy:
        store = RedisStore.from_url(
            proxy.url,
            socket_timeout=SOCKET_TIMEOUT,
            retry=Retry(NoBackoff(), 1),  # one quick retry: timeouts reach the middleware
            autopipeline=autopipeline,
        )
        assert (store._pipeline is not None) == autopipeline
        tally = Tally()
        mw = IdempotencyMiddleware(
            handler, store=store, lease_seconds=LEASE, on_event=tally.on_event
        )
        stop = asyncio.Event()

        async def monkey() -> None:
            while not stop.is_set():
                roll = rng.random()
                if roll < 0.3:
                    proxy.latency = (0.0, rng.uniform(0.0, 0.03))
                    chaos["latency_changes"] += 1
                elif roll < 0.55:
                    proxy.stall(rng.uniform(0.1, 0.6), rng.uniform(0.2, 1.0))
                    chaos["stalls"] += 1
                elif roll < 0.65:
                    proxy.stall(rng.uniform(0.3, 0.8), 1.0, new=True)
                    chaos["full_stalls"] += 1
                else:
                    proxy.reset(rng.uniform(0.1, 0.6))
                    chaos["resets"] += 1
                await asyncio.sleep(rng.uniform(0.05, 0.25))

        gate = asyncio.Semaphore(CONCURRENT_KEYS)
        deadline = time.monotonic() + CHAOS_S + 30

        async def key_storm(i: int, key: str) -> None:
            await asyncio.sleep(i * CHAOS_S / KEYS)  # keys arrive over the whole window
            async with gate:
                await asyncio.gather(
                    *(until_done(mw, key, tally, deadline, 0.05) for _ in range(DUPLICATES))
                )

        started = time.monotonic()
        chaos_task = asyncio.create_task(monkey())
        load = asyncio.gather(*(key_storm(i, k) for i, k in enumerate(keys)))
        await asyncio.wait({load}, timeout=CHAOS_S)  # then the network heals
        stop.set()
        await chaos_task
        proxy.latency = (0.0, 0.0)
        await load
        duration = time.monotonic() - started
        resets_seen = proxy.stats.resets
        # A run whose publish failed still holds its claim; once its lease lapsed, the
        # first verification request may run it again; the second must replay.
        await asyncio.sleep(LEASE + 0.3)
        verify = [(k, await send_once(mw, k)) for k in keys]
        replays = [(k, await send_once(mw, k)) for k in keys]
        await store.aclose()

    failed_publish = {h for e, h in tally.events if e in ("publish_errors", "lease_lost")}
    second_runs = {k: len(v) - 1 for k, v in handler.runs.items() if len(v) > 1}
    unexplained = [
        k for k in second_runs if key_names(b"idem", b"", k.encode()).hash not in failed_publish
    ]
    statuses: Counter[str] = Counter()
    for key, a in tally.answers:
        if a.status == 201:
            statuses["replayed" if a.replayed else "original"] += 1
            assert a.body in handler.runs[key]  # the answer of a real run of this key
        elif a.status == 409:
            assert (a.slug, a.retry_after) == ("in-flight", b"1"), a
            statuses["in_flight_409"] += 1
        else:
            assert (a.status, a.slug, a.retry_after) == (503, "store-unavailable", b"1"), a
            statuses["store_unavailable_503"] += 1
    counters = mw.counters.as_dict()
    record(
        "network",
        "Slow / flaky network: latency, stalls and resets between app and store, "
        + ("one shared auto-pipelined connection" if autopipeline else "redis-py's pool"),
        {
            "keys": KEYS,
            "clients_per_key": DUPLICATES,
            "requests": len(tally.answers),
            "chaos_s": CHAOS_S,
            **dict(chaos),
            "connections_reset": resets_seen,
            "socket_timeout_ms": SOCKET_TIMEOUT * 1000,
            **dict(statuses),
            "keys_completed": len(tally.completed),
            "store_errors": counters["store_errors"],
            "publish_errors": counters["publish_errors"],
            "lease_lost": counters["lease_lost"],
            "side_effects": sum(len(v) for v in handler.runs.values()),
            "second_runs": sum(second_runs.values()),
            "second_runs_after_failed_publish": sum(second_runs.values()) - len(unexplained),
            "duration_s": round(duration, 2),
            **latency_figures("latency", [a.took for _, a in tally.answers]),
        },
        checks=[
            "every answer: an original, a replay whose body is that of a real run of the key, "
            "409 in-flight or 503 store-unavailable (both with Retry-After)",
            "a key ran twice only after a publish_errors / lease_lost event for its hash",
            "after the network heals every key completes and then replays",
        ],
        notes=[
            f"store client: socket_timeout {SOCKET_TIMEOUT} s, one immediate retry "
            "(redis-py's default of 10 retries with backoff hides most faults)",
        ],
    )
    assert not unexplained, unexplained
    assert all(len(handler.runs[k]) >= 1 for k in keys)
    for key, a in verify:
        assert a.status == 201, (key, a)
        assert a.replayed or key_names(b"idem", b"", key.encode()).hash in failed_publish
    for key, a in replays:
        assert a.status == 201 and a.replayed and a.body == handler.runs[key][-1], (key, a)
    assert chaos["stalls"] and chaos["resets"]
