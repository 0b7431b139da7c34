"""The example worker: a Redis Stream consumer killed mid-event (SIGKILL) whose messages
another consumer reclaims, and the in-process queue on the embedded store; in both, the
ledger shows exactly one charge per event."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import redis.asyncio

from example_app.worker import StreamWorker, event_handler, run_in_process
from example_app.worker_demo import run_stream_demo
from goblin_idem import RedisStore
from tests.support.servers import Server
from tests.support.waits import until

ROOT = Path(__file__).resolve().parent.parent


async def test_a_worker_killed_mid_event_charges_each_event_once(redis_server: Server) -> None:
    # 800 ms of work per event: the kill, a few ms after the worker logged its third start,
    # lands in that work (before any write) even on a loaded machine.
    demo = await run_stream_demo(redis_server.url, messages=10, work_ms=800)
    assert demo.effects == 10 and demo.duplicate_charges == {}
    assert demo.acked == 10
    # It died with events started and not charged; the second worker reclaimed them, and
    # ran each of them once more: every event ran to its end exactly once.
    assert demo.killed_mid_event >= 1 and demo.redeliveries >= demo.killed_mid_event
    assert demo.runs == demo.messages + demo.killed_mid_event
    assert demo.deliveries == demo.messages + demo.redeliveries


async def test_a_malformed_message_is_dead_lettered_and_acknowledged(redis_server: Server) -> None:
    store = RedisStore.from_url(redis_server.url)
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    worker = StreamWorker(store, event_handler(store), stream="s", consumer="c", block_ms=50)
    await worker.create_group()
    await client.xadd("s", {"event": "{not json"})
    good = {"id": "e1", "account": "a1", "amount_cents": 5, "currency": "EUR"}
    await client.xadd("s", {"event": json.dumps(good)})
    task = asyncio.create_task(worker.run())
    try:
        await until(
            lambda: worker.figures["acked"] == 1 and worker.figures["dead"] == 1,
            what="one event acked, one dead",
        )
    finally:
        worker.stopping.set()
        await task
    assert (await client.xpending("s", "ledger"))["pending"] == 0
    dead = await client.xrange("s:dead")
    assert [fields for _, fields in dead] == [{b"event": b"{not json"}]
    await store.aclose()


async def test_the_in_process_queue_charges_each_event_once() -> None:
    figures = await run_in_process(12)
    assert figures == {"messages": 12, "deliveries": 24, "effects": 12, "duplicate_charges": {}}


def test_the_worker_command_needs_no_server() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "GOBLIN_"))}
    done = subprocess.run(
        [sys.executable, "-m", "example_app.worker", "--messages", "5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    last = done.stdout.decode().strip().splitlines()[-1]
    assert json.loads(last) == {
        "deliveries": 10,
        "duplicate_charges": {},
        "effects": 5,
        "messages": 5,
    }
