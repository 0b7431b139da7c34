from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.brokers import Nats, start_nats


@pytest.fixture(scope="session")
def nats_server() -> Iterator[Nats]:
    server = start_nats()
    yield server
    server.stop()
