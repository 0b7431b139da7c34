"""NATS JetStream (nats-py): a message handler whose effects commit once per message id.

`jetstream(...)` decorates ``async def handle(msg)``; the result is the push subscription's
callback (`subscribe`, which also checks the consumer) or what a pull subscription's loop
awaits for each fetched message (after `pull_subscribe`). Per delivery (`MessageRun`):

- ACK: ``msg.ack()`` (``ack_sync()`` with `ack_sync`: the server confirmed it);
- RETRY: ``msg.nak(delay=requeue_delay_seconds)``;
- DEAD: ``msg.term()``, with the log line naming the message and why (JetStream has no
  dead letter of its own: its ``MSG_TERMINATED`` advisory is the place to collect them).

While the run works, ``msg.in_progress()`` keeps the server from redelivering its message
(`_in_progress`, the lease watchdog's twin); a consumer that would stop delivering before
the message reached the dead letter is refused when subscribed (`check`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerInfo
from nats.js.client import JetStreamContext

from .._log import describe
from .._recording import Records
from ..store import Store
from ._run import Handler, MessageRun, OnEvent, Verdict, checked_options

__all__ = ["JetStreamHandler", "jetstream"]

logger = logging.getLogger("goblin_idem.consumers")

MSG_ID = "Nats-Msg-Id"


def jetstream(
    store: Store,
    *,
    key: Callable[[Msg], str | bytes | int | None] | None = None,
    records: Records | None = None,
    max_deliveries: int = 5,
    ack_sync: bool = False,
    lease_seconds: float = 30,
    ttl_seconds: float = 86_400,
    namespace: str = "once",
    scope: str | None = None,
    requeue_delay_seconds: float = 1.0,
    on_event: OnEvent | None = None,
) -> Callable[[Handler], JetStreamHandler]:
    """Run the decorated ``async def handle(msg)`` once per message id: the ``Nats-Msg-Id``
    header, or what `key` (a function of the message) returns. Keys are scoped by the
    stream and consumer (``nats:<stream>:<consumer>``) unless `scope` names another."""
    delay = checked_options(key, requeue_delay_seconds)

    def decorate(handler: Handler) -> JetStreamHandler:
        run = MessageRun(
            store,
            handler,
            records=records,
            max_deliveries=max_deliveries,
            lease_seconds=lease_seconds,
            ttl_seconds=ttl_seconds,
            namespace=namespace,
            on_event=on_event,
        )
        return JetStreamHandler(run, key, bool(ack_sync), scope, delay)

    return decorate


class JetStreamHandler:
    """The decorated handler: await it with a JetStream message."""

    def __init__(
        self,
        run: MessageRun,
        key: Callable[[Msg], str | bytes | int | None] | None,
        ack_sync: bool,
        scope: str | None,
        requeue_delay: float,
    ) -> None:
        self.run = run
        self.key = key
        self.ack_sync = ack_sync
        self.scope = scope
        self.requeue_delay = requeue_delay
        # a third of the shorter of the lease and ack_wait (`check` lowers it)
        self.progress_every = run.lease_seconds / 3

    def check(self, info: ConsumerInfo) -> None:
        """Refuse a consumer that would stop redelivering before `max_deliveries` failed
        runs (and a dead letter) were reached; note its ``ack_wait``."""
        config = info.config
        limit = config.max_deliver
        if limit is not None and 0 < limit <= self.run.max_deliveries:
            raise ValueError(
                f"the JetStream consumer {info.name!r} has max_deliver={limit}, not above "
                f"max_deliveries={self.run.max_deliveries}: the server would stop delivering a "
                "failing message before it is terminated with its error. Create the consumer "
                "with a larger max_deliver (or -1), or pass a smaller max_deliveries"
            )
        if config.ack_wait:
            self.progress_every = min(self.progress_every, config.ack_wait / 3)

    async def subscribe(
        self, js: JetStreamContext, subject: str, **kwargs: Any
    ) -> JetStreamContext.PushSubscription:
        """``js.subscribe(subject, cb=self.__call__, manual_ack=True, **kwargs)``, checked
        (nats-py takes a coroutine function, which an instance is not)."""
        sub = await js.subscribe(subject, cb=self.__call__, manual_ack=True, **kwargs)
        await self._checked(sub)
        return sub

    async def pull_subscribe(
        self, js: JetStreamContext, subject: str, durable: str, **kwargs: Any
    ) -> JetStreamContext.PullSubscription:
        """``js.pull_subscribe(subject, durable, **kwargs)``, checked; await this handler
        with each message fetched."""
        sub = await js.pull_subscribe(subject, durable, **kwargs)
        await self._checked(sub)
        return sub

    async def _checked(
        self, sub: JetStreamContext.PushSubscription | JetStreamContext.PullSubscription
    ) -> None:
        try:
            self.check(await sub.consumer_info())
        except BaseException:
            await sub.unsubscribe()
            raise

    async def __call__(self, msg: Msg) -> Any:
        """Handle one delivery: the handler's value (kept by the first run) once acked,
        else None."""
        meta = msg.metadata
        scope = self.scope or f"nats:{meta.stream}:{meta.consumer}"
        about = f"subject {msg.subject}, stream sequence {meta.sequence.stream}"
        try:
            key = self.key(msg) if self.key is not None else (msg.headers or {}).get(MSG_ID)
        except Exception as exc:  # no key: terminated, with why
            key, about = None, f"{about}; the key function raised {describe(exc)}"
        progress = asyncio.ensure_future(self._in_progress(msg))
        try:
            outcome = await self.run(
                msg, key, scope, redelivered=meta.num_delivered > 1, about=about
            )
        finally:
            progress.cancel()
        if outcome.verdict is Verdict.ACK:
            if self.ack_sync:
                await msg.ack_sync()
            else:
                await msg.ack()
            return outcome.value
        if outcome.verdict is Verdict.DEAD:
            await msg.term()
        else:
            await msg.nak(delay=self.requeue_delay)
        return None

    async def _in_progress(self, msg: Msg) -> None:
        """Tell the server the run is alive until it ends (cancelled then)."""
        while True:
            await asyncio.sleep(self.progress_every)
            try:
                await msg.in_progress()
            except Exception as exc:  # the connection is gone: the server redelivers
                logger.warning("could not send in_progress for a message: %r", exc)
                return
