"""What an operator sees of goblin-idem's WARNING and ERROR lines: under uvicorn's default
logging, in uvicorn's log with the level and the logger's name; in an app that configured
logging, once each, by the app's handlers; with no server and no logging configured, on
stderr with the time, the level and the logger's name."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.support.procs import APPS, ROOT, output_of, spawn, uvicorn_args, wait_http
from tests.support.servers import Server, free_port

SHARED = "a request with an Idempotency-Key carries no Authorization header but a cookie header"
OUTAGE = re.compile(r"store error for key [0-9a-f]{32}, answering 503: ConnectionError: ")
# The line's start for each: under uvicorn's default logging, in basicConfig's format.
PREFIX = {
    "server": ("WARNING:  goblin_idem.middleware: ", "ERROR:    goblin_idem.middleware: "),
    "basic": ("WARNING:goblin_idem.middleware:", "ERROR:goblin_idem.middleware:"),
}


def lines_with(text: str, pattern: str | re.Pattern[str]) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


@pytest.mark.parametrize("configured", sorted(PREFIX))
def test_uvicorn_shows_each_warning_and_error_once_with_level_and_logger(
    own_redis: Server, configured: str
) -> None:
    """The shared-scope WARNING (a keyed request with a Cookie and no Authorization) and a
    store error's ERROR (503, the store stopped), from a real uvicorn process."""
    port = free_port()
    args = uvicorn_args(f"{APPS}.lifespan_app:app", port, "info")
    proc = spawn(args, {"REDIS_URL": own_redis.url, "LOGGING": configured})
    try:
        wait_http(proc, port, name="uvicorn", timeout=20)
        url = f"http://127.0.0.1:{port}/pay"
        headers = {"Idempotency-Key": "log-1", "Cookie": "session=abc"}
        assert httpx.post(url, headers=headers, timeout=10).status_code == 200
        own_redis.stop()
        outage = httpx.post(url, headers={"Idempotency-Key": "log-2"}, timeout=20)
        assert outage.status_code == 503
    finally:
        err = output_of(proc)
    warning, error = PREFIX[configured]
    (shared,) = lines_with(err, SHARED)
    assert shared.startswith(warning + SHARED), err
    (failed,) = lines_with(err, OUTAGE)
    assert failed.startswith(error) and OUTAGE.match(failed.removeprefix(error)), err


SCRIPT = """
import asyncio
from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore
from tests.support.asgi import request

async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

async def main():
    shared = IdempotencyMiddleware(app, store=MemoryStore())
    await request(shared, "POST", "/x", headers=[("Idempotency-Key", "k"), ("Cookie", "s=1")])
    down = IdempotencyMiddleware(app, store=RedisStore.from_url("redis://127.0.0.1:%d/0"))
    assert (await request(down, "POST", "/x", headers=[("Idempotency-Key", "k")])).status == 503

asyncio.run(main())
"""


def test_without_a_server_or_logging_the_lines_have_time_level_and_logger() -> None:
    """Where Python's last-resort handler would print the bare message."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT % free_port()],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )
    err = done.stderr.decode()
    when = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    (shared,) = lines_with(err, SHARED)
    assert re.fullmatch(rf"{when} WARNING goblin_idem\.middleware: {SHARED}.*", shared), err
    (failed,) = lines_with(err, OUTAGE)
    assert re.fullmatch(rf"{when} ERROR goblin_idem\.middleware: {OUTAGE.pattern}.*", failed), err


AWAY = """
import asyncio, logging, sys
from goblin_idem import IdempotencyMiddleware, MemoryStore
from tests.support.asgi import request

def handler(label):
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(label + " %(name)s: %(message)s"))
    return h

server = logging.getLogger("uvicorn.error")  # a server's error log, as uvicorn sets it up
server.addHandler(handler("SERVER"))
server.setLevel(logging.INFO)
server.propagate = False
logging.getLogger().addHandler(handler("ROOT"))
own = logging.getLogger(sys.argv[1])
own.propagate = False
if sys.argv[2] == "own":
    own.addHandler(handler("APP"))
    own.setLevel(logging.INFO)

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

async def main():
    mw = IdempotencyMiddleware(app, store=MemoryStore())
    messages = [{"type": "lifespan.startup"}]
    async def receive():
        return messages.pop() if messages else {"type": "lifespan.shutdown"}
    async def send(message):
        pass
    await mw({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    await request(mw, "POST", "/x", headers=[("Idempotency-Key", "k"), ("Cookie", "s=1")])

asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("name", "handled"),
    [("goblin_idem", "own"), ("goblin_idem.middleware", "own"), ("goblin_idem", "none")],
)
def test_a_logger_that_does_not_propagate_gets_the_lines(name: str, handled: str) -> None:
    """A goblin-idem logger with ``propagate=False``: with a handler of its own, that
    handler gets every line of the loggers under it, once, and the server's log none of
    them; ``goblin_idem`` with none: the root logger's handler is out of their way, and
    the lines go to the server's log as if logging had not been configured."""
    done = subprocess.run(
        [sys.executable, "-c", AWAY, name, handled],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    )
    out = done.stdout.decode()
    label = "APP" if handled == "own" else "SERVER"
    shared = lines_with(out, SHARED)
    assert [line.split(" ", 1)[0] for line in shared] == [label], out
    assert "ROOT" not in out and done.stderr == b"", out + done.stderr.decode()
    if name == "goblin_idem":  # the startup line too (goblin_idem.lifespan)
        startup = lines_with(out, "goblin-idem store: memory")
        assert [line.split(" ", 1)[0] for line in startup] == [label], out
