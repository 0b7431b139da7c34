"""Store outage: Redis is SIGKILLed under load and restarted; the app is not.

Clients keep sending new keys (retrying each until it completes) while Redis (AOF with
``appendfsync always``, so a restart loses nothing acknowledged) is killed, stays down, and
comes back on the same port. During the outage every keyed request must get 503
store-unavailable with Retry-After and no handler may start; after the restart the same app
process serves again; every key runs once, except a key whose response could not be published
during the outage (the documented publish-failure case), which may run once more after its
lease.

Restarts at publish time: the store restarted (down for 0.3-0.55 s) while runs reach their
publish, again and again under load, and once at a chosen moment for the middleware and for
`once`. A publish is retried while its claim holds, so no key runs twice.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, RedisStore, once
from goblin_idem._keys import key_names
from tests.reliability.report import latency_figures, ms, pick, record
from tests.support.http_pool import HttpPool
from tests.support.inproc import CountingApp, send_once
from tests.support.procs import Uvicorn
from tests.support.responses import problem_slug
from tests.support.servers import Server, free_port, start_server

CLIENTS = pick(8, 16)
WARMUP = pick(1.0, 3.0)  # seconds of load before the kill
OUTAGE = pick(3.0, 10.0)  # seconds Redis stays down
AFTER = pick(1.5, 4.0)  # seconds of new keys after the restart
LEASE = 2
EPSILON = 0.1  # a handler whose claim was answered just before the kill starts within this
RESTARTS = pick(4, 12)  # restarts of the store under load, each down for 0.3-0.55 s
# Their runs' lease: a publish is retried until a third of it before the claim would lapse,
# counted from the last renewal, so at least a third of it (1.33 s) after the store went
# down; with LEASE (2 s) that was 0.67 s, less than a restart from the AOF can take on a
# loaded machine (down 0.55 s, then the start): a publish gave up while its claim held.
RESTARTS_LEASE = 4


@dataclass
class Sent:
    key: str
    start: float  # wall clock, comparable with the app's side-effect log
    end: float
    status: int
    slug: str = ""
    replayed: bool = False
    retry_after: bytes | None = None
    error: str = ""


@pytest.fixture
def durable_redis() -> Iterator[Server]:
    server = start_server(
        "redis", persist=True, args=["--appendonly", "yes", "--appendfsync", "always"]
    )
    yield server
    server.stop()


async def test_store_outage_answers_503_runs_nothing_and_recovers(
    durable_redis: Server, tmp_path: Path
) -> None:
    side_log, event_log = tmp_path / "side.log", tmp_path / "events.log"
    env = {
        "REDIS_URL": durable_redis.url,
        "LEASE_SECONDS": str(LEASE),
        "SIDE_LOG": str(side_log),
        "EVENT_LOG": str(event_log),
        "COUNT_IN_STORE": "0",  # the side effect is the log line: it needs no store
    }
    run_id = f"{random.getrandbits(32):08x}"
    sent: list[Sent] = []
    keys: list[str] = []
    phase = {"new_keys": True}
    app = Uvicorn(free_port(), env)
    try:
        app.wait_ready()
        async with HttpPool(app.port, CLIENTS + 8) as http:
            pid_before = (await http.request("GET", "/health")).body

            async def one(key: str) -> Sent:
                start = time.time()
                try:
                    reply = await http.post(f"/task/{key}", key, b"{}", x_work_ms="20")
                except Exception as exc:
                    return Sent(key, start, time.time(), 0, error=repr(exc))
                s = Sent(key, start, time.time(), reply.status)
                s.replayed = reply.header(b"idempotent-replayed") == b"true"
                s.retry_after = reply.header(b"retry-after")
                if reply.status != 201:
                    s.slug = problem_slug(reply.status, reply.headers, reply.body)
                return s

            async def client(n: int) -> None:
                i = 0
                while phase["new_keys"]:
                    key = f"outage-{run_id}-{n:02d}-{i:05d}"
                    i += 1
                    keys.append(key)
                    while True:
                        s = await one(key)
                        sent.append(s)
                        if s.status == 201:
                            break
                        await asyncio.sleep(0.1)

            clients = [asyncio.create_task(client(n)) for n in range(CLIENTS)]
            await asyncio.sleep(WARMUP)
            durable_redis.kill()
            down_at = time.time()
            await asyncio.sleep(OUTAGE)
            up_at = time.time()
            durable_redis.restart()
            await asyncio.sleep(AFTER)
            phase["new_keys"] = False
            await asyncio.wait_for(asyncio.gather(*clients), 60)
            # Leases of runs whose publish failed during the outage have lapsed by now.
            await asyncio.sleep(LEASE + 0.5)
            verify = [await one(k) for k in keys]  # a run whose publish failed runs again
            replays = [await one(k) for k in keys]
            stats = json.loads((await http.request("GET", "/stats")).body)
            pid_after = (await http.request("GET", "/health")).body
    finally:
        app.stop()

    runs: Counter[str] = Counter()
    starts: list[float] = []
    for line in side_log.read_text().splitlines():
        at, _, key = line.split()
        runs[key] += 1
        starts.append(float(at))
    events: dict[str, set[str]] = {}
    for line in event_log.read_text().splitlines() if event_log.exists() else ():
        _, _, event, key_hash = line.split()
        events.setdefault(event, set()).add(key_hash)
    publish_failed = events.get("publish_errors", set()) | events.get("lease_lost", set())

    during = [s for s in sent if s.start >= down_at and s.end <= up_at]
    after = [s for s in sent if s.start >= up_at]
    first_ok_after = min((s.end for s in after if s.status == 201), default=float("inf"))
    duplicates = {k: n - 1 for k, n in runs.items() if n > 1}
    unexplained = [
        k for k in duplicates if key_names(b"idem", b"", k.encode()).hash not in publish_failed
    ]
    statuses = Counter(s.status for s in sent)
    record(
        "outage",
        "Store outage: Redis killed under load, restarted",
        {
            "clients": CLIENTS,
            "keys": len(keys),
            "requests": len(sent),
            "outage_s": OUTAGE,
            "requests_within_outage": len(during),
            "within_outage_503": sum(1 for s in during if s.status == 503),
            "within_outage_other": sum(1 for s in during if s.status != 503),
            "handler_starts_within_outage": sum(1 for t in starts if down_at + EPSILON < t < up_at),
            "unprotected_runs": stats["unprotected"],
            "store_errors": stats["store_errors"],
            "publish_errors": stats["publish_errors"],
            **latency_figures("outage_503", [s.end - s.start for s in during]),
            "recovery_first_201_after_restart_ms": ms(first_ok_after - up_at),
            "side_effects": sum(runs.values()),
            "duplicate_runs": sum(duplicates.values()),
            "duplicate_runs_after_failed_publish": sum(duplicates.values()) - len(unexplained),
            "status_counts": {str(k): v for k, v in sorted(statuses.items())},
            "app_restarted": pid_before != pid_after,
        },
        checks=[
            "every request sent and answered within the outage: 503 store-unavailable with "
            "Retry-After",
            f"no handler started within the outage (beyond {EPSILON} s after the kill); "
            "unprotected == 0",
            "after the restart the same app process completes new keys",
            "every key ran once, or twice only if its publish failed (publish_errors event "
            "for its hash); every key replays at the end",
        ],
    )
    assert during, "no request was answered within the outage"
    for s in during:
        assert (s.status, s.slug, s.retry_after) == (503, "store-unavailable", b"1"), s
    assert not [t for t in starts if down_at + EPSILON < t < up_at]
    assert stats["unprotected"] == 0
    assert pid_before == pid_after and first_ok_after < up_at + 15
    assert all(s.status in (201, 409, 503) and not s.error for s in sent), [
        s for s in sent if s.error or s.status not in (201, 409, 503)
    ]
    assert not unexplained, unexplained
    assert all(runs[k] >= 1 for k in keys)
    for s in verify:
        hashed = key_names(b"idem", b"", s.key.encode()).hash
        assert s.status == 201 and (s.replayed or hashed in publish_failed), s
    for s in replays:
        assert s.status == 201 and s.replayed, s


async def test_store_restarts_under_load_run_no_key_twice(
    durable_redis: Server, tmp_path: Path
) -> None:
    """Redis (AOF, ``appendfsync always``) restarted again and again under load, each time
    down for 0.3-0.55 s at a random moment, so that runs reach their publish while it is
    down. A publish is retried while its claim holds, so none is lost and no key runs twice;
    requests that arrive while it is down get 503 and are retried by their clients."""
    side_log, event_log = tmp_path / "side.log", tmp_path / "events.log"
    env = {
        "REDIS_URL": durable_redis.url,
        "LEASE_SECONDS": str(RESTARTS_LEASE),
        "SIDE_LOG": str(side_log),
        "EVENT_LOG": str(event_log),
        "COUNT_IN_STORE": "0",
    }
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    run_id = f"{seed:08x}"
    statuses: Counter[int] = Counter()
    took: list[float] = []
    keys: list[str] = []
    downtimes: list[float] = []
    phase = {"new_keys": True}
    app = Uvicorn(free_port(), env)
    try:
        app.wait_ready()
        async with HttpPool(app.port, CLIENTS + 8) as http:

            async def client(n: int) -> None:
                i = 0
                while phase["new_keys"]:
                    key = f"restarts-{run_id}-{n:02d}-{i:05d}"
                    i += 1
                    keys.append(key)
                    while True:
                        start = time.monotonic()
                        try:
                            reply = await http.post(f"/task/{key}", key, b"{}", x_work_ms="20")
                        except Exception:
                            statuses[0] += 1
                        else:
                            statuses[reply.status] += 1
                            took.append(time.monotonic() - start)
                            if reply.status == 201:
                                break
                        await asyncio.sleep(0.1)

            clients = [asyncio.create_task(client(n)) for n in range(CLIENTS)]
            for _ in range(RESTARTS):
                await asyncio.sleep(rng.uniform(0.5, 1.0))
                started = time.monotonic()
                durable_redis.kill()
                await asyncio.sleep(rng.uniform(0.3, 0.55))
                await asyncio.to_thread(durable_redis.restart)
                downtimes.append(time.monotonic() - started)
            await asyncio.sleep(0.5)
            phase["new_keys"] = False
            await asyncio.wait_for(asyncio.gather(*clients), 60)
            await asyncio.sleep(RESTARTS_LEASE + 0.5)  # a claim left without its result lapsed
            verify = [await http.post(f"/task/{k}", k, b"{}") for k in keys]
            stats = json.loads((await http.request("GET", "/stats")).body)
    finally:
        app.stop()

    runs = Counter(line.split()[2] for line in side_log.read_text().splitlines())
    events = Counter(
        line.split()[2]
        for line in (event_log.read_text().splitlines() if event_log.exists() else ())
    )
    duplicates = sum(n - 1 for n in runs.values())
    record(
        "outage-restarts",
        "Store outage: Redis restarted again and again under load, runs publishing meanwhile",
        {
            "clients": CLIENTS,
            "restarts": RESTARTS,
            "down_ms_min": ms(min(downtimes)),
            "down_ms_max": ms(max(downtimes)),
            "keys": len(keys),
            "requests": sum(statuses.values()),
            "status_counts": {str(k): v for k, v in sorted(statuses.items())},
            **latency_figures("answer", took),
            "side_effects": sum(runs.values()),
            "duplicate_runs": duplicates,
            "publish_errors": stats["publish_errors"],
            "lease_lost": events["lease_lost"],
            "seed": seed,
        },
        checks=[
            "no key ran twice, and no publish failed: each was retried until the store was back",
            "every key replays afterwards, past its lease",
        ],
        notes=[
            "each restart: SIGKILL, 0.3-0.55 s, then a start from the AOF (appendfsync "
            "always); down_ms counts until the server answered PING again",
            "a run that reaches its publish while the store is down holds its client's "
            "last chunk until the publish lands: answer_max_ms is that wait",
        ],
    )
    assert duplicates == 0, {k: n for k, n in runs.items() if n > 1}
    assert stats["publish_errors"] == 0
    assert all(runs[k] == 1 for k in keys)
    for reply in verify:
        assert reply.status == 201 and reply.header(b"idempotent-replayed") == b"true", reply


def restart_in_thread(server: Server, down_s: float) -> threading.Thread:
    """Kill `server` now and start it again `down_s` seconds later, in a thread of its own."""
    server.kill()

    def restart() -> None:
        time.sleep(down_s)
        server.restart()

    thread = threading.Thread(target=restart)
    thread.start()
    return thread


@pytest.mark.parametrize("down_s", [0.35, 0.55])
async def test_a_restart_at_publish_time_is_ridden_out(
    durable_redis: Server, down_s: float
) -> None:
    """The store goes down as the handler answers and is back `down_s` later (AOF with
    ``appendfsync always``: the claim survives). The publish keeps being retried while the
    claim holds, lands, and the key never runs again, not even after the lease."""
    store = RedisStore.from_url(durable_redis.url)
    handler = CountingApp()
    restarts: list[threading.Thread] = []

    async def restarting(scope: Scope, receive: Receive, send: Send) -> None:
        if not restarts:
            restarts.append(restart_in_thread(durable_redis, down_s))
        await handler(scope, receive, send)

    mw = IdempotencyMiddleware(restarting, store=store, lease_seconds=LEASE)
    try:
        await store.detect()
        first = await send_once(mw, "blip")
        assert restarts and first.status == 201 and not first.replayed
        assert mw.counters.publish_errors == 0
        await asyncio.sleep(LEASE + 0.2)  # a claim left without its result would lapse
        again = await send_once(mw, "blip")
        assert again.replayed and again.body == first.body
        assert len(handler.runs["blip"]) == 1
    finally:
        for thread in restarts:  # the server is up again before the fixture stops it
            await asyncio.to_thread(thread.join)
        await store.aclose()


async def test_a_restart_at_publish_time_is_ridden_out_by_once(durable_redis: Server) -> None:
    """The same for `once`: the value is stored once the store is back, and a later call
    gets it without running."""
    store = RedisStore.from_url(durable_redis.url)
    runs: list[str] = []
    restarts: list[threading.Thread] = []

    @once(store, key=lambda event: event, lease_seconds=LEASE, name="blip")
    async def work(event: str) -> str:
        runs.append(event)
        restarts.append(restart_in_thread(durable_redis, 0.45))
        return f"done {len(runs)}"

    try:
        await store.detect()
        assert await work("e") == "done 1"
        await asyncio.sleep(LEASE + 0.2)  # a claim left without its value would lapse
        assert await work("e") == "done 1" and runs == ["e"]
    finally:
        for thread in restarts:
            await asyncio.to_thread(thread.join)
        await store.aclose()
