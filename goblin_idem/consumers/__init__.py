"""Broker consumers whose effects commit once per message id, on `once`'s run.

- `_run`: one delivery's run, broker-neutral (ack, retry or dead letter; failures counted).
- `_streams`: Redis Streams (`StreamConsumer`), with the ``redis`` dependency alone.
- `_amqp`: RabbitMQ through aio-pika (`amqp`, extra ``amqp``).
- `_nats`: NATS JetStream through nats-py (`jetstream`, extra ``nats``).

`amqp` and `jetstream` import their client on first use, so the package imports without
the extras.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._run import Outcome, Verdict
from ._streams import StreamConsumer

if TYPE_CHECKING:
    from ._amqp import amqp
    from ._nats import jetstream

__all__ = ["Outcome", "StreamConsumer", "Verdict", "amqp", "jetstream"]

_EXTRAS = {"amqp": ("._amqp", "amqp", "aio-pika"), "jetstream": ("._nats", "nats", "nats-py")}


def __getattr__(name: str) -> Any:
    if name not in _EXTRAS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, extra, client = _EXTRAS[name]
    try:
        return getattr(importlib.import_module(module, __name__), name)
    except ImportError as exc:
        raise ImportError(
            f"goblin_idem.consumers.{name} needs {client}: pip install 'goblin-idem[{extra}]'"
        ) from exc
