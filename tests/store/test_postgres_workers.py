"""PostgresStore under real uvicorn workers (tests/support/apps/task_app.py), with no Redis:
a worker SIGKILLed in its handler blocks its key until the lease runs out, then one retry
runs it; a worker paused past its lease publishes late and changes no answer given.
Runs are counted by the side-effect log, one line per run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from goblin_idem import PostgresStore
from goblin_idem._keys import key_names
from tests.support.postgres import Postgres
from tests.support.procs import Uvicorn, stop
from tests.support.servers import free_port
from tests.support.waits import until

LEASE = 2  # seconds


@pytest.fixture
async def pg_url(postgres: Postgres) -> AsyncIterator[str]:
    url = f"postgresql://postgres@127.0.0.1:{postgres.port}/{postgres.new_database()}"
    store = PostgresStore.from_url(url)
    await store.create_table()
    await store.aclose()
    yield url


@pytest.fixture
def workers(pg_url: str, tmp_path: Path) -> Iterator[tuple[Uvicorn, Uvicorn, Path]]:
    side = tmp_path / "side.log"
    env = {
        "POSTGRES_STORE_URL": pg_url,
        "LEASE_SECONDS": str(LEASE),
        "COUNT_IN_STORE": "0",
        "SIDE_LOG": str(side),
    }
    a, b = Uvicorn(free_port(), env), Uvicorn(free_port(), env)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, side
    finally:
        for server in (a, b):
            if server.proc.poll() is None:
                os.kill(server.pid, signal.SIGCONT)  # a paused server ignores SIGTERM
            server.stop()


def runs(side: Path, name: str) -> int:
    if not side.exists():
        return 0
    return sum(1 for line in side.read_text().splitlines() if line.split()[-1] == name)


async def test_a_killed_worker_blocks_its_key_until_the_lease_then_runs_once(
    workers: tuple[Uvicorn, Uvicorn, Path],
) -> None:
    a, b, side = workers
    headers = {"Idempotency-Key": "order-1"}
    async with httpx.AsyncClient(timeout=10) as http:
        doomed = asyncio.create_task(
            http.post(f"{a.url}/task/charge", headers={**headers, "X-Work-Ms": "60000"})
        )
        await until(lambda: runs(side, "charge"), what="the handler started")
        stop(a.proc, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.gather(doomed, return_exceptions=True)
        refused = 0
        while (
            reply := await http.post(f"{b.url}/task/charge", headers=headers)
        ).status_code == 409:
            refused += 1
            assert time.monotonic() - killed_at < 10, "the key stayed blocked past its lease"
            await asyncio.sleep(0.1)
        assert refused > 0  # in flight while the dead run's lease lasted
        assert reply.status_code == 201 and runs(side, "charge") == 2  # then one retry ran
        again = await http.post(f"{b.url}/task/charge", headers=headers)
        assert again.headers["idempotent-replayed"] == "true" and again.content == reply.content
    assert runs(side, "charge") == 2


async def test_a_worker_paused_past_its_lease_changes_no_answer_given(
    workers: tuple[Uvicorn, Uvicorn, Path], pg_url: str
) -> None:
    a, b, side = workers
    key = "paused-1"
    claim = key_names(b"idem", b"", key.encode()).claim
    headers = {"Idempotency-Key": key}
    store = PostgresStore.from_url(pg_url)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            late = asyncio.create_task(
                http.post(f"{a.url}/task/{key}", headers={**headers, "X-Work-Ms": "300"})
            )
            await until(lambda: runs(side, key), what="the handler started")
            os.kill(a.pid, signal.SIGSTOP)

            async def lapsed() -> bool:  # A cannot renew: its claim lapses
                return await store.pttl(claim) == -2

            await until(lapsed, 10, "the paused worker's claim lapsed")
            first = await http.post(f"{b.url}/task/{key}", headers=headers)
            replay = await http.post(f"{b.url}/task/{key}", headers=headers)
            os.kill(a.pid, signal.SIGCONT)
            own = await late
            after = [await http.post(f"{s.url}/task/{key}", headers=headers) for s in (a, b, a, b)]
    finally:
        await store.aclose()
    assert runs(side, key) == 2
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == first.content
    assert own.status_code == 201 and own.headers["x-run-nonce"] != first.headers["x-run-nonce"]
    for reply in after:  # the answer given first stands: the late publish was refused
        assert reply.headers["idempotent-replayed"] == "true" and reply.content == first.content
