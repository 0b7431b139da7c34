"""The sync integrations under real servers: a Flask app under gunicorn's sync workers (on
redis-server, script mode), the Django project under gunicorn's gthread workers (on
valkey-server with the native module) and under uvicorn (ASGI, on redis-server with the
module), a Flask app on the MemoryStore in one gunicorn process, and ``gunicorn --preload``.
One server per kind serves the whole module; every handler counts its runs in the store's
server (tests.support.apps.counting), and the lease is one second."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from goblin_idem._keys import key_names
from tests.store.test_replay_cache import commands_served
from tests.support.apps.wsgi_app import RELAY_TOKEN
from tests.support.procs import spawn, start_uvicorn, stop, uvicorn_args, wait_http
from tests.support.servers import Server, free_port
from tests.support.waits import until_sync
from tests.support.wsgi import Gunicorn, run_until_exit

FLASK = "tests.support.apps.flask_app:app"
PLAIN_WSGI = "tests.support.apps.wsgi_app:app"
DJANGO_WSGI = "tests.support.apps.django_site.wsgi:application"
DJANGO_ASGI = "tests.support.apps.django_site.asgi:application"
LEASE = {"LEASE_SECONDS": "1"}


@dataclass
class Served:
    """A server of the test apps, and the store's server that counts their runs."""

    name: str
    url: str
    store: Server | None

    def runs(self, key: str) -> int:
        assert self.store is not None
        with self.store.sync_client() as client:
            return int(client.get(f"runs:{key}") or 0)

    def worker_of(self, key: str) -> int:
        assert self.store is not None
        with self.store.sync_client() as client:
            return int(client.get(f"pid:{key}") or 0)


@pytest.fixture(scope="module")
def flask_sync(redis_server: Server) -> Iterator[Served]:
    env = {"REDIS_URL": redis_server.url, **LEASE}
    server = Gunicorn(FLASK, free_port(), env, worker_class="sync", workers=2).wait_ready()
    yield Served("flask, gunicorn sync", server.url, redis_server)
    server.stop()


@pytest.fixture(scope="module")
def django_gthread(valkey_native_server: Server) -> Iterator[Served]:
    env = {"REDIS_URL": valkey_native_server.url, **LEASE}
    server = Gunicorn(DJANGO_WSGI, free_port(), env, worker_class="gthread", threads=4)
    yield Served("django, gunicorn gthread", server.wait_ready().url, valkey_native_server)
    server.stop()


@pytest.fixture(scope="module")
def django_uvicorn(redis_native_server: Server) -> Iterator[Served]:
    env = {"REDIS_URL": redis_native_server.url, **LEASE}
    port = free_port()
    proc = start_uvicorn(port, env, app=DJANGO_ASGI)
    yield Served("django, uvicorn", f"http://127.0.0.1:{port}", redis_native_server)
    stop(proc)


@pytest.fixture(scope="module")
def plain_wsgi(redis_server: Server) -> Iterator[Served]:
    env = {"REDIS_URL": redis_server.url, **LEASE}
    server = Gunicorn(PLAIN_WSGI, free_port(), env, worker_class="sync", workers=2).wait_ready()
    yield Served("wsgi, gunicorn sync", server.url, redis_server)
    server.stop()


@pytest.fixture(scope="module")
def flask_cached(redis_server: Server) -> Iterator[Served]:
    """Flask with a replay cache, one gthread process, on flask_sync's store."""
    env = {"REDIS_URL": redis_server.url, "REPLAY_CACHE_BYTES": str(4 << 20), **LEASE}
    server = Gunicorn(FLASK, free_port(), env, worker_class="gthread", workers=1, threads=4)
    yield Served("flask, gunicorn gthread, replay cache", server.wait_ready().url, redis_server)
    server.stop()


@pytest.fixture(scope="module")
def django_cached(valkey_native_server: Server) -> Iterator[Served]:
    """Django with a replay cache, one gthread process, on django_gthread's store."""
    env = {"REDIS_URL": valkey_native_server.url, "REPLAY_CACHE_BYTES": str(4 << 20), **LEASE}
    server = Gunicorn(DJANGO_WSGI, free_port(), env, worker_class="gthread", workers=1, threads=4)
    yield Served(
        "django, gunicorn gthread, replay cache", server.wait_ready().url, valkey_native_server
    )
    server.stop()


@pytest.fixture(params=["flask_sync", "django_gthread", "django_uvicorn"])
def served(request: pytest.FixtureRequest) -> Served:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def post(
    url: str, path: str, key: str | None, body: bytes = b'{"amount": 5}', work_ms: int = 0
) -> httpx.Response:
    """POST `body`; the handler works for `work_ms` (a header the key does not cover)."""
    headers = {"Content-Type": "application/json", "Work-Ms": str(work_ms)}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


def test_concurrent_duplicates_across_workers_run_once(served: Served) -> None:
    key = uuid.uuid4().hex
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda _: post(served.url, "/work", key, work_ms=300), range(12)))
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) <= {201, 409}, statuses
    ran = [r for r in replies if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(ran) == 1 and served.runs(key) == 1
    for busy in (r for r in replies if r.status_code == 409):
        assert busy.headers["content-type"] == "application/problem+json"
        assert busy.headers["retry-after"] == "1"
    replayed = post(served.url, "/work", key)
    assert replayed.content == ran[0].content and replayed.headers["idempotent-replayed"] == "true"


def send_cut(url: str, path: str, key: str, head: str, body: bytes) -> bytes:
    """A request whose body stops short (`head` says what it promised, and may name its key
    in another header than Idempotency-Key), the client's half of the connection then
    shut: what the server answered before closing its own half."""
    host, port = url.removeprefix("http://").split(":")
    if "\r\n" not in key:
        key = f"Idempotency-Key: {key}\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{key}"
            f"Content-Type: application/x-www-form-urlencoded\r\n{head}\r\n".encode()
            + body
        )
        sock.shutdown(socket.SHUT_WR)  # the client is done; its reply, if any, follows
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes: the request has ended
            answer += chunk
        return answer


FORM = b"name=" + b"x" * 4995  # 5,000 bytes


@pytest.mark.parametrize(
    ("head", "cut"),
    [
        ("Content-Length: 5000\r\n", FORM[:1000]),
        ("Transfer-Encoding: chunked\r\n", b"3e8\r\n" + FORM[:1000] + b"\r\n"),
    ],
    ids=["content-length", "chunked"],
)
@pytest.mark.parametrize(
    ("app", "path"),
    [("plain_wsgi", "/work"), ("flask_sync", "/work"), ("django_gthread", "/form")],
    ids=["wsgi", "flask", "django"],
)
def test_a_body_cut_short_runs_nothing_and_the_retry_runs(
    request: pytest.FixtureRequest, app: str, path: str, head: str, cut: bytes
) -> None:
    """gunicorn hands the app what arrived before the client left (a short wsgi.input, or
    an error for a chunked body): nothing runs, nothing is stored, the key stays free."""
    served: Served = request.getfixturevalue(app)
    key = uuid.uuid4().hex
    answer = send_cut(served.url, path, key, head, cut)
    assert not answer.startswith(b"HTTP/1.1 201"), answer[:200]
    assert served.runs(key) == 0
    headers = {"Content-Type": "application/x-www-form-urlencoded", "Idempotency-Key": key}
    full = httpx.post(served.url + path, content=FORM, headers=headers, timeout=30)
    assert full.status_code == 201, full.text
    assert "idempotent-replayed" not in full.headers and served.runs(key) == 1


@pytest.mark.parametrize(
    ("head", "cut"),
    [
        ("Content-Length: 5000\r\n", FORM[:1000]),
        ("Transfer-Encoding: chunked\r\n", b"3e8\r\n" + FORM[:1000] + b"\r\n"),
    ],
    ids=["content-length", "chunked"],
)
def test_a_streamed_body_cut_short_runs_nothing_and_the_retry_runs(
    plain_wsgi: Served, head: str, cut: bytes
) -> None:
    """A delivery keyed by its provider (no Idempotency-Key) has its body streamed to the
    middleware, a chunk per read, not read whole up front: cut short, it is still a client
    gone. The provider trusts a header and covers no body, so no signature check stops a
    short body that the reading took for a whole one: it would run, its 1,000 bytes stored
    under the key, and the full retry would be replayed that answer."""
    event = uuid.uuid4().hex
    relay = f"X-Relay-Id: {event}\r\nX-Relay-Token: {RELAY_TOKEN}\r\n"
    answer = send_cut(plain_wsgi.url, "/relay", relay, head, cut)
    assert not answer.startswith(b"HTTP/1.1 201"), answer[:200]
    assert plain_wsgi.runs(event) == 0
    headers = {"X-Relay-Id": event, "X-Relay-Token": RELAY_TOKEN}
    full = httpx.post(plain_wsgi.url + "/relay", content=FORM, headers=headers, timeout=30)
    assert full.status_code == 201 and full.json() == {"run": 1, "read": len(FORM)}
    assert "idempotent-replayed" not in full.headers and plain_wsgi.runs(event) == 1


def test_a_flask_app_configured_by_its_config_and_init_app(redis_server: Server) -> None:
    """Options from app.config (GOBLIN_IDEM_STORE, _HEADER, _REQUIRED) and from init_app's
    arguments; the 400 names the configured header, not the default one."""
    env = {"REDIS_URL": redis_server.url}
    app = "tests.support.apps.flask_app:configured"
    server = Gunicorn(app, free_port(), env, workers=1).wait_ready()
    try:
        refused = httpx.post(server.url + "/work", json={}, timeout=30)
        key = {"X-Request-Key": uuid.uuid4().hex}
        first = httpx.post(server.url + "/work", json={}, headers=key, timeout=30)
        again = httpx.post(server.url + "/work", json={}, headers=key, timeout=30)
    finally:
        server.stop()
    assert refused.status_code == 400
    assert refused.json()["title"] == "An X-Request-Key header is required"
    assert refused.json()["detail"] == "X-Request-Key is required for POST /work."
    assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json() == {"run": 1}


def test_rest_framework_s_own_vary_is_not_warned_about(redis_server: Server) -> None:
    """DRF adds ``Vary: Accept`` to its responses: no order of middleware changes that, so
    the WARNING about reordering GZip or CORS is not logged for it."""
    env = {"REDIS_URL": redis_server.url}
    server = Gunicorn(DJANGO_WSGI, free_port(), env, worker_class="gthread", workers=1)
    try:
        server.wait_ready()
        reply = post(server.url, "/api/payments", uuid.uuid4().hex)
        server.proc.send_signal(signal.SIGINT)  # gunicorn's quick shutdown: then its log
        log = server.proc.communicate(timeout=30)[1].decode(errors="replace")
    finally:
        server.stop()
    assert reply.status_code == 201 and reply.headers["vary"] == "Accept"
    assert "(its Vary header)" not in log and "GZipMiddleware" not in log, log


def test_a_handler_three_leases_long_runs_once(flask_sync: Served) -> None:
    """The lease renewed on the loop thread while the request's thread runs the handler."""
    served, key = flask_sync, uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        first = pool.submit(post, served.url, "/work", key, work_ms=3200)
        until_sync(lambda: served.runs(key) == 1, what="the first run started")
        duplicates = []  # (seconds since the first was sent, status), while it runs
        while not first.done():
            status = post(served.url, "/work", key).status_code
            duplicates.append((time.monotonic() - started, status))
            time.sleep(0.4)
        assert first.result().status_code == 201
    statuses = [status for _, status in duplicates[:-1]]  # the last may come after the end
    assert statuses and set(statuses) == {409}, duplicates
    # Still held past two leases (a slow machine sends fewer duplicates, never none late):
    assert any(when > 2.2 and status == 409 for when, status in duplicates), duplicates
    assert served.runs(key) == 1


def test_a_worker_killed_mid_handler_frees_the_key_after_its_lease(
    django_gthread: Served,
) -> None:
    served, key = django_gthread, uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        cut = pool.submit(post, served.url, "/work", key, work_ms=30_000)
        until_sync(lambda: served.worker_of(key), 10, "the handler started")
        os.kill(served.worker_of(key), signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            cut.result()
    assert post(served.url, "/work", key).status_code == 409  # its lease still holds it
    time.sleep(1.2)  # the lease runs out (gunicorn meanwhile starts another worker)
    again = post(served.url, "/work", key)
    assert again.status_code == 201 and again.json()["run"] == 2
    assert post(served.url, "/work", key).headers["idempotent-replayed"] == "true"
    assert served.runs(key) == 2


@pytest.mark.parametrize("name", ["django_gthread", "django_uvicorn"])
def test_rest_framework_marks_under_a_server(request: pytest.FixtureRequest, name: str) -> None:
    served: Served = request.getfixturevalue(name)
    key = uuid.uuid4().hex
    assert post(served.url, "/api/payments", None).status_code == 400
    assert post(served.url, "/api/orders/3/refund/", None).status_code == 400
    first = post(served.url, "/api/payments", key)
    again = post(served.url, "/api/payments", key)
    assert first.status_code == 201 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true" and served.runs(key) == 1


def test_a_memory_store_in_one_gthread_process() -> None:
    server = Gunicorn(FLASK, free_port(), {}, worker_class="gthread", workers=1, threads=8)
    try:
        server.wait_ready()
        key = uuid.uuid4().hex
        with ThreadPoolExecutor(8) as pool:
            replies = list(
                pool.map(lambda _: post(server.url, "/work", key, work_ms=300), range(8))
            )
        ran = [
            r for r in replies if r.status_code == 201 and "idempotent-replayed" not in r.headers
        ]
        assert len(ran) == 1 and ran[0].json()["run"] == 1
        assert {r.status_code for r in replies} <= {201, 409}
    finally:
        server.stop()


def test_gunicorn_preload_workers_start_their_own_loop_thread(redis_server: Server) -> None:
    """The app (and its store's check, on the loop thread) made in the master, then two
    forked workers: each serves keyed requests on connections of its own."""
    with redis_server.sync_client() as client:
        client.flushall()
    env = {"REDIS_URL": redis_server.url}
    server = Gunicorn(FLASK, free_port(), env, workers=2, preload=True).wait_ready()
    try:
        pids: set[int] = set()
        keys = [uuid.uuid4().hex for _ in range(16)]
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda k: post(server.url, "/work", k, work_ms=50), keys))
        assert [r.status_code for r in replies] == [201] * 16
        pids = {r.json()["pid"] for r in replies}
        assert len(pids) == 2, pids  # both workers answered keyed requests
        assert post(server.url, "/work", keys[0]).headers["idempotent-replayed"] == "true"
    finally:
        server.stop()


@pytest.mark.parametrize("preload", [False, True], ids=["boot", "preload"])
def test_a_misconfiguration_stops_gunicorn(preload: bool) -> None:
    """Django loads its middleware when the app is imported: in each worker (which fails
    to boot, and gunicorn stops) or, with --preload, in the master (which exits)."""
    env = {"GOBLIN_SETTINGS": '{"LEASE_SECONDS": 0}'}
    server = Gunicorn(DJANGO_WSGI, free_port(), env, workers=1, preload=preload)
    try:
        with pytest.raises(RuntimeError, match=r"GOBLIN_IDEM\['LEASE_SECONDS'\]"):
            server.wait_ready(timeout=20)
    finally:
        server.stop()


@pytest.mark.parametrize("preload", [False, True], ids=["boot", "preload"])
def test_a_flask_misconfiguration_stops_gunicorn_naming_its_config_key(preload: bool) -> None:
    env = {"FLASK_CONFIG": '{"GOBLIN_IDEM_TTL_SECONDS": 0}'}
    app = "tests.support.apps.flask_app:configured"
    server = Gunicorn(app, free_port(), env, workers=1, preload=preload)
    try:
        with pytest.raises(
            RuntimeError, match=r"app.config\['GOBLIN_IDEM_TTL_SECONDS'\]: ttl_seconds must be"
        ):
            server.wait_ready(timeout=60)  # exits at once; a loaded machine boots slowly
    finally:
        server.stop()


def test_gunicorn_s_gevent_workers_are_refused_at_boot_naming_the_worker_class() -> None:
    """gevent's workers make the loop thread a greenlet that never yields: every request of
    the worker, GET /health included, hung without a word. Now the worker fails to boot
    and gunicorn stops, saying which worker to use."""
    server = Gunicorn(FLASK, free_port(), {}, worker_class="gevent", workers=1)
    try:
        with pytest.raises(
            RuntimeError, match=r"under gunicorn's gevent worker \(-k gevent\).*gthread"
        ):
            server.wait_ready(timeout=60)  # exits at once; a loaded machine boots slowly
    finally:
        server.stop()


def test_eventlet_s_green_threads_are_refused_when_the_middleware_is_made() -> None:
    """eventlet (gunicorn 27 has no eventlet worker; its monkey-patching alone) hung the
    middleware's store check, on the loop "thread", for good."""
    code = "import eventlet; eventlet.monkey_patch()\nfrom tests.support.apps import wsgi_app"
    status, said = run_until_exit(["-c", code], {}, timeout=60)
    assert status == 1
    assert "under eventlet's monkey-patching of threading" in said and "gthread" in said, said


def test_an_unreachable_store_stops_uvicorn_serving_django() -> None:
    port = free_port()
    env = {"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    proc = spawn(uvicorn_args(DJANGO_ASGI, port), env)
    try:
        with pytest.raises(RuntimeError, match="cannot use the Redis at"):
            wait_http(proc, port, timeout=20)
    finally:
        stop(proc)


def exchange(url: str, key: str, body: bytes = b'{"amount": 5}') -> tuple[Any, ...]:
    """POST /work as answered on the wire: status, reason, every header (in order, as
    sent) but Date, and the body."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        conn.request("POST", "/work", body=body, headers=headers)
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    kept = [(n, v) for n, v in reply.getheaders() if n.lower() != "date"]
    return reply.status, reply.reason, kept, data


def named(answer: tuple[Any, ...]) -> dict[str, str]:
    return {name.lower(): value for name, value in answer[2]}


@pytest.mark.parametrize(
    ("cached", "other"), [("flask_cached", "flask_sync"), ("django_cached", "django_gthread")]
)
def test_a_replay_from_memory_under_gunicorn_sends_no_command_and_the_same_bytes(
    request: pytest.FixtureRequest, cached: str, other: str
) -> None:
    """A key run by another process: its first duplicate here is read from the store (and
    kept), the next ones are answered from memory with no command sent, byte for byte the
    same; another body under the key is 422; deleted by another client, the key runs
    again."""
    memory: Served = request.getfixturevalue(cached)
    elsewhere: Served = request.getfixturevalue(other)
    assert memory.store is not None
    key = uuid.uuid4().hex
    assert exchange(elsewhere.url, key)[0] == 201
    from_store = exchange(memory.url, key)
    assert from_store[0] == 201 and named(from_store)["idempotent-replayed"] == "true"
    sent = []

    def answered_from_memory() -> bool:
        before = commands_served(memory.store)
        assert exchange(memory.url, key) == from_store
        sent.append(commands_served(memory.store) - before)
        return sent[-1] == 0

    # the store's read is kept once its tracked read is answered
    until_sync(answered_from_memory, what="a replay sent no command", every=0.05)
    assert sent[-1] == 0, sent
    reused = exchange(memory.url, key, b'{"amount": 6}')
    assert reused[0] == 422 and named(reused)["content-type"] == "application/problem+json"
    assert exchange(memory.url, key) == from_store and memory.runs(key) == 1
    names = key_names(b"idem", b"", key.encode())
    with memory.store.sync_client() as client:
        client.delete(names.result, names.claim)
    time.sleep(0.5)  # the server's invalidation reaches the worker's loop thread at once
    again = exchange(memory.url, key)
    assert again[0] == 201 and "idempotent-replayed" not in named(again)
    assert memory.runs(key) == 2
