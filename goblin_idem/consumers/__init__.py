"""Broker consumers whose effects commit once per message id, on `once`'s run.

- `_run`: one delivery's run, broker-neutral (ack, retry or dead letter; failures counted).
- `_streams`: Redis Streams (`StreamConsumer`), with the ``redis`` dependency alone.
- `_amqp`: RabbitMQ through aio-pika (`amqp`, extra ``amqp``).
- `_nats`: NATS JetStream through nats-py (`jetstream`, extra ``nats``).
"""

from ._run import Outcome, Verdict
from ._streams import StreamConsumer

__all__ = ["Outcome", "StreamConsumer", "Verdict"]
