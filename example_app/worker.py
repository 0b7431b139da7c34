"""`python -m example_app.worker`: a payment-event consumer, exactly once with `goblin_idem.once`.

With ``REDIS_URL`` set, it consumes a Redis Stream of payment events in a consumer group:
``XAUTOCLAIM`` first, for messages pending longer than ``--reclaim-idle-ms`` (their consumer
died or stalled), then ``XREADGROUP`` for new ones; each batch is processed concurrently,
and a message is acknowledged (``XACK``) only after the `once` function returned. A stream
delivers at least once, so a message comes again after a crash; `once` makes the charge
happen once all the same: a redelivered event that completed returns its stored result, one
whose first consumer died mid-event is run again once that consumer's lease has run out.
A message whose event is still running elsewhere stays pending, to be reclaimed later.

Without ``REDIS_URL`` it runs on the embedded MemoryStore with an in-process queue instead
of a stream: it enqueues ``--messages`` sample events, each delivered twice (as a broker
redelivers), consumes them with three concurrent consumers, prints the figures and exits.

Settings come from the environment as for ``python -m example_app``: ``REDIS_URL``,
``GOBLIN_LEASE_SECONDS`` (30) and ``GOBLIN_TTL_SECONDS`` (86400).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from goblin_idem import InFlightError, MemoryStore, RedisStore, Store, current_claim, once

from .app import redact
from .ledger import charge, ledger_view

__all__ = ["event_handler", "main", "run_in_process", "sample_events"]

logger = logging.getLogger("example_app.worker")

STREAM = "payments:events"
GROUP = "ledger"
Handler = Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]


def event_handler(
    store: Store, *, lease_seconds: int = 30, ttl_seconds: int = 86_400, wait_seconds: float = 0
) -> Handler:
    """The `once` function that charges the ledger for one payment event, keyed by its id."""

    @once(
        store,
        key=lambda event: event["id"],
        ttl_seconds=ttl_seconds,
        lease_seconds=lease_seconds,
        wait_seconds=wait_seconds,
        name="example_app.charge_event",  # stable across renames of this function
    )
    async def charge_event(event: dict[str, Any]) -> dict[str, Any]:
        logger.info("started %s", event["id"])
        await asyncio.sleep(event.get("work_ms", 0) / 1000)  # the slow part, before any write
        claim = current_claim()
        assert claim is not None
        await claim.ensure_owned()  # a run that lost its claim must not charge
        payment = await charge(
            store, event["account"], event["amount_cents"], event["currency"], event["id"]
        )
        logger.info("charged %s %s", event["id"], payment.id)
        return {"event": event["id"], "payment": payment.id}

    return charge_event


def sample_events(
    account: str, n: int, *, prefix: str = "evt", work_ms: int = 0
) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{prefix}_{i:04d}",
            "account": account,
            "amount_cents": 100 + i,
            "currency": "EUR",
            "work_ms": work_ms,
        }
        for i in range(n)
    ]


# -- a Redis Stream with a consumer group -----------------------------------------------------


class StreamWorker:
    """One consumer of a stream's consumer group; counts what it did in `figures`."""

    def __init__(
        self,
        store: RedisStore,
        handler: Handler,
        *,
        stream: str = STREAM,
        group: str = GROUP,
        consumer: str | None = None,
        batch: int = 10,
        block_ms: int = 500,
        reclaim_idle_ms: int = 60_000,
    ) -> None:
        self.client: Any = store.client
        self.handler = handler
        self.stream = stream
        self.group = group
        self.consumer = consumer or f"worker-{os.getpid()}"
        self.batch = batch
        self.block_ms = block_ms
        self.reclaim_idle_ms = reclaim_idle_ms
        self.figures: Counter[str] = Counter()
        self.stopping = asyncio.Event()

    async def create_group(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        await self.create_group()
        cursor: bytes | str = "0-0"
        while not self.stopping.is_set():
            # Messages whose consumer died (or stalled) first: the stream's redeliveries.
            cursor, reclaimed, _ = await self.client.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                self.reclaim_idle_ms,
                start_id=cursor,
                count=self.batch,
            )
            messages = list(reclaimed)
            self.figures["reclaimed"] += len(messages)
            for message_id, _fields in messages:
                logger.info("reclaimed %s", message_id.decode())
            if not messages:
                reply = await self.client.xreadgroup(
                    self.group,
                    self.consumer,
                    {self.stream: ">"},
                    count=self.batch,
                    block=self.block_ms,
                )
                messages = [m for _, batch in reply or [] for m in batch]
                for message_id, _fields in messages:
                    logger.info("received %s", message_id.decode())
            self.figures["delivered"] += len(messages)
            await asyncio.gather(*(self.process(mid, fields) for mid, fields in messages))

    async def process(self, message_id: bytes, fields: Mapping[bytes, bytes]) -> None:
        try:
            event = json.loads(fields[b"event"])
        except (KeyError, ValueError):  # nothing a retry fixes: set it aside, acknowledged
            logger.error("message %s is not a payment event: dead-lettered", message_id)
            await self.client.xadd(self.stream + ":dead", dict(fields))
            await self.client.xack(self.stream, self.group, message_id)
            self.figures["dead"] += 1
            return
        try:
            await self.handler(event)
        except InFlightError:
            self.figures["in_flight"] += 1  # running elsewhere: left pending, reclaimed later
            logger.info("in-flight %s", event["id"])
            return
        except Exception:
            self.figures["failed"] += 1  # left pending: reclaimed after --reclaim-idle-ms
            logger.exception("event %s failed; it stays pending", event["id"])
            return
        await self.client.xack(self.stream, self.group, message_id)
        self.figures["acked"] += 1
        logger.info("acked %s", event["id"])


async def publish_events(
    store: RedisStore, events: Sequence[dict[str, Any]], stream: str = STREAM
) -> None:
    client: Any = store.client
    for event in events:
        await client.xadd(stream, {"event": json.dumps(event)})


# -- the embedded store: an in-process queue ----------------------------------------------------


async def run_in_process(
    messages: int = 20, *, consumers: int = 3, lease_seconds: int = 30
) -> dict[str, Any]:
    """Every event delivered twice to concurrent consumers; the ledger and the figures."""
    store = MemoryStore()
    handle = event_handler(store, lease_seconds=lease_seconds, wait_seconds=lease_seconds + 1)
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    events = sample_events("acct_queue", messages, work_ms=20)
    for event in events:
        queue.put_nowait(event)
    for event in events:  # the at-least-once delivery of a broker: each event comes again
        queue.put_nowait(event)
    figures: Counter[str] = Counter()

    async def consume() -> None:
        while (event := await queue.get()) is not None:
            figures["delivered"] += 1
            await handle(event)
            figures["acked"] += 1

    for _ in range(consumers):
        queue.put_nowait(None)
    await asyncio.gather(*(consume() for _ in range(consumers)))
    ledger = await ledger_view(store, "acct_queue")
    effects = ledger["accounts"]["acct_queue"]["payments"]
    await store.aclose()
    return {
        "messages": messages,
        "deliveries": figures["delivered"],
        "effects": effects,
        "duplicate_charges": ledger["duplicate_charges"],
    }


# -- the command ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app.worker")
    parser.add_argument("--stream", default=STREAM, help=f"the stream (default {STREAM})")
    parser.add_argument("--group", default=GROUP, help=f"the consumer group (default {GROUP})")
    parser.add_argument("--consumer", default=None, help="this consumer's name (worker-<pid>)")
    parser.add_argument("--batch", type=int, default=10, help="messages per read (10)")
    parser.add_argument(
        "--reclaim-idle-ms",
        type=int,
        default=None,
        help="reclaim messages pending longer than this (default: twice the lease)",
    )
    parser.add_argument(
        "--messages", type=int, default=20, help="events of the in-process run (20)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout, force=True
    )
    lease = int(environ.get("GOBLIN_LEASE_SECONDS", "30"))
    ttl = int(environ.get("GOBLIN_TTL_SECONDS", "86400"))
    url = environ.get("REDIS_URL") or None
    if url is None:
        figures = asyncio.run(run_in_process(args.messages, lease_seconds=lease))
        print(json.dumps(figures, sort_keys=True))
        return 0 if figures["effects"] == args.messages else 1
    reclaim = args.reclaim_idle_ms if args.reclaim_idle_ms is not None else 2000 * lease
    logger.info("consuming %s as group %s at %s", args.stream, args.group, redact(url))
    return asyncio.run(_consume(url, args, lease, ttl, reclaim))


async def _consume(url: str, args: argparse.Namespace, lease: int, ttl: int, reclaim: int) -> int:
    store = RedisStore.from_url(url)
    await store.detect()
    # Wait a little longer than a lease for a run that is in flight elsewhere: if its
    # consumer died, the lease runs out meanwhile and this one takes the event over.
    handler = event_handler(store, lease_seconds=lease, ttl_seconds=ttl, wait_seconds=lease + 1)
    worker = StreamWorker(
        store,
        handler,
        stream=args.stream,
        group=args.group,
        consumer=args.consumer,
        batch=args.batch,
        reclaim_idle_ms=reclaim,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stopping.set)  # finish the batch, then exit
    try:
        await worker.run()
    finally:
        logger.info("figures %s", json.dumps(dict(worker.figures), sort_keys=True))
        await store.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
