"""The middleware in the ASGI lifespan: the store checked at startup (one log line that
uvicorn's default logging shows, a failed startup for a store that cannot be used), closed
at shutdown, around an app's own lifespan or in place of a missing one; options refused
while an app builds its middleware fail the startup too; and the public way from the app
object to the middleware and its counters."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.types import Message, Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore
from tests.support.procs import (
    APPS,
    ROOT,
    http_status,
    output_of,
    spawn,
    stop,
    uvicorn_args,
    wait_http,
)
from tests.support.servers import Server, free_port, start_server
from tests.support.waits import until, until_sync

# -- the app under uvicorn, with its default logging --------------------------------------


def serve(port: int, **env: str) -> subprocess.Popen[bytes]:
    """`lifespan_app:app` under uvicorn at its default log level (info)."""
    return spawn(uvicorn_args(f"{APPS}.lifespan_app:app", port, "info"), env)


@pytest.mark.parametrize("own", [False, True], ids=["no-app-lifespan", "app-lifespan"])
def test_uvicorn_shows_the_store_line_and_counters_are_public(
    redis_server: Server, own: bool
) -> None:
    port = free_port()
    proc = serve(port, REDIS_URL=redis_server.url, OWN_LIFESPAN="1" if own else "0")
    try:
        wait_http(proc, port, name="uvicorn", timeout=20)
        key = {"Idempotency-Key": f"lifespan-{secrets.token_hex(4)}"}
        first = httpx.post(f"http://127.0.0.1:{port}/pay", headers=key, timeout=10)
        again = httpx.post(f"http://127.0.0.1:{port}/pay", headers=key, timeout=10)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
        counters = httpx.get(f"http://127.0.0.1:{port}/counters", timeout=10).json()
        assert (counters["claimed"], counters["replayed"]) == (1, 1)
    finally:
        err = output_of(proc)
    lines = err.splitlines()
    assert "INFO:     Application shutdown complete." in lines, err
    store_lines = [line for line in lines if "goblin-idem store" in line]
    assert store_lines == [
        f"INFO:     goblin-idem store: redis at 127.0.0.1:{redis_server.port}; mode: script "
        "(server lacks GOBLIN.CLAIM; running the Lua scripts with EVALSHA); every command it "
        "sends is allowed"
    ], err
    started = lines.index("INFO:     Application startup complete.")
    assert lines.index(store_lines[0]) < started
    if own:  # the app's startup ran after the store was checked, its shutdown ran too
        assert "app startup: store mode script" in lines[lines.index(store_lines[0]) :]
        assert "app shutdown" in lines


def test_an_unreachable_store_fails_startup_with_the_fix() -> None:
    port, dead = free_port(), free_port()
    proc = serve(port, REDIS_URL=f"redis://127.0.0.1:{dead}/0")
    try:
        proc.wait(timeout=30)
    finally:
        err = output_of(proc)
    assert proc.returncode == 3, err  # uvicorn's exit code for a failed startup
    assert f"goblin-idem store: cannot use the Redis at 127.0.0.1:{dead}" in err
    assert "or pass check_store=False to start anyway" in err
    assert "Application startup failed. Exiting." in err


def test_check_store_false_starts_and_answers_503() -> None:
    port, dead = free_port(), free_port()
    proc = serve(port, REDIS_URL=f"redis://127.0.0.1:{dead}/0", CHECK_STORE="0")
    try:
        wait_http(proc, port, name="uvicorn", timeout=20)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/pay", headers={"Idempotency-Key": "k1"}, timeout=20
        )
        assert reply.status_code == 503
        assert reply.json()["type"] == "urn:goblin-idem:problem:store-unavailable"
        unkeyed = httpx.post(f"http://127.0.0.1:{port}/pay", timeout=20)
        assert unkeyed.status_code == 200
    finally:
        err = output_of(proc)
    assert f"WARNING:  goblin-idem store: cannot use the Redis at 127.0.0.1:{dead}" in err
    assert "starting anyway (check_store=False): those requests get 503" in err


# -- options refused while the app builds its middleware, under real servers ---------------

REFUSED = {  # what misconfigured_app's BAD gives the middleware, and the message
    "store": "IdempotencyMiddleware: TypeError: store must be a Store, not a URL string: "
    "pass store=RedisStore.from_url(url)",
    "lease": "IdempotencyMiddleware: ValueError: lease_seconds must be >= 1 (seconds, finite), "
    "got 0.5",
}


def serve_misconfigured(
    port: int, framework: str, bad: str, *lifespan: str
) -> subprocess.Popen[bytes]:
    """`misconfigured_app:app` under uvicorn at its default log level, `lifespan` flags."""
    args = uvicorn_args(f"{APPS}.misconfigured_app:app", port, "info") + list(lifespan)
    return spawn(args, {"FRAMEWORK": framework, "BAD": bad})


@pytest.mark.parametrize("bad", sorted(REFUSED))
@pytest.mark.parametrize("framework", ["fastapi", "starlette"])
def test_refused_options_fail_startup_under_uvicorns_defaults(framework: str, bad: str) -> None:
    """uvicorn's --lifespan auto takes an error raised in the lifespan call (where the app
    builds its middleware) for "lifespan unsupported" and starts; the middleware fails
    the startup instead, with the error's message, and uvicorn exits."""
    proc = serve_misconfigured(free_port(), framework, bad)
    try:
        proc.wait(timeout=30)
    finally:
        err = output_of(proc)
    assert proc.returncode == 3, err  # uvicorn's exit code for a failed startup
    assert any(line.startswith(f"ERROR:    {REFUSED[bad]}") for line in err.splitlines()), err
    assert "Application startup failed. Exiting." in err
    assert "appears unsupported" not in err


def test_refused_options_fail_startup_with_lifespan_on() -> None:
    proc = serve_misconfigured(free_port(), "fastapi", "store", "--lifespan", "on")
    try:
        proc.wait(timeout=30)
    finally:
        err = output_of(proc)
    assert proc.returncode == 3, err
    assert REFUSED["store"] in err
    assert "Application startup failed. Exiting." in err


def test_refused_options_fail_startup_under_granian() -> None:
    """Granian, too, goes on without a lifespan that raises, and stops for one that fails."""
    args = ["-m", "granian", "--interface", "asgi", "--host", "127.0.0.1"]
    args += ["--port", str(free_port()), "--workers", "1", f"{APPS}.misconfigured_app:app"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FRAMEWORK": "starlette", "BAD": "store"}
    proc = subprocess.Popen(  # granian logs to stdout
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out = proc.communicate(timeout=30)[0].decode()
    finally:
        stop(proc)  # SIGTERM: granian stops its worker too
    assert proc.returncode != 0, out
    assert f"[ERROR] {REFUSED['store']}" in out


def test_with_lifespan_off_every_request_fails_with_the_message() -> None:
    """A server that runs no lifespan cannot be stopped from starting: each request is a
    500, and the server's log has the error, whole, for each."""
    port = free_port()
    proc = serve_misconfigured(port, "fastapi", "lease", "--lifespan", "off")
    try:

        def answering() -> bool:
            assert proc.poll() is None
            return http_status(port, "/health") is not None

        until_sync(answering, what="the server answered")
        assert [http_status(port, "/health"), http_status(port, "/docs")] == [500, 500]
    finally:
        err = output_of(proc)
    message = REFUSED["lease"].removeprefix("IdempotencyMiddleware: ")
    assert err.splitlines().count(message) >= 2, err  # the last line of each traceback
    assert "Exception in ASGI application" in err


@pytest.mark.parametrize("framework", ["fastapi", "starlette"])
async def test_refused_options_fail_the_lifespan_and_every_request(framework: str) -> None:
    """In process, as a server sees it: the lifespan's startup fails with the message; a
    request (no lifespan run) raises the error itself."""

    def build() -> Any:
        if framework == "fastapi":
            app = FastAPI()
            app.add_middleware(IdempotencyMiddleware, lease_seconds=0.5)  # type: ignore[arg-type]
            return app
        return Starlette(middleware=[Middleware(IdempotencyMiddleware, lease_seconds=0.5)])

    async with lifespan(build(), expect="failed") as sent:
        pass
    assert sent == [{"type": "lifespan.startup.failed", "message": REFUSED["lease"]}]
    transport = httpx.ASGITransport(app=build())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for _ in range(2):
            with pytest.raises(ValueError, match="lease_seconds must be >= 1"):
                await client.post("/x")


def test_built_by_hand_it_raises_at_once() -> None:
    app = FastAPI()
    with pytest.raises(ValueError, match="lease_seconds must be >= 1"):
        IdempotencyMiddleware(app, lease_seconds=0.5)


# -- in process: the lifespan messages themselves ------------------------------------------


@asynccontextmanager
async def lifespan(app: Any, expect: str = "complete") -> AsyncIterator[list[Message]]:
    """Drive `app` through the lifespan as a server does; the messages it sent."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    sent: list[Message] = []
    changed = asyncio.Event()

    async def send(message: Message) -> None:
        sent.append(message)
        changed.set()

    async def wait_for(kind: str) -> None:
        while not any(m["type"].startswith(kind) for m in sent):
            changed.clear()
            await asyncio.wait_for(changed.wait(), 20)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, inbox.get, send))
    await inbox.put({"type": "lifespan.startup"})
    await wait_for("lifespan.startup.")
    assert sent[-1]["type"] == f"lifespan.startup.{expect}", sent
    try:
        yield sent
    finally:
        if expect == "complete":
            await inbox.put({"type": "lifespan.shutdown"})
            await wait_for("lifespan.shutdown.")
        await asyncio.wait_for(task, 20)


def client_names(server: Server) -> list[str]:
    with server.sync_client() as r:
        return [c.get("name", "") for c in r.client_list()]


async def test_shutdown_closes_the_store_after_the_apps_own_shutdown(
    redis_server: Server,
) -> None:
    name = f"lifespan-{secrets.token_hex(4)}"
    store = RedisStore.from_url(redis_server.url, client_name=name)
    order: list[str] = []

    @asynccontextmanager
    async def own(app: FastAPI) -> AsyncIterator[None]:
        order.append(f"app startup, mode {store.mode}")
        yield
        await store.get("still-open")  # the app may use the store in its shutdown
        order.append("app shutdown")

    app = FastAPI(lifespan=own)
    app.add_middleware(IdempotencyMiddleware, store=store)

    @app.post("/x")
    async def x() -> dict[str, str]:
        return {"ok": "yes"}

    async with lifespan(app):
        assert order == ["app startup, mode script"]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.post("/x", headers={"Idempotency-Key": name})).status_code == 200
        assert name in client_names(redis_server)
        assert IdempotencyMiddleware.of(app).counters.claimed == 1
    assert order == ["app startup, mode script", "app shutdown"]
    # the server sees a closed socket only when its event loop gets to it
    await until(lambda: name not in client_names(redis_server), 10, f"{name} disconnected")


async def test_close_store_false_leaves_it_open(redis_server: Server) -> None:
    name = f"lifespan-{secrets.token_hex(4)}"
    store = RedisStore.from_url(redis_server.url, client_name=name)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, close_store=False)
    try:
        async with lifespan(app):
            pass
        assert await store.get("after") is None  # the connection is still there
        assert name in client_names(redis_server)
    finally:
        await store.aclose()


async def test_a_store_that_may_evict_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    server = start_server("redis", args=["--maxmemory-policy", "allkeys-lru"])
    store = RedisStore.from_url(server.url)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store)
    try:
        with caplog.at_level(logging.INFO, logger="goblin_idem"):
            async with lifespan(app):
                pass
    finally:
        server.stop()
    records = [r for r in caplog.records if r.name.startswith("goblin_idem")]
    assert len(records) == 1, [r.getMessage() for r in records]
    (record,) = records
    assert (record.name, record.levelno) == ("goblin_idem.lifespan", logging.WARNING)
    message = record.getMessage()
    assert message.startswith(f"goblin-idem store: redis at 127.0.0.1:{server.port}; mode: ")
    assert "evicts keys when memory is full (maxmemory-policy allkeys-lru" in message


async def test_a_refused_command_fails_startup(redis_server: Server) -> None:
    user = f"app-{secrets.token_hex(4)}"
    with redis_server.sync_client() as r:
        r.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "+@all", "-pttl")
    store = RedisStore.from_url(redis_server.url, username=user, password="pw")
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store)
    try:
        async with lifespan(app, expect="failed") as sent:
            pass
    finally:
        await store.aclose()
        with redis_server.sync_client() as r:
            r.execute_command("ACL", "DELUSER", user)
    message = sent[-1]["message"]
    assert f"refuses commands: the store's ACL user {user!r} may not run pttl" in message
    assert f"ACL SETUSER {user} +pttl" in message


async def test_an_app_without_lifespan_is_answered_by_the_middleware() -> None:
    """Django's ASGI handler raises for a lifespan scope; wrapped, the middleware runs the
    lifespan alone and the store still gets its startup and shutdown."""
    closed: list[bool] = []

    class Store(MemoryStore):
        async def aclose(self) -> None:
            closed.append(True)

    async def django_like(scope: Scope, receive: Receive, send: Send) -> None:
        raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")

    mw = IdempotencyMiddleware(django_like, store=Store())
    async with lifespan(mw) as sent:
        assert closed == []
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert closed == [True]
    assert IdempotencyMiddleware.of(mw) is mw


def test_of_an_app_that_never_started_says_when_it_will_work() -> None:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware)
    with pytest.raises(LookupError, match="when the server starts it"):
        IdempotencyMiddleware.of(app)


async def test_the_store_line_is_said_once_per_store_and_namespace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An app that serves a sub-app of its own on the same store said the store line twice;
    a middleware on another namespace says which one its line is about."""
    store, other = MemoryStore(), MemoryStore()
    apps = []
    for app_store, namespace in ((store, "idem"), (store, "idem"), (other, "card")):
        app = FastAPI()
        app.add_middleware(IdempotencyMiddleware, store=app_store, namespace=namespace)
        apps.append(app)
    with caplog.at_level(logging.INFO, logger="goblin_idem"):
        for app in apps:
            async with lifespan(app):
                pass
    lines = [r.getMessage() for r in caplog.records if r.name == "goblin_idem.lifespan"]
    assert [line.split(":")[0] for line in lines] == [
        "goblin-idem store",
        "goblin-idem store (namespace card)",
    ], lines
