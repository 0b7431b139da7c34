"""Redis Streams: a consumer group's member whose handler's effects commit once per message.

The loop reads new entries (XREADGROUP ``>``) and, every half lease, takes over entries
pending longer than a lease (XAUTOCLAIM: a dead consumer's, or this one's own that were
left for redelivery), and runs each batch's entries concurrently (`MessageRun`). Then, per
entry:

- ACK (done now, or by an earlier delivery): XACK;
- RETRY: nothing; the entry stays pending and is taken over a lease later. An entry in
  flight elsewhere is acked by the delivery that runs it, whichever consumer owns it then
  (XACK is the group's, not the consumer's);
- DEAD: XADD to the dead letter with the entry's fields and why, and XACK, in one
  MULTI/EXEC, so the dead letter holds an entry exactly when it leaves the group's
  pending list (on a cluster, name a dead letter in the stream's slot: ``{orders}`` and
  ``{orders}:dead``).

An entry taken over is a redelivery (its failure count is read); a new one is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio
from redis.exceptions import RedisError, ResponseError

from .._log import describe
from .._recording import Records
from ..store import Store
from ._run import Handler, MessageRun, OnEvent, Verdict

__all__ = ["StreamConsumer"]

logger = logging.getLogger("goblin_idem.consumers")

#: The longest XREADGROUP blocks: how long `stop()` may wait for the loop to see it.
BLOCK_MS = 1000
#: After the stream's server failed, the loop's next read waits this long (doubling up to
#: BROKER_MAX_PAUSE) so that a server down is not polled in a tight loop.
BROKER_FIRST_PAUSE = 0.1
BROKER_MAX_PAUSE = 2.0
#: The fields the dead letter adds to an entry's own.
REASON_FIELD = "goblin_idem.reason"
ENTRY_FIELD = "goblin_idem.entry_id"
STREAM_FIELD = "goblin_idem.stream"


class StreamConsumer:
    """One member (`consumer`) of `group` on `stream`; `await run()` until `stop()`.

    `handler(fields, entry_id)` gets the entry's fields as the `redis` client returns them.
    The message id is the field ``message_id`` unless `key` (a function of the fields)
    names another; `scope` (default ``redis:<stream>:<group>``) is what two consumers must
    share to see each other's keys. `batch` entries run at once; `stop()` lets them finish
    for up to `grace_seconds`, then cancels them (their entries stay pending).
    """

    def __init__(
        self,
        store: Store,
        redis: redis.asyncio.Redis,
        *,
        stream: str,
        group: str,
        consumer: str,
        handler: Handler,
        key: Callable[[Mapping[Any, Any]], str | bytes | int | None] | None = None,
        records: Records | None = None,
        max_deliveries: int = 5,
        dead_letter: str | None = None,
        lease_seconds: float = 30,
        ttl_seconds: float = 86_400,
        namespace: str = "once",
        scope: str | None = None,
        batch: int = 16,
        grace_seconds: float = 30,
        on_event: OnEvent | None = None,
    ) -> None:
        for name, value in (("stream", stream), ("group", group), ("consumer", consumer)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} must be a non-empty str")
        if key is not None and not callable(key):
            raise TypeError("key must be a function of the entry's fields returning its id")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.handler = handler
        self.key = key
        self.dead_letter = dead_letter if dead_letter is not None else f"{stream}:dead"
        self.scope = scope if scope is not None else f"redis:{stream}:{group}"
        self.batch = batch
        self.grace_seconds = float(grace_seconds)
        self.lease_ms = round(lease_seconds * 1000)
        self.run_one = MessageRun(
            store,
            self._handle,
            records=records,
            max_deliveries=max_deliveries,
            lease_seconds=lease_seconds,
            ttl_seconds=ttl_seconds,
            namespace=namespace,
            on_event=on_event,
        )
        self._stopping = asyncio.Event()
        self._cursor: Any = "0-0"
        self._taken_at = float("-inf")

    def stop(self) -> None:
        """Stop reading; `run()` returns once the running entries finished (or the grace
        period ended). Safe from a signal handler on the loop (``add_signal_handler``)."""
        self._stopping.set()

    async def run(self) -> None:
        """Consume until `stop()`: creates the group (reading the stream from its start)
        if it does not exist."""
        await self._ensure_group()
        loop = asyncio.get_running_loop()
        pause = BROKER_FIRST_PAUSE
        while not self._stopping.is_set():
            try:
                entries = await self._next_entries(loop.time())
            except RedisError as exc:
                logger.warning("redis:%s: reading failed (%s)", self.stream, describe(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)
                pause = min(2 * pause, BROKER_MAX_PAUSE)
                continue
            pause = BROKER_FIRST_PAUSE
            if entries:
                await self._run_batch(entries)

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _next_entries(self, now: float) -> list[tuple[str, Any, bool]]:
        """Entries pending longer than a lease (every half lease), else new ones: (entry id,
        fields, redelivered)."""
        if now - self._taken_at >= self.lease_ms / 2000:
            reply = await self.redis.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                self.lease_ms,
                self._cursor,
                count=self.batch,
            )
            self._cursor = reply[0]
            if _id(self._cursor) == "0-0":
                self._taken_at = now  # a full pass: the next one a half lease later
            taken = [(_id(i), fields, True) for i, fields in reply[1] if fields is not None]
            if taken:
                return taken
        block = min(BLOCK_MS, max(1, self.lease_ms // 2))
        read: Any = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=self.batch, block=block
        )
        if not read:
            return []
        items = read.values() if isinstance(read, dict) else [r[1] for r in read]
        return [
            (_id(i), fields, False)
            for batch in items
            for i, fields in (batch[0] if batch and isinstance(batch[0], list) else batch)
        ]

    async def _run_batch(self, entries: list[tuple[str, Any, bool]]) -> None:
        """Run the entries; on `stop()`, wait for them up to the grace period, then cancel
        the rest (left pending, so another consumer takes them over)."""
        tasks = [asyncio.ensure_future(self._one(*entry)) for entry in entries]
        finished = asyncio.ensure_future(asyncio.wait(tasks))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([finished, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not finished.done():
                await asyncio.wait(tasks, timeout=self.grace_seconds)
        finally:
            stopping.cancel()
            late = [t for t in tasks if not t.done()]
            for task in late:
                task.cancel()
            if late:
                logger.warning(
                    "redis:%s: %d entries still running after the grace period were "
                    "cancelled and stay pending",
                    self.stream,
                    len(late),
                )
            await asyncio.wait(tasks)
            finished.cancel()

    async def _one(self, entry_id: str, fields: Any, redelivered: bool) -> None:
        about = entry_id
        try:
            key = self._key_of(fields)
        except Exception as exc:  # no key: the dead letter's, with why
            key, about = None, f"{entry_id}; the key function raised {describe(exc)}"
        outcome = await self.run_one(
            (fields, entry_id), key, self.scope, redelivered=redelivered, about=about
        )
        try:
            if outcome.verdict is Verdict.ACK:
                await self.redis.xack(self.stream, self.group, entry_id)
            elif outcome.verdict is Verdict.DEAD:
                await self._bury(entry_id, fields, outcome.reason)
        except RedisError as exc:  # left pending: taken over, replayed and acked later
            logger.warning(
                "redis:%s: entry %s was not acked (%s); it stays pending",
                self.stream,
                entry_id,
                describe(exc),
            )

    def _key_of(self, fields: Any) -> str | bytes | int | None:
        if self.key is not None:
            return self.key(fields)
        value = fields.get(b"message_id", fields.get("message_id"))
        return value if isinstance(value, (str, bytes)) else None

    async def _bury(self, entry_id: str, fields: Any, reason: str) -> None:
        """The entry to the dead letter with why, and acked: both or neither."""
        dead = {**fields, REASON_FIELD: reason, ENTRY_FIELD: entry_id, STREAM_FIELD: self.stream}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.dead_letter, dead)
            pipe.xack(self.stream, self.group, entry_id)
            await pipe.execute()

    async def _handle(self, message: tuple[Any, str]) -> Any:
        fields, entry_id = message
        return await self.handler(fields, entry_id)


def _id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
