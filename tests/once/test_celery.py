"""A sync `once` function as a Celery task: a real worker, Redis as its broker, tasks
acknowledged late. A worker killed (SIGKILL) after the work was done but before the task
was acknowledged, and one killed in the middle of the work: the broker redelivers both to
the next worker, and each event is committed exactly once."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from celery import Celery

from goblin_idem._keys import key_names
from tests.support.procs import spawn, stop
from tests.support.servers import Server
from tests.support.waits import until_sync

APP = "tests.support.apps.celery_app"


@pytest.fixture
def broker(redis_server: Server) -> Iterator[Server]:
    with redis_server.sync_client() as client:
        client.flushall()
    yield redis_server


def worker(server: Server) -> subprocess.Popen[bytes]:
    args = ["-m", "celery", "-A", APP, "worker", "--pool", "threads", "--concurrency", "2"]
    args += ["--without-heartbeat", "--without-gossip", "--without-mingle"]
    args += ["--loglevel", "warning", "--hostname", f"w{time.monotonic_ns()}@%h"]
    return spawn(args, {"REDIS_URL": server.url})


def test_a_redelivered_task_commits_once(broker: Server) -> None:
    app = Celery("client", broker=broker.url, backend=broker.url)  # sends, reads results
    client = broker.sync_client()

    def count(name: str) -> int:
        return int(client.get(f"runs:{name}") or 0)  # as tests.support.apps.counting counts

    # the value a run of "done-not-acked" stores (its commit is counted just before)
    stored = key_names(b"once", f"{APP}.charge_once".encode(), b"done-not-acked").result
    first = worker(broker)
    try:
        done = app.send_task("charge", args=["done-not-acked"], kwargs={"after_ms": 60_000})
        cut = app.send_task("charge", args=["cut-mid-work"], kwargs={"work_ms": 60_000})
        until_sync(
            lambda: client.exists(stored) and count("started:cut-mid-work") == 1,
            30,
            "one task's value stored, the other task started: where the worker dies",
        )
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        stop(first)
    second = worker(broker)
    try:
        assert done.get(timeout=30) == {"started": 1, "committed": 1}  # the stored value
        # the cut run's lease (1 s) ran out: run again, to its commit
        value = cut.get(timeout=30, propagate=False)
        assert value in ({"started": 2, "committed": 1}, None), value
    finally:
        stop(second)
    assert count("started:done-not-acked") == 1 and count("committed:done-not-acked") == 1
    assert count("started:cut-mid-work") == 2 and count("committed:cut-mid-work") == 1
    client.close()
    app.close()


def test_a_task_that_reuses_a_key_with_other_arguments_fails(broker: Server) -> None:
    """The arguments arrive through the broker's JSON and are fingerprinted the same: the
    task sent again alike gets the stored value; sent with other cents, it fails with
    KeyReusedError and the function does not run again."""
    app = Celery("client", broker=broker.url, backend=broker.url)
    client = broker.sync_client()
    proc = worker(broker)
    try:
        first = app.send_task("refund", args=["o-1", 500]).get(timeout=30)
        again = app.send_task("refund", args=["o-1"], kwargs={"cents": 500}).get(timeout=30)
        assert first == again == {"cents": 500, "run": 1}
        reused = app.send_task("refund", args=["o-1", 999])
        reused.get(timeout=30, propagate=False)
        assert reused.state == "FAILURE" and "KeyReusedError" in (reused.traceback or "")
        assert "first used with other arguments" in reused.traceback
    finally:
        stop(proc)
    assert int(client.get("runs:refunds:o-1") or 0) == 1
    client.close()
    app.close()
