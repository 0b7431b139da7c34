"""The middleware's suites run on every store of the root `backend` fixture and on
PostgresStore (asyncpg) too."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.backends import BACKENDS, Backend, open_backend


@pytest.fixture(params=[*BACKENDS, "postgres-asyncpg"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request, request.param) as opened:
        yield opened
