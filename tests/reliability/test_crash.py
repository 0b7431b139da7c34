"""Crash: uvicorn workers SIGKILLed in the middle of their handlers, or paused past a lease.

One worker killed mid-handler: duplicates get 409 until its lease expires, then one retry
runs the work once. At scale, a two-worker server takes one slow request per key; once every
handler has started (each INCRed its counter), both workers are killed by PID. A second
server on the same Redis then gets the duplicates: 409 with Retry-After while the dead runs'
leases last; after that, the retries run each key once more and complete it, and no key
stays blocked past its lease.

A worker paused (SIGSTOP) inside its handler past its lease, while another worker runs the
key and answers: when it resumes and publishes late, the answer already given stands.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
from redis.asyncio import Redis

from goblin_idem._keys import key_names
from tests.reliability.report import ms, pct, pick, record
from tests.support.http_pool import HttpPool, Response
from tests.support.procs import Uvicorn, start_uvicorn, stop
from tests.support.responses import app_headers, header, problem_slug
from tests.support.servers import Server, free_port

KEYS = pick(40, 100)
LEASE = 2  # seconds; renewed every LEASE / 3 while the worker lives
POLL = 0.2  # the clients' retry interval after a 409
BODY = b'{"amount": 250}'


async def test_worker_killed_mid_handler(redis_server: Server) -> None:
    client = redis_server.client()
    await client.flushall()
    env = {"REDIS_URL": redis_server.url, "LEASE_SECONDS": "2"}
    port, other_port = free_port(), free_port()
    worker = start_uvicorn(port, env)
    # The retries go to a second worker, up before the kill: a replacement started after it
    # could take longer than the lease to come up on a loaded machine.
    replacement = start_uvicorn(other_port, env)
    url = f"http://127.0.0.1:{port}/task/charge"
    retry_url = f"http://127.0.0.1:{other_port}/task/charge"
    headers = {"Idempotency-Key": "order-1"}
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            slow = {**headers, "X-Work-Ms": "60000"}
            doomed = asyncio.create_task(http.post(url, headers=slow))
            for _ in range(500):
                if await client.get("runs:charge") is not None:
                    break
                await asyncio.sleep(0.02)
            stop(worker, signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.gather(doomed, return_exceptions=True)

            url = retry_url
            statuses = []
            while True:
                reply = await http.post(url, headers=headers)
                if reply.status_code != 409:
                    break
                assert reply.headers["retry-after"] == "1"
                statuses.append(reply.status_code)
                await asyncio.sleep(0.1)
            # It was 409 until the lease (2 s after the last renewal) ran out ...
            assert statuses and time.monotonic() - killed_at >= 1.0
            assert time.monotonic() - killed_at < 4.0  # ... and not stuck beyond it
            # ... then exactly one retry ran the work.
            assert reply.status_code == 201 and reply.json()["run"] == 2
            again = await http.post(url, headers=headers)
            assert again.content == reply.content
            assert again.headers["idempotent-replayed"] == "true"
            assert await client.get("runs:charge") == b"2"
    finally:
        stop(worker)
        if replacement is not None:
            stop(replacement)
        await client.aclose()


async def kill_every_handler(victim: Uvicorn, client: Redis, keys: list[str]) -> list[int]:
    """One slow request per key to `victim`; once every handler has INCRed its counter,
    SIGKILL the workers by PID. No client gets an answer."""
    async with HttpPool(victim.port, len(keys)) as doomed_http:
        doomed = [
            asyncio.create_task(doomed_http.post(f"/task/{k}", k, BODY, x_work_ms="60000"))
            for k in keys
        ]
        deadline = time.monotonic() + 20
        while sum(int(v or 0) for v in await client.mget([f"runs:{k}" for k in keys])) < KEYS:
            assert time.monotonic() < deadline, "not every handler started"
            await asyncio.sleep(0.02)
        killed = victim.kill_workers()
        lost = await asyncio.gather(*doomed, return_exceptions=True)
    assert all(isinstance(x, Exception) for x in lost)  # no client got an answer
    return killed


async def retry_until_done(
    http: HttpPool, keys: list[str], killed_at: float
) -> tuple[dict[str, int], dict[str, tuple[float, Response]]]:
    """Each key retried every POLL seconds: 409 until the lease lapses, then exactly one
    run completes it. The 409s per key, and when (after the kill) and how each completed."""
    refused = {k: 1 for k in keys}
    done: dict[str, tuple[float, Response]] = {}

    async def retry(key: str) -> None:
        await asyncio.sleep(random.uniform(0, POLL))
        while True:
            reply = await http.post(f"/task/{key}", key, BODY)
            if reply.status == 201:
                done[key] = (time.monotonic() - killed_at, reply)
                return
            assert reply.status == 409 and reply.header(b"retry-after") == b"1", reply
            refused[key] += 1
            assert time.monotonic() - killed_at < LEASE + 10, f"{key} stuck"
            await asyncio.sleep(POLL)

    await asyncio.gather(*(retry(k) for k in keys))
    return refused, done


def record_figures(
    killed: int,
    first_409: int,
    first_round_s: float,
    refused: dict[str, int],
    completed_after: list[float],
    runs: list[int],
    again: list[Response],
) -> None:
    record(
        "crash",
        "Crash: workers SIGKILLed mid-handler",
        {
            "keys": KEYS,
            "workers_killed": killed,
            "lease_s": LEASE,
            "first_duplicates_409": first_409,
            "first_round_after_kill_ms": ms(first_round_s),
            "refused_409_before_lease_end": sum(refused.values()),
            "completed_min_after_kill_s": round(min(completed_after), 2),
            "completed_p50_after_kill_s": round(pct(completed_after, 50), 2),
            "completed_max_after_kill_s": round(max(completed_after), 2),
            "side_effects": sum(runs),
            "runs_per_key": sorted(set(runs)),
            "answers_after_completion_not_replayed": sum(
                1 for r in again if r.header(b"idempotent-replayed") is None
            ),
        },
        checks=[
            "every duplicate right after the kill: 409 in-flight with Retry-After",
            f"each key completes between 0.5 x lease and lease + 3 s ({POLL} s retry "
            "interval) after the kill",
            "counter per key == 2 (the killed run and the one completion); replays from "
            "both servers are byte-identical",
        ],
    )


async def test_killed_workers_block_until_lease_then_run_once(own_redis: Server) -> None:
    env = {"REDIS_URL": own_redis.url, "LEASE_SECONDS": str(LEASE)}
    run_id = f"{random.getrandbits(32):08x}"
    keys = [f"crash-{run_id}-{i:04d}" for i in range(KEYS)]
    client = own_redis.client()
    victim = Uvicorn(free_port(), env, workers=2)
    survivor = Uvicorn(free_port(), env)
    try:
        victim.wait_ready()
        survivor.wait_ready()
        killed = await kill_every_handler(victim, client, keys)
        killed_at = time.monotonic()
        async with HttpPool(survivor.port, 32) as http:
            # Right after the crash, every duplicate is refused: the dead runs hold the keys.
            first = await asyncio.gather(*(http.post(f"/task/{k}", k, BODY) for k in keys))
            first_round_s = time.monotonic() - killed_at
            for reply in first:
                assert reply.status == 409, reply
                assert reply.header(b"retry-after") == b"1"
                assert problem_slug(reply.status, reply.headers, reply.body) == "in-flight"

            refused, done = await retry_until_done(http, keys, killed_at)

            # The restarted workers (the supervisor replaced the killed ones) replay too.
            victim.wait_ready()
            assert not set(victim.worker_pids()) & set(killed)
            again = await asyncio.gather(*(http.post(f"/task/{k}", k, BODY) for k in keys))
            async with HttpPool(victim.port, 16) as http2:
                again += await asyncio.gather(*(http2.post(f"/task/{k}", k, BODY) for k in keys))
        runs = [int(v or 0) for v in await client.mget([f"runs:{k}" for k in keys])]
    finally:
        victim.stop()
        survivor.stop()
        await client.aclose()

    for key, reply in zip(keys * 2, again, strict=True):
        original = done[key][1]
        assert reply.status == 201 and reply.body == original.body
        assert reply.header(b"idempotent-replayed") == b"true"
        assert app_headers(reply.headers) == app_headers(original.headers)
        assert header(original.headers, b"idempotent-replayed") is None
        assert json.loads(original.body)["run"] == 2  # the killed run, then this one

    completed_after = [t for t, _ in done.values()]
    record_figures(len(killed), len(first), first_round_s, refused, completed_after, runs, again)
    assert runs == [2] * KEYS
    # Blocked while the lease lasted (the last renewal was at most LEASE / 3 before the kill) ...
    assert min(completed_after) >= 0.5 * LEASE
    # ... and not stuck beyond it.
    assert max(completed_after) <= LEASE + 3.0


async def test_a_worker_paused_past_its_lease_changes_no_answer_given(own_redis: Server) -> None:
    """Two workers on one Redis, lease 2 s. Worker A's handler is paused (SIGSTOP) until its
    claim has lapsed; worker B takes the key, runs it and answers, and B's duplicate
    replays that answer. A resumes and publishes: A's client gets A's own answer, but B's
    stands, and every later duplicate (to either worker) replays it; A counts `superseded`.
    """
    env = {"REDIS_URL": own_redis.url, "LEASE_SECONDS": str(LEASE)}
    client = own_redis.client()
    key = f"paused-{random.getrandbits(32):08x}"
    claim = key_names(b"idem", b"", key.encode()).claim
    a, b = Uvicorn(free_port(), env), Uvicorn(free_port(), env)
    paused = False
    try:
        a.wait_ready()
        b.wait_ready()
        async with HttpPool(a.port, 4) as to_a, HttpPool(b.port, 4) as to_b:
            late = asyncio.create_task(to_a.post(f"/task/{key}", key, BODY, x_work_ms="300"))
            deadline = time.monotonic() + 20
            while await client.get(f"runs:{key}") is None:  # A's handler has started
                assert time.monotonic() < deadline, "the handler never started"
                await asyncio.sleep(0.01)
            os.kill(a.pid, signal.SIGSTOP)
            paused, paused_at = True, time.monotonic()
            while await client.exists(claim):  # A cannot renew: its claim lapses
                assert time.monotonic() < paused_at + 10, "the claim never lapsed"
                await asyncio.sleep(0.02)
            first = await to_b.post(f"/task/{key}", key, BODY)
            replay = await to_b.post(f"/task/{key}", key, BODY)
            os.kill(a.pid, signal.SIGCONT)
            paused, paused_s = False, time.monotonic() - paused_at
            own = await late
            after = [await to_a.post(f"/task/{key}", key, BODY) for _ in range(2)]
            after += [await to_b.post(f"/task/{key}", key, BODY) for _ in range(2)]
            stats = json.loads((await to_a.request("GET", "/stats")).body)
        runs = int(await client.get(f"runs:{key}") or 0)
    finally:
        if paused:
            os.kill(a.pid, signal.SIGCONT)
        a.stop()
        b.stop()
        await client.aclose()

    def nonce(reply: Response) -> bytes | None:
        return reply.header(b"x-run-nonce")

    record(
        "crash-paused",
        "Crash: a worker paused past its lease publishes late",
        {
            "lease_s": LEASE,
            "paused_s": round(paused_s, 2),
            "runs": runs,
            "later_duplicates": len(after),
            "later_duplicates_replaying_the_first_answer": sum(
                1 for r in after if nonce(r) == nonce(first)
            ),
            "superseded": stats["superseded"],
        },
        checks=[
            "the paused run's client gets its own answer, not marked as a replay",
            "the answer given first (and replayed) is what every later duplicate gets",
            "the late run is counted as superseded",
        ],
    )
    assert runs == 2
    assert first.status == 201 and first.header(b"idempotent-replayed") is None
    assert replay.header(b"idempotent-replayed") == b"true" and replay.body == first.body
    assert own.status == 201 and own.header(b"idempotent-replayed") is None
    assert nonce(own) != nonce(first)  # the late run happened: its client gets its answer
    for reply in after:
        assert reply.status == 201 and reply.header(b"idempotent-replayed") == b"true"
        assert reply.body == first.body, "a late publish replaced the answer given first"
    assert stats["superseded"] == 1 and stats["publish_errors"] == 0
