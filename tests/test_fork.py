"""A RedisStore used before a fork (``gunicorn --preload`` imports the app, and whatever it
runs at import, in the parent) works in every child on connections of its own, and leaves
the parent's connections alone; a store first used in a loop that has since closed
(``asyncio.run`` at import) works in the next loop."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading

import httpx
import pytest

from goblin_idem import CLAIMED, RedisStore
from goblin_idem._threads import _loop
from goblin_idem.store import Published
from tests.support.procs import APPS, in_child, spawn, stop, wait_http
from tests.support.servers import Server, free_port, start_cluster


async def exercise(store: RedisStore, tag: str) -> list[str]:
    """Every kind of call the store makes, on keys of this `tag`; what each one answered."""

    tag += f"-{os.getpid()}-{secrets.token_hex(4)}"  # fresh keys, whoever ran before

    async def steps() -> list[str]:
        c, r = f"{{{tag}}}:c", f"{{{tag}}}:r"
        await store.detect()
        seen = [repr(await store.claim_unless_done(c, r, "t", 30))]
        seen.append(repr(await store.publish(r, b"done", 30_000, c, "t")))
        seen.append(repr(await store.claim_unless_done(c, r, "u", 30)))
        seen.append(repr(await store.caexpire_many([(c, "t", 30_000)])))
        seen.append(repr(await store.set(f"{{{tag}}}:plain", "v")))
        seen.append(repr(await store.get(f"{{{tag}}}:plain")))
        return seen

    return await asyncio.wait_for(steps(), 5)


EXPECTED = [repr(CLAIMED), repr(Published.STORED), "b'done'", "[1]", "True", "b'v'"]


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
def test_a_store_used_before_a_fork_works_in_the_child_and_the_parent(
    redis_server: Server, autopipeline: bool
) -> None:
    """The parent's loop stays open across the fork: the child must neither use nor close
    the parent's sockets, or the parent's next replies go astray."""
    store = RedisStore.from_url(redis_server.url, autopipeline=autopipeline)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(exercise(store, "parent-1")) == EXPECTED
        child = in_child(lambda: asyncio.run(exercise(store, "child")))
        assert child == EXPECTED
        assert loop.run_until_complete(exercise(store, "parent-2")) == EXPECTED
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()


@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
def test_a_store_used_in_a_closed_loop_works_in_children_and_the_next_loop(
    redis_server: Server, autopipeline: bool
) -> None:
    """What ``gunicorn --preload`` does with an app that detects at import: asyncio.run in
    the parent, then a fork per worker, each with a loop of its own."""
    store = RedisStore.from_url(redis_server.url, autopipeline=autopipeline)
    assert asyncio.run(exercise(store, "import")) == EXPECTED
    children = [in_child(lambda i=i: asyncio.run(exercise(store, f"w{i}"))) for i in range(2)]
    assert children == [EXPECTED, EXPECTED]
    assert asyncio.run(exercise(store, "again")) == EXPECTED  # the parent's next loop
    asyncio.run(store.aclose())


def test_a_cluster_store_used_before_a_fork_works_in_the_child() -> None:
    cluster = start_cluster("redis", masters=3)
    try:
        url = f"redis://127.0.0.1:{cluster.servers[0].port}/0"
        store = RedisStore.from_url(url, cluster=True, wait_replicas=0)
        waiting = RedisStore.from_url(url, cluster=True, wait_replicas=1, wait_timeout_seconds=0.05)
        assert asyncio.run(exercise(store, "import")) == EXPECTED
        # The per-primary clients too (no replica here: WAIT answers 0, a clean refusal).
        assert "NotReplicatedError" in asyncio.run(_claim_error(waiting, "import-wait"))
        assert in_child(lambda: asyncio.run(exercise(store, "child"))) == EXPECTED
        assert "NotReplicatedError" in in_child(lambda: asyncio.run(_claim_error(waiting, "c")))
        asyncio.run(store.aclose())
        asyncio.run(waiting.aclose())
    finally:
        cluster.stop()


async def _claim_error(store: RedisStore, tag: str) -> str:
    try:
        await asyncio.wait_for(store.claim_unless_done(f"{{{tag}}}:c", f"{{{tag}}}:r", "t", 5), 5)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("autopipeline", ["1", "0"], ids=["shared", "direct"])
def test_gunicorn_preload_workers_answer_their_first_keyed_requests(
    redis_server: Server, autopipeline: str
) -> None:
    """The app detects its store at import; gunicorn imports it once and forks two uvicorn
    workers. Each worker's first keyed request must run, not fail on the parent's socket."""
    with redis_server.sync_client() as r:
        r.flushall()
    port = free_port()
    proc = spawn(
        [
            "-m",
            "gunicorn",
            "--preload",
            "--workers",
            "2",
            "--worker-class",
            "uvicorn.workers.UvicornWorker",
            "--bind",
            f"127.0.0.1:{port}",
            "--log-level",
            "warning",
            f"{APPS}.preload_app:app",
        ],
        {"REDIS_URL": redis_server.url, "AUTOPIPELINE": autopipeline},
    )
    try:
        wait_http(proc, port, name="gunicorn", timeout=20)

        async def post(i: int) -> httpx.Response:
            await asyncio.sleep(i * 0.03)  # staggered: a worker busy with one leaves the next
            async with httpx.AsyncClient(timeout=10) as http:  # a connection each
                return await http.post(
                    f"http://127.0.0.1:{port}/work", headers={"Idempotency-Key": f"k{i}"}
                )

        async def post_all(first: int) -> list[httpx.Response]:
            return await asyncio.gather(*(post(i) for i in range(first, first + 12)))

        pids: set[int] = set()
        for batch in range(3):  # until both workers have answered
            replies = asyncio.run(post_all(batch * 12))
            assert [r.status_code for r in replies] == [201] * 12, [r.text for r in replies]
            pids |= {r.json()["pid"] for r in replies}
            if len(pids) == 2:
                break
        assert len(pids) == 2  # both workers answered, every first keyed request ran
    finally:
        stop(proc)


def test_a_fork_while_the_loop_thread_is_starting_leaves_the_child_a_loop_thread(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread of the parent is starting the loop thread (holding the lock that
    makes it one per process) when the process forks: the child, which has no such
    thread to release that lock, starts a loop thread of its own and calls the store."""
    parent = os.getpid()
    starting, go_on = threading.Event(), threading.Event()

    class SlowToStart(_loop.LoopThread):
        def __init__(self) -> None:
            if os.getpid() == parent:  # the parent's: caught halfway, at the fork
                starting.set()
                go_on.wait(10)
            super().__init__()

    monkeypatch.setattr(_loop, "LoopThread", SlowToStart)
    monkeypatch.setattr(_loop, "_current", None)
    started: list[_loop.LoopThread] = []
    starter = threading.Thread(target=lambda: started.append(_loop.loop_thread()))
    starter.start()
    try:
        assert starting.wait(10)

        def in_the_child() -> list[str]:
            store = RedisStore.from_url(redis_server.url)
            return _loop.loop_thread().run(exercise(store, "starting"), 5)

        assert in_child(in_the_child, timeout=5) == EXPECTED
    finally:
        go_on.set()
        starter.join(10)
        for thread in started:
            thread.loop.call_soon_threadsafe(thread.loop.stop)


def test_the_loop_thread_runs_uvloop_when_installed_else_asyncio(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop thread's loop is uvloop's where uvloop is installed (the test environment
    has it), and asyncio's where it is not; a store works from either."""
    import sys

    import uvloop

    assert isinstance(_loop.new_loop(), uvloop.Loop)
    assert isinstance(_loop.loop_thread().loop, uvloop.Loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` finds if absent
    plain = _loop.new_loop()
    assert not isinstance(plain, uvloop.Loop)
    plain.close()
    monkeypatch.setattr(_loop, "_current", None)
    thread = _loop.loop_thread()
    try:
        assert not isinstance(thread.loop, uvloop.Loop)
        store = RedisStore.from_url(redis_server.url)
        assert thread.run(exercise(store, "asyncio"), 5) == EXPECTED
        thread.run(store.aclose(), 5)
    finally:
        thread.loop.call_soon_threadsafe(thread.loop.stop)
