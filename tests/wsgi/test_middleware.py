"""goblin_idem.wsgi.IdempotencyMiddleware in process: the ASGI middleware's guarantees for a
PEP 3333 app (one run per key across threads, byte-exact replays, its refusals), a
response as WSGI streams it (iterables closed, write(), exc_info, wsgi.file_wrapper), and
the loop thread across a fork. Served in process by tests/support/wsgi.py; the servers
(gunicorn, uvicorn) are in test_servers.py."""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from goblin_idem import (
    ClaimLostError,
    RedisStore,
    Store,
    current_claim,
    header_scope,
)
from goblin_idem import (
    IdempotencyMiddleware as ASGIMiddleware,
)
from goblin_idem._keys import key_names
from goblin_idem._threads._exchange import Exchange
from goblin_idem._threads._loop import loop_thread
from goblin_idem.wsgi import IdempotencyMiddleware
from tests.store.test_replay_cache import commands_served
from tests.support.asgi import request as asgi_request
from tests.support.backends import (
    sync_store,  # noqa: F401
)
from tests.support.procs import in_child
from tests.support.servers import Server
from tests.support.waits import until_sync
from tests.support.wsgi import Reply, StartResponse, call
from tests.support.wsgi import environ as wsgi_environ

PROBLEM = "application/problem+json"


def fresh_store(server: Server) -> RedisStore:
    """A store on `server`, emptied first (the server is the session's)."""
    with server.sync_client() as client:
        client.flushall()
    return RedisStore.from_url(server.url)


class App:
    """A WSGI app that counts its runs: ``{"run": n}`` with Content-Length, 201; `delay`
    seconds of work; `chunks` streamed without a Content-Length instead; `status` and
    `raises` as given."""

    def __init__(
        self,
        *,
        delay: float = 0,
        status: str = "201 Created",
        chunks: list[bytes] | None = None,
        raises: BaseException | None = None,
    ) -> None:
        self.delay = delay
        self.status = status
        self.chunks = chunks
        self.raises = raises
        self.runs = 0
        self.closed = 0
        self.environs: list[dict[str, Any]] = []
        self.claims: list[Any] = []
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        with self._lock:
            self.runs += 1
            run = self.runs
        self.environs.append(environ)
        self.claims.append(current_claim())
        body = environ["wsgi.input"].read()
        time.sleep(self.delay)
        if self.raises is not None:
            raise self.raises
        if self.chunks is not None:
            start_response(self.status, [("Content-Type", "text/plain")])
            return self._stream(self.chunks)
        data = json.dumps({"run": run, "body": body.decode()}).encode()
        start_response(self.status, [("Content-Type", "application/json"), ("X-Run", str(run))])
        return [data]

    def _stream(self, chunks: list[bytes]) -> Iterator[bytes]:
        try:
            yield from chunks
        finally:
            self.closed += 1


def concurrently(n: int, fn: Callable[[int], Reply]) -> list[Reply]:
    replies: list[Reply | None] = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        replies[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None for r in replies)
    return replies  # type: ignore[return-value]


# -- one run per key, its replay, the refusals ----------------------------------------------


def test_concurrent_duplicates_run_once_and_are_replayed_byte_for_byte(store: Store) -> None:
    app = App(delay=0.3)
    mw = IdempotencyMiddleware(app, store=store)
    replies = concurrently(8, lambda i: call(mw, "POST", "/pay", b'{"n": 1}', key="k"))
    codes = sorted(r.code for r in replies)
    assert codes == [201] + [409] * 7, codes
    first = next(r for r in replies if r.code == 201)
    for busy in (r for r in replies if r.code == 409):
        assert busy.header("Content-Type") == PROBLEM and busy.header("Retry-After") == "1"
    again = call(mw, "POST", "/pay", b'{"n": 1}', key="k")
    assert again.code == 201 and again.body == first.body
    assert again.header("Idempotent-Replayed") == "true"
    assert again.header("X-Run") == "1" and app.runs == 1


def test_refusals_as_the_asgi_middleware_answers_them(store: Store) -> None:
    app = App()
    mw = IdempotencyMiddleware(app, store=store, max_body_bytes=10)
    assert call(mw, "POST", "/pay", b"{}", key="k").code == 201
    reused = call(mw, "POST", "/pay", b"[]", key="k")
    assert reused.code == 422 and reused.header("Content-Type") == PROBLEM
    assert call(mw, "POST", "/pay", b"{}", key="\x01bad").code == 400
    assert call(mw, "POST", "/pay", b"x" * 11, key="big").code == 413  # by Content-Length
    assert call(mw, "POST", "/pay", b"x" * 11, key="big", chunked=True).code == 413
    assert call(mw, "POST", "/pay", b"12345", key="small", chunked=True).code == 201
    assert app.runs == 2


def test_a_required_path_without_a_key_is_400_and_the_others_pass(store: Store) -> None:
    app = App()
    mw = IdempotencyMiddleware(app, store=store, required_paths=["/pay"])
    missing = call(mw, "POST", "/pay", b"{}")
    assert missing.code == 400 and "Idempotency-Key" in missing.json()["detail"]
    assert call(mw, "POST", "/other", b"{}").code == 201
    assert app.runs == 1


def test_a_request_without_a_key_goes_straight_to_the_app(store: Store) -> None:
    """Not a copy of the environ, not another iterable: the app is called as if alone."""
    seen: list[Any] = []
    body = [b"as is"]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        seen.append(environ)
        start_response("200 OK", [])
        return body

    mw = IdempotencyMiddleware(app, store=store)
    for method, key in (("POST", None), ("GET", "k"), ("PUT", "k")):
        env = {"REQUEST_METHOD": method, "PATH_INFO": "/", "wsgi.input": None}
        if key is not None:
            env["HTTP_IDEMPOTENCY_KEY"] = key
        assert mw(env, lambda *a: None) is body
        assert seen[-1] is env


def test_the_handler_raises_the_key_is_released_and_the_error_propagates(store: Store) -> None:
    error = RuntimeError("card network down")
    app = App(raises=error)
    mw = IdempotencyMiddleware(app, store=store)
    with pytest.raises(RuntimeError) as raised:
        call(mw, key="k")
    assert raised.value is error  # the app's own, traceback and all
    app.raises = None
    assert call(mw, key="k").json()["run"] == 2


@pytest.mark.parametrize("status", ["500 Internal Server Error", "503 Service Unavailable"])
def test_a_server_error_releases_the_key(store: Store, status: str) -> None:
    app = App(status=status)
    mw = IdempotencyMiddleware(app, store=store)
    assert call(mw, key="k").status == status
    app.status = "201 Created"
    assert call(mw, key="k").json()["run"] == 2


def test_the_original_status_line_and_header_names_pass_through(store: Store) -> None:
    app = App(status="201 Payment Accepted")
    mw = IdempotencyMiddleware(app, store=store)
    first = call(mw, key="k")
    assert first.status == "201 Payment Accepted" and ("X-Run", "1") in first.headers
    replayed = call(mw, key="k")  # from the record: the code's reason phrase, names lowercased
    assert replayed.status == "201 Created" and ("x-run", "1") in replayed.headers


class CountedJobs(queue.SimpleQueue[Any]):
    """A request's queue of what the loop thread hands its thread, counted."""

    def __init__(self) -> None:
        self.puts = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.puts += 1
        super().put(item)


def test_a_call_put_after_the_exchange_ended_is_cancelled_not_left_waiting() -> None:
    """A task the coroutine started that outlives it (a records lookup that a duplicate
    answered by the store did not need) and then asks the request's thread for a call: no
    thread reads it any more, so the call is cancelled at once and the task ends, rather
    than waiting forever (a task, and what it holds, kept for the life of the process)."""
    thread = loop_thread()
    exchange = Exchange(thread)
    gates: list[asyncio.Future[None]] = []
    outcome: list[str] = []
    ended = threading.Event()

    def finished(task: asyncio.Task[None]) -> None:
        outcome.append("cancelled" if task.cancelled() else "done")
        ended.set()

    async def outliving(gate: asyncio.Future[None]) -> None:
        await gate
        await exchange.call(lambda: None)

    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()
        gates.append(gate)
        asyncio.get_running_loop().create_task(outliving(gate)).add_done_callback(finished)

    exchange.start(main())
    exchange.wait()  # the coroutine ended: this thread reads no more calls
    thread.loop.call_soon_threadsafe(gates[0].set_result, None)
    assert ended.wait(10), "the call put after the end was left waiting"
    assert outcome == ["cancelled"]


def test_a_response_in_one_piece_comes_with_the_exchange_s_end_in_one_hand_over(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the loop thread hands the request's thread: for a new key the app's run, then
    its response with the end of the exchange (one hand-over, not two); for a replay and
    an in-flight 409, the answer with the end."""
    queues: list[CountedJobs] = []
    made = Exchange.__init__

    def counted(self: Exchange, thread: Any) -> None:
        made(self, thread)
        self._jobs = CountedJobs()
        queues.append(self._jobs)

    monkeypatch.setattr(Exchange, "__init__", counted)
    entered, gate = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        environ["wsgi.input"].read()
        if environ["HTTP_IDEMPOTENCY_KEY"] == "slow":
            entered.set()
            gate.wait(30)
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"done"]

    mw = IdempotencyMiddleware(app, store=store)
    assert call(mw, key="k").code == 201 and queues[-1].puts == 2
    assert call(mw, key="k").header("Idempotent-Replayed") == "true" and queues[-1].puts == 1
    slow = threading.Thread(target=call, args=(mw,), kwargs={"key": "slow"})
    slow.start()
    try:
        assert entered.wait(30)
        assert call(mw, key="slow").code == 409 and queues[-1].puts == 1
    finally:
        gate.set()
        slow.join(30)


# -- a response as WSGI streams it ----------------------------------------------------------


def test_a_streamed_response_is_passed_on_stored_and_replayed(store: Store) -> None:
    app = App(chunks=[b"one ", b"", b"two ", b"three"])
    mw = IdempotencyMiddleware(app, store=store)
    first = call(mw, key="k")
    assert first.chunks == [b"one ", b"two ", b"three"] and app.closed == 1
    again = call(mw, key="k")
    assert again.body == b"one two three" and again.header("Idempotent-Replayed") == "true"
    assert again.header("Content-Length") == "13" and app.runs == 1


def test_a_response_over_max_response_bytes_passes_whole_and_is_not_replayed(
    store: Store,
) -> None:
    app = App(chunks=[b"x" * 600, b"y" * 600])
    mw = IdempotencyMiddleware(app, store=store, max_response_bytes=1000)
    assert call(mw, key="k").body == b"x" * 600 + b"y" * 600  # never truncated
    again = call(mw, key="k")
    assert again.code == 409 and again.header("Content-Type") == PROBLEM
    assert app.runs == 1


def test_close_is_called_when_the_app_raises_mid_stream(store: Store) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"part"
        raise ValueError("broke mid-stream")

    closed: list[bool] = []

    class Body:
        def __init__(self) -> None:
            self.it = chunks()

        def __iter__(self) -> Iterator[bytes]:
            return self.it

        def close(self) -> None:
            closed.append(True)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        start_response("201 Created", [])
        return Body()

    mw = IdempotencyMiddleware(app, store=store)
    with pytest.raises(ValueError, match="broke mid-stream"):
        call(mw, key="k")
    assert closed == [True]
    assert mw.counters.released == 1


def test_a_client_that_leaves_mid_stream_closes_the_app_and_frees_the_key(store: Store) -> None:
    app = App(chunks=[b"a", b"b", b"c", b"d"])
    mw = IdempotencyMiddleware(app, store=store)
    left = call(mw, key="k", read=1)  # the server closes the iterable after one chunk
    assert left.chunks == [b"a"] and app.closed == 1
    assert mw.counters.released == 1
    assert call(mw, key="k").body == b"abcd" and app.runs == 2


def test_the_write_callable_and_start_response_with_exc_info(store: Store) -> None:
    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        try:
            raise KeyError("lookup")
        except KeyError:
            import sys

            write = start_response("404 Not Found", [("X-Error", "1")], sys.exc_info())
        write(b"not ")
        return [b"found"]

    mw = IdempotencyMiddleware(app, store=store)
    first = call(mw, key="k")
    assert first.status == "404 Not Found" and first.body == b"not found"
    assert call(mw, key="k").header("Idempotent-Replayed") == "true"  # a 404 is an outcome


def test_a_file_wrapper_response_is_stored_and_the_file_closed(
    store: Store, tmp_path: Path
) -> None:
    path = tmp_path / "receipt.pdf"
    path.write_bytes(os.urandom(200_000))
    opened: list[Any] = []

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        f = path.open("rb")
        opened.append(f)
        start_response("200 OK", [("Content-Length", str(path.stat().st_size))])
        wrapped: Iterable[bytes] = environ["wsgi.file_wrapper"](f, 8192)
        return wrapped

    mw = IdempotencyMiddleware(app, store=store)
    first = call(mw, key="k")
    assert first.body == path.read_bytes() and opened[0].closed
    again = call(mw, key="k")
    assert again.body == path.read_bytes() and len(opened) == 1


# -- the claim, in the request's thread -----------------------------------------------------


def test_current_claim_in_the_app_thread_and_ensure_owned_as_a_plain_call(
    redis_server: Server,
) -> None:
    store = fresh_store(redis_server)
    checks: list[str] = []

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        claim = current_claim()
        assert claim is not None
        claim.ensure_owned()
        checks.append("owned")
        with redis_server.sync_client() as client:
            client.delete(claim._lease.key)  # an operator deletes the key mid-run
        try:
            claim.ensure_owned()
        except ClaimLostError:
            checks.append("lost")
        start_response("201 Created", [])
        return [b"done"]

    mw = IdempotencyMiddleware(app, store=store)
    assert call(mw, key="k").code == 201
    assert checks == ["owned", "lost"]
    assert current_claim() is None  # nothing leaks into the thread afterwards
    loop_thread().run(store.aclose())


# -- options, scope, the store --------------------------------------------------------------


def test_options_and_a_store_that_cannot_work_fail_at_construction(own_redis: Server) -> None:
    app = App()
    with pytest.raises(TypeError, match="unexpected keyword argument 'lease'"):
        IdempotencyMiddleware(app, lease=3)
    with pytest.raises(ValueError, match="lease_seconds must be >= 1"):
        IdempotencyMiddleware(app, lease_seconds=0)
    with pytest.raises(TypeError, match=r"RedisStore\.from_url"):
        IdempotencyMiddleware(app, store=RedisStore)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WSGI application"):
        IdempotencyMiddleware("app")  # type: ignore[arg-type]
    url = own_redis.url
    own_redis.stop()
    with pytest.raises(RuntimeError, match=r"cannot use the Redis at .*check_store=False"):
        IdempotencyMiddleware(app, store=RedisStore.from_url(url))
    IdempotencyMiddleware(app, store=RedisStore.from_url(url), check_store=False)  # starts


def test_a_store_that_goes_down_gets_503_or_with_fail_open_runs_the_app(
    own_redis: Server,
) -> None:
    app = App()
    mw = IdempotencyMiddleware(app, store=RedisStore.from_url(own_redis.url))
    open_mw = IdempotencyMiddleware(app, store=RedisStore.from_url(own_redis.url), fail_open=True)
    own_redis.stop()
    down = call(mw, key="k")
    assert down.code == 503 and down.header("Retry-After") == "1" and app.runs == 0
    assert call(open_mw, key="k").code == 201 and app.runs == 1


def test_a_scope_function_reads_the_environ(store: Store) -> None:
    app = App()
    mw = IdempotencyMiddleware(app, store=store, scope=lambda s: s["wsgi.environ"]["PATH_INFO"])
    assert call(mw, "POST", "/a", key="k").json()["run"] == 1
    assert call(mw, "POST", "/b", key="k").json()["run"] == 2  # another scope: not a reuse
    tenants = IdempotencyMiddleware(app, store=store, scope=header_scope("X-Tenant"))
    assert call(tenants, headers=[("X-Tenant", "t1")], key="k").json()["run"] == 3
    assert call(tenants, headers=[("X-Tenant", "t2")], key="k").json()["run"] == 4


async def test_a_wsgi_and_an_asgi_service_on_one_store_share_keys_and_records(
    redis_server: Server,
) -> None:
    """The same request, keyed alike, first to the WSGI app: the ASGI middleware replays
    what the WSGI app answered (one record format, one key naming)."""
    wsgi_store = fresh_store(redis_server)
    asgi_store = RedisStore.from_url(redis_server.url)
    app = App()
    wsgi_mw = IdempotencyMiddleware(app, store=wsgi_store)
    first = call(wsgi_mw, "POST", "/shared", b'{"n": 2}', key="shared-key")

    async def never_run(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the ASGI app ran for a key the WSGI app completed")

    replayed = await asgi_request(
        ASGIMiddleware(never_run, store=asgi_store),
        path="/shared",
        body=b'{"n": 2}',
        key="shared-key",
    )
    assert replayed.status == 201 and replayed.body == first.body
    assert replayed.header("idempotent-replayed") == b"true"
    await asgi_store.aclose()
    loop_thread().run(wsgi_store.aclose())


def test_a_store_and_the_loop_thread_used_before_a_fork_work_in_the_child(
    redis_server: Server,
) -> None:
    """gunicorn --preload: the app built (and its store checked, on the loop thread) in
    the parent, then forked; the child starts its own loop thread on its own connections,
    and the parent's keep working."""
    store = fresh_store(redis_server)
    app = App()
    mw = IdempotencyMiddleware(app, store=store)  # checks the store through the loop thread
    assert call(mw, key="parent-1").code == 201
    child = in_child(lambda: [call(mw, key=f"child-{i}").code for i in range(3)])
    assert child == [201, 201, 201]
    assert call(mw, key="parent-2").code == 201
    assert call(mw, key="child-0").header("Idempotent-Replayed") == "true"
    loop_thread().run(store.aclose())


def test_a_webhook_path_verifies_before_the_claim_and_runs_once(redis_server: Server) -> None:
    """``webhooks={path: provider}`` on the WSGI middleware: a forged delivery first (with
    the genuine one's id) is refused and claims nothing; the genuine one runs once, with its
    whole body, and its redelivery is replayed."""
    from goblin_idem.webhooks import GitHub
    from tests.support.apps.webhook_app import GITHUB_SECRETS
    from tests.support.webhooks import delivery, event_body, forged

    app = App(status="200 OK")
    store = fresh_store(redis_server)
    mw = IdempotencyMiddleware(app, store=store, webhooks={"/hooks": GitHub(GITHUB_SECRETS)})
    genuine = delivery("github", "d-1", event_body("d-1", "r-1"), path="/hooks")
    bad = forged(genuine)
    refused = call(mw, "POST", "/hooks", bad.body, list(bad.headers.items()))
    assert refused.code == 401 and refused.header("Content-Type") == PROBLEM
    with redis_server.sync_client() as client:
        assert client.keys("idem:*") == []
    assert app.runs == 0
    first = call(mw, "POST", "/hooks", genuine.body, list(genuine.headers.items()))
    again = call(mw, "POST", "/hooks", genuine.body, list(genuine.headers.items()))
    assert first.code == 200 and first.json() == {"run": 1, "body": genuine.body.decode()}
    assert again.body == first.body and again.header("Idempotent-Replayed") == "true"
    assert app.runs == 1
    assert mw.counters.webhook_refused == 1


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_the_last_byte_reaches_the_client_only_after_the_publish(
    redis_server: Server, declared: bool
) -> None:
    """The chunk that completes the response's Content-Length (or, for a streamed one, the
    iterable's end) is handed to the server only once the result is in the store: a client
    that has the whole body and retries at once gets the replay, never 409."""
    store = fresh_store(redis_server)
    parts = [b"a" * 100, b"b" * 100, b"c" * 100]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterator[bytes]:
        environ["wsgi.input"].read()
        length = [("Content-Length", str(sum(map(len, parts))))] if declared else []
        start_response("201 Created", length)
        yield from parts

    mw = IdempotencyMiddleware(app, store=store)
    result = key_names(b"idem", b"", b"last-byte").result
    seen: list[tuple[bytes, bool]] = []  # (chunk, the result stored when it arrived)

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        return None

    env = wsgi_environ("POST", "/", b"{}", [("Idempotency-Key", "last-byte")])
    iterable = mw(env, start_response)
    try:
        with redis_server.sync_client() as r:
            for chunk in iterable:
                seen.append((chunk, r.exists(result) == 1))
            ended = r.exists(result) == 1
    finally:
        getattr(iterable, "close", lambda: None)()
    assert b"".join(chunk for chunk, _ in seen) == b"".join(parts)
    if declared:  # the chunk that completes the Content-Length: after the publish
        assert seen[-1][1], seen
    else:  # the end of a streamed body (the iterable's end): after the publish
        assert ended
    assert call(mw, "POST", "/", b"{}", key="last-byte").header("Idempotent-Replayed") == "true"
    loop_thread().run(store.aclose())


class Socket(io.RawIOBase):
    """A request's body on a kept-alive connection: the next request's bytes follow it, and
    a read with no size (to EOF) would wait for the client to close."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            raise AssertionError("the body was read to EOF, not to its Content-Length")
        chunk = self.data[self.at : self.at + size]
        self.at += len(chunk)
        return chunk


def test_the_body_is_read_as_content_length_bytes_never_to_eof(redis_server: Server) -> None:
    """A keyed body is read as its Content-Length's bytes: the bytes after it belong to the
    connection's next request, and a read to EOF would wait for the client to hang up."""
    store = fresh_store(redis_server)
    bodies: list[bytes] = []

    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        bodies.append(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])))
        start_response("201 Created", [("Content-Length", "2")])
        return [b"ok"]

    mw = IdempotencyMiddleware(app, store=store)
    next_request = b"POST / HTTP/1.1\r\nHost: x\r\n\r\n"
    replies: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        replies.append(status)

    for size in (10, 100_000):  # read up front, whole: the middleware fingerprints it
        body = b"x" * size
        env = wsgi_environ("POST", "/", body, [("Idempotency-Key", f"eof-{size}")])
        env["wsgi.input"] = Socket(body + next_request)
        iterable = mw(env, start_response)
        try:
            assert b"".join(iterable) == b"ok" and replies[-1] == "201 Created"
        finally:
            getattr(iterable, "close", lambda: None)()
        assert bodies[-1] == body and env["wsgi.input"].at == size  # the next request's left
    loop_thread().run(store.aclose())


def test_scope_names_every_header_and_keeps_few_names() -> None:
    """An environ's headers are named as an ASGI server names them, however many distinct
    names clients send; the names kept for the next request stay bounded."""
    from goblin_idem.wsgi import _app

    for i in range(3 * _app._HEADER_NAMES_KEPT):
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/caf\xc3\xa9",
            f"HTTP_X_CUSTOM_{i}": "v",
            "HTTP_IDEMPOTENCY_KEY": "k",
        }
        scope = _app.scope_of(environ)
        assert scope["headers"] == [(b"x-custom-%d" % i, b"v"), (b"idempotency-key", b"k")]
        assert scope["path"] == "/caf\u00e9"
    assert len(_app._HEADER_NAMES) <= _app._HEADER_NAMES_KEPT


# -- replays from the replay cache, answered in the request's thread ------------------------


class Seen:
    """An on_event hook: each event and the thread it was reported in."""

    def __init__(self) -> None:
        self.events: list[tuple[str, threading.Thread]] = []

    def __call__(self, event: str, key_hash: str) -> None:
        self.events.append((event, threading.current_thread()))


def never(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    raise AssertionError("the app ran for a key that was completed")


def cached_store(server: Server) -> RedisStore:
    with server.sync_client() as client:
        client.flushall()
    return RedisStore.from_url(server.url, replay_cache_bytes=4 << 20)


def test_a_replay_kept_in_memory_is_answered_in_the_request_thread_as_the_store_s(
    redis_server: Server,
) -> None:
    """No round trip, no hand-over to the loop thread; the same status line, headers and
    body as a replay read from the store by a process without the cache, and as the ASGI
    middleware's; counted and told to on_event as a replay."""
    store = cached_store(redis_server)
    plain = RedisStore.from_url(redis_server.url, replay_cache_bytes=0)
    seen, app = Seen(), App()
    mw = IdempotencyMiddleware(app, store=store, on_event=seen)
    assert (
        mw.door.memory is not None and IdempotencyMiddleware(app, store=plain).door.memory is None
    )
    first = call(mw, "POST", "/pay", b'{"n": 1}', key="k")
    # the first duplicate reads the store, whose answer is then kept in memory
    assert call(mw, "POST", "/pay", b'{"n": 1}', key="k").body == first.body
    result = key_names(b"idem", b"", b"k").result
    until_sync(lambda: mw.door.memory._kept(result) is not None, what="the fill", every=0.001)  # type: ignore[union-attr]
    before = commands_served(redis_server)
    again = call(mw, "POST", "/pay", b'{"n": 1}', key="k")
    assert commands_served(redis_server) == before
    assert seen.events[-1] == ("replayed", threading.current_thread())
    assert app.runs == 1 and mw.counters.replayed == 2 and again.body == first.body
    from_store = call(
        IdempotencyMiddleware(never, store=plain), "POST", "/pay", b'{"n": 1}', key="k"
    )
    assert (again.status, again.headers, again.chunks) == (
        from_store.status,
        from_store.headers,
        from_store.chunks,
    )

    async def asgi_replay() -> Any:
        async def never_run(scope: Any, receive: Any, send: Any) -> None:
            raise AssertionError("the ASGI app ran for a key that was completed")

        asgi_store = RedisStore.from_url(redis_server.url)
        try:
            mw = ASGIMiddleware(never_run, store=asgi_store)
            return await asgi_request(mw, path="/pay", body=b'{"n": 1}', key="k")
        finally:
            await asgi_store.aclose()

    asgi = asyncio.run(asgi_replay())
    assert asgi.status == again.code and asgi.body == again.body
    assert asgi.headers == [(n.encode("latin-1"), v.encode("latin-1")) for n, v in again.headers]
    for s in (store, plain):
        loop_thread().run(s.aclose())


def test_what_memory_no_longer_holds_or_does_not_match_takes_the_bridged_path(
    redis_server: Server,
) -> None:
    """Another body under the key: 422 as before, the replay still from memory after; the
    key deleted by another client: never answered from memory once the server's
    invalidation has arrived (the key is run again)."""
    store, seen, app = cached_store(redis_server), Seen(), App()
    mw = IdempotencyMiddleware(app, store=store, on_event=seen)
    call(mw, "POST", "/pay", b'{"n": 1}', key="k")
    reused = call(mw, "POST", "/pay", b'{"n": 2}', key="k")
    assert reused.code == 422 and reused.header("Content-Type") == PROBLEM
    assert seen.events[-1][0] == "mismatch" and seen.events[-1][1] is not threading.current_thread()
    assert call(mw, "POST", "/pay", b'{"n": 1}', key="k").json()["run"] == 1
    assert seen.events[-1] == ("replayed", threading.current_thread())
    names = key_names(b"idem", b"", b"k")
    assert mw.door.memory is not None and mw.door.memory._kept(names.result) is not None
    with redis_server.sync_client() as client:
        client.delete(names.result, names.claim)
    until_sync(
        lambda: mw.door.memory._kept(names.result) is None,  # type: ignore[union-attr]
        what="the invalidation",
        every=0.001,
    )
    assert call(mw, "POST", "/pay", b'{"n": 1}', key="k").json()["run"] == 2
    assert app.runs == 2 and seen.events[-1][0] == "claimed" and mw.counters.replayed == 1
    loop_thread().run(store.aclose())
