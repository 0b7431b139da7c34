"""RabbitMQ (aio-pika): a message handler whose effects commit once per message id.

`amqp(...)` decorates ``async def process(message)``; pass the result to
``queue.consume(...)`` (without ``no_ack``). Per delivery (`MessageRun`):

- ACK: ``message.ack()``, after the result is kept (with records, after the commit);
- RETRY: ``message.nack(requeue=True)`` after `requeue_delay_seconds`, which keeps a
  requeued message from coming straight back while the cause lasts (RabbitMQ requeues at
  the head of the queue);
- DEAD: ``message.reject(requeue=False)``: the queue's dead-letter exchange gets it (with
  none configured, RabbitMQ drops it: the error log line is then its only trace, so give
  the queue an ``x-dead-letter-exchange``).

The default key is the message's ``message_id`` property, which a producer must set
(docs/consumers.md says why); `key` takes a business id from the headers or body instead.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from .._log import describe
from .._recording import Records
from ..store import Store
from ._run import Handler, MessageRun, OnEvent, Verdict, checked_options

__all__ = ["AmqpHandler", "amqp"]


def amqp(
    store: Store,
    *,
    key: Callable[[AbstractIncomingMessage], str | bytes | int | None] | None = None,
    records: Records | None = None,
    max_deliveries: int = 5,
    requeue_delay_seconds: float = 1.0,
    on_event: OnEvent | None = None,
    lease_seconds: float = 30,
    ttl_seconds: float = 86_400,
    namespace: str = "once",
    scope: str | None = None,
) -> Callable[[Handler], Callable[[AbstractIncomingMessage], Coroutine[Any, Any, Any]]]:
    """Run the decorated ``async def process(message)`` once per message id. Keys are
    scoped by `scope`, by default ``amqp:`` and the function's module and qualified name
    (name the queue instead to keep the keys across a rename)."""
    delay = checked_options(key, requeue_delay_seconds)

    def decorate(handler: Handler) -> Callable[[AbstractIncomingMessage], Coroutine[Any, Any, Any]]:
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
        name = f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', '?')}"
        one = AmqpHandler(run, key, scope if scope is not None else f"amqp:{name}", delay)

        # a function, not the instance: aio-pika awaits only what is a coroutine function
        @functools.wraps(handler)
        async def process(message: AbstractIncomingMessage) -> Any:
            return await one(message)

        return process

    return decorate


class AmqpHandler:
    """One decorated handler's settings, and its one delivery."""

    def __init__(
        self,
        run: MessageRun,
        key: Callable[[AbstractIncomingMessage], str | bytes | int | None] | None,
        scope: str,
        requeue_delay: float,
    ) -> None:
        self.run = run
        self.key = key
        self.scope = scope
        self.requeue_delay = requeue_delay

    async def __call__(self, message: AbstractIncomingMessage) -> Any:
        """Handle one delivery: the handler's value (kept by the first run) once acked,
        else None."""
        about = f"delivery tag {message.delivery_tag}, routing key {message.routing_key}"
        try:
            key = self.key(message) if self.key is not None else message.message_id
        except Exception as exc:
            key, about = None, f"{about}; the key function raised {describe(exc)}"
        outcome = await self.run(
            message, key, self.scope, redelivered=bool(message.redelivered), about=about
        )
        if outcome.verdict is Verdict.ACK:
            await message.ack()
            return outcome.value
        if outcome.verdict is Verdict.DEAD:
            await message.reject(requeue=False)
        else:
            await asyncio.sleep(self.requeue_delay)
            await message.nack(requeue=True)
        return None
