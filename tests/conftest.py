from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from goblin_idem.native import build_module
from goblin_idem.store import Store
from tests.support.backends import BACKENDS, Backend, open_backend
from tests.support.postgres import Postgres, start_postgres
from tests.support.servers import KINDS, Cluster, Server, running_cluster, start_server

MODES = ("script", "native")
KIND_MODES = [(kind, mode) for kind in KINDS for mode in MODES]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Server]:
    server = start_server("redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[Server]:
    server = start_server("valkey")
    yield server
    server.stop()


@pytest.fixture
def own_redis() -> Iterator[Server]:
    """A redis-server for this test alone, which it may stop, pause (SIGSTOP) or load."""
    server = start_server("redis")
    yield server
    if server.running():
        os.kill(server.pid, signal.SIGCONT)  # a paused server would ignore the SIGTERM
    server.stop()


@pytest.fixture(scope="session")
def native_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_module(tmp_path_factory.mktemp("native"))


@pytest.fixture(scope="session")
def modules_for(request: pytest.FixtureRequest) -> Callable[[str], list[str]]:
    """The `modules` of a server in a mode: the native module for "native" (built once, by
    the first test that needs it), none for "script"."""

    def modules(mode: str) -> list[str]:
        return [str(request.getfixturevalue("native_module"))] if mode == "native" else []

    return modules


def _cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, str]]:
    kind, mode = request.param
    modules = request.getfixturevalue("modules_for")(mode)
    with running_cluster(kind, modules=modules) as cluster:
        yield cluster, mode


@pytest.fixture(scope="module", params=KIND_MODES, ids="-".join)
def shared_cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, str]]:
    """A 3-primary cluster of each kind and mode, and the mode, for a module's tests that
    move no slot and stop no node (narrowed with an indirect parametrize)."""
    yield from _cluster(request)


@pytest.fixture(params=KIND_MODES, ids="-".join)
def own_cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, str]]:
    """A 3-primary cluster of each kind and mode, and the mode, of the test's own (it moves
    slots or restarts nodes)."""
    yield from _cluster(request)


@pytest.fixture(scope="session")
def redis_native_server(native_module: Path) -> Iterator[Server]:
    server = start_server("redis", modules=[str(native_module)])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_native_server(native_module: Path) -> Iterator[Server]:
    server = start_server("valkey", modules=[str(native_module)])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL server per test worker; tests keep apart by databases or tables of their
    own (one that stops or breaks its server starts one of its own)."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def store_database(postgres: Postgres) -> str:
    """The database of the PostgresStore backends (each empties its table first)."""
    return postgres.new_database()


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with open_backend(request, request.param) as opened:
        yield opened


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store
