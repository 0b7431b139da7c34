from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.brokers import Nats, RabbitMQ, start_nats, start_rabbitmq


@pytest.fixture(scope="session")
def nats_server() -> Iterator[Nats]:
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitMQ]:
    server = start_rabbitmq()
    yield server
    server.stop()
