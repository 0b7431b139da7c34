"""`python -m goblin_idem inspect`: a key's state, through the functions and the command."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore, Store, once
from goblin_idem._keys import key_names
from goblin_idem.inspection import (
    COMPLETED,
    FREE,
    IN_FLIGHT,
    NOT_REPLAYABLE,
    SCOPE_HINT,
    UNREADABLE,
    format_state,
    inspect_key,
    names_for_hash,
)
from goblin_idem.sealing import Sealer, key_id
from tests.support.servers import Server, free_port

ROOT = Path(__file__).resolve().parent.parent


async def create(request: Request) -> Response:
    size = int(request.query_params.get("size", "10"))
    return JSONResponse(
        {"pad": "x" * size}, status_code=201, headers={"Location": "/things/1", "X-Trace": "t1"}
    )


def protected(store: Store, **options: int) -> IdempotencyMiddleware:
    app = Starlette(routes=[Route("/things", create, methods=["POST"])])
    return IdempotencyMiddleware(app, store=store, **options)  # type: ignore[arg-type]


async def post(
    app: IdempotencyMiddleware, key: str, size: int = 10, **headers: str
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        return await c.post(f"/things?size={size}", headers={"Idempotency-Key": key, **headers})


# -- the functions, on the MemoryStore -----------------------------------------------------------


async def test_free() -> None:
    state = await inspect_key(MemoryStore(), "k-free")
    assert state.state == FREE
    assert state.token is None and state.record is None and state.note == SCOPE_HINT
    names = key_names(b"idem", b"", b"k-free")
    assert state.names == names
    text = format_state(state)
    assert text.splitlines()[0] == f"key hash    {names.hash}"
    raw = bytes.fromhex(names.hash).replace(b"}", b"~")
    assert f"claim key   {repr(b'idem:{' + raw + b'}:c')[2:-1]}" in text
    assert "state       free" in text
    assert "owner" not in text


async def test_in_flight() -> None:
    store = MemoryStore()
    names = key_names(b"idem", b"", b"k-busy")
    await store.claim(names.claim, names.result, b"4242:feedbeef", 30)
    state = await inspect_key(store, "k-busy")
    assert state.state == IN_FLIGHT
    assert state.token == b"4242:feedbeef"
    assert state.claim_ttl_ms is not None and 29_000 < state.claim_ttl_ms <= 30_000
    text = format_state(state)
    assert "state        in flight" in text
    assert "owner token  4242:feedbeef" in text
    assert "lease        " in text and " ms left (" in text and "status" not in text


async def test_in_flight_while_the_middleware_runs() -> None:
    """A real request in progress: the claim holds the middleware's token (12 characters,
    base64url)."""
    store = MemoryStore()
    entered, leave = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        entered.set()
        await leave.wait()
        return JSONResponse({}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/slow", slow, methods=["POST"])]), store=store, lease_seconds=5
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        task = asyncio.ensure_future(c.post("/slow", headers={"Idempotency-Key": "k-run"}))
        await entered.wait()
        state = await inspect_key(store, "k-run")
        leave.set()
        assert (await task).status_code == 201
    assert state.state == IN_FLIGHT
    assert state.token is not None and re.fullmatch(rb"[A-Za-z0-9_-]{12}", state.token)
    assert state.claim_ttl_ms is not None and 4_000 < state.claim_ttl_ms <= 5_000
    assert (await inspect_key(store, "k-run")).state == COMPLETED


async def test_completed() -> None:
    store = MemoryStore()
    app = protected(store, ttl_seconds=600)
    response = await post(app, "k-done")
    assert response.status_code == 201
    state = await inspect_key(store, "k-done")
    assert state.state == COMPLETED
    rec = state.record
    assert rec is not None and rec.replayable
    assert rec.status == 201
    assert rec.body == response.content
    assert (b"location", b"/things/1") in rec.headers
    assert state.result_ttl_ms is not None and 599_000 < state.result_ttl_ms <= 600_000
    assert state.claim_ttl_ms is not None and 599_000 < state.claim_ttl_ms <= 600_000
    text = format_state(state)
    assert "state        completed" in text
    assert "status       201" in text
    assert "headers      location: /things/1\n" in text
    assert "             x-trace: t1\n" in text
    assert f"             content-length: {len(response.content)}\n" in text
    assert f"body         {len(response.content)} bytes" in text
    claim_line = re.search(r"^claim +(\d+) ms left \((\d+) s\)$", text, re.M)
    result_line = re.search(r"^result +(\d+) ms left \((\d+) s\), (\d+) bytes$", text, re.M)
    assert claim_line is not None and result_line is not None, text
    for line, ttl_ms in ((claim_line, state.claim_ttl_ms), (result_line, state.result_ttl_ms)):
        assert int(line[1]) == ttl_ms and abs(int(line[2]) * 1000 - ttl_ms) <= 500, line[0]
    assert int(result_line[3]) == state.result_bytes


async def test_completed_not_replayable() -> None:
    store = MemoryStore()
    app = protected(store, max_response_bytes=100)
    assert (await post(app, "k-big", size=500)).status_code == 201
    duplicate = await post(app, "k-big", size=500)
    assert duplicate.status_code == 409 and "retry-after" not in duplicate.headers
    state = await inspect_key(store, "k-big")
    assert state.state == NOT_REPLAYABLE
    assert state.record is not None and state.record.status == 201
    text = format_state(state)
    assert "state        completed, not replayable" in text
    assert "duplicates get 409 not-replayable" in text
    assert "headers" not in text and "body " not in text


async def test_scope_and_namespace_change_the_key() -> None:
    store = MemoryStore()
    app = protected(store)
    assert (await post(app, "k-s", Authorization="Bearer alice")).status_code == 201
    assert (await inspect_key(store, "k-s")).state == FREE
    assert (await inspect_key(store, "k-s", scope="Bearer alice")).state == COMPLETED
    assert (await inspect_key(store, "k-s", scope="Bearer alice", namespace="x")).state == FREE


async def test_by_hash_unreadable_and_orphaned_results() -> None:
    store = MemoryStore()
    names = key_names(b"idem", b"", b"k-odd")
    assert names_for_hash(names.hash) == names
    with pytest.raises(ValueError):
        names_for_hash("not-a-hash")

    await store.set(names.claim, b"1:ab", ex=60)
    await store.set(names.result, b"garbage", ex=60)
    state = await inspect_key(store, names=names)
    assert state.state == UNREADABLE
    assert state.error is not None and "record" in state.error
    assert "503" in format_state(state)

    await store.delete(names.claim)
    state = await inspect_key(store, "k-odd")
    assert state.state == FREE and state.result_bytes == len(b"garbage")
    assert "answered from the result" in format_state(state)


async def test_a_once_value_is_completed_not_an_unreadable_record() -> None:
    """A `once` function's key holds its return value, not an HTTP record: completed, with
    the value's size; a sealed one opens with the keys that sealed it, and only with them."""
    store, secret = MemoryStore(), os.urandom(32)

    @once(store, key=lambda event: event, name="jobs.charge")
    async def charge(event: str) -> dict[str, str]:
        return {"charge": "ch_1", "event": event}

    @once(store, key=lambda event: event, name="jobs.sealed", encryption_keys=[secret])
    async def sealed(event: str) -> dict[str, str]:
        return {"charge": "ch_2"}

    await charge("evt-1")
    await sealed("evt-2")

    state = await inspect_key(store, "evt-1", scope="jobs.charge", namespace="once")
    assert state.state == COMPLETED and state.error is None and state.record is None
    assert state.value_bytes == len(b'{"charge":"ch_1","event":"evt-1"}')
    assert state.format is not None and not state.format.sealed and state.opens is None
    text = format_state(state)
    assert f"value        {state.value_bytes} bytes" in text and "ch_1" not in text

    unopened = await inspect_key(store, "evt-2", scope="jobs.sealed", namespace="once")
    assert unopened.state == UNREADABLE and unopened.opens is False
    assert unopened.format is not None and unopened.format.key_id == key_id(secret)
    assert unopened.note is not None and "$GOBLIN_IDEM_ENCRYPTION_KEYS" in unopened.note
    opened = await inspect_key(
        store, "evt-2", scope="jobs.sealed", namespace="once", sealer=Sealer([secret])
    )
    assert opened.state == COMPLETED and opened.opens is True
    assert opened.value_bytes == len(b'{"charge":"ch_2"}')
    wrong = await inspect_key(
        store, "evt-2", scope="jobs.sealed", namespace="once", sealer=Sealer([os.urandom(32)])
    )
    assert wrong.state == UNREADABLE and wrong.error is not None and "key id" in wrong.error


# -- the command, on a real redis-server -------------------------------------------------------


@pytest.fixture
async def redis_store(redis_server: Server) -> AsyncIterator[RedisStore]:
    with redis_server.sync_client() as r:
        r.flushall()
    store = RedisStore.from_url(redis_server.url)
    yield store
    await store.aclose()


def cli(
    *args: str, env: dict[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "goblin_idem", "inspect", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        input=stdin,
        env={k: v for k, v in os.environ.items() if k != "GOBLIN_SCOPE"} | (env or {}),
        timeout=30,
    )


async def test_cli_states_on_redis(redis_server: Server, redis_store: RedisStore) -> None:
    url = redis_server.url
    app = protected(redis_store, max_response_bytes=100)
    done = await post(app, "k-done")
    assert done.status_code == 201
    assert (await post(app, "k-big", size=500)).status_code == 201
    busy = key_names(b"idem", b"", b"k-busy")
    await redis_store.claim(busy.claim, busy.result, b"777:cafe", 30)

    free = cli("--url", url, "k-free")
    assert free.returncode == 0, free.stderr
    assert "state       free" in free.stdout

    flight = cli("--url", url, "k-busy")
    assert flight.returncode == 0, flight.stderr
    assert "state        in flight" in flight.stdout
    assert "owner token  777:cafe" in flight.stdout

    completed = cli("--url", url, "k-done")
    assert completed.returncode == 0, completed.stderr
    assert "state        completed\n" in completed.stdout
    assert f"body         {len(done.content)} bytes" in completed.stdout
    assert "location: /things/1" in completed.stdout

    big = cli("--url", url, "k-big")
    assert big.returncode == 0, big.stderr
    assert "state        completed, not replayable" in big.stdout

    as_json = cli("--url", url, "--hash", busy.hash, "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["state"] == "in flight" and doc["token"] == "777:cafe"
    assert doc["claim_key"] == busy.claim.decode("latin-1")
    assert 0 < doc["claim_ttl_ms"] <= 30_000

    @once(redis_store, key=lambda event: event, name="jobs.charge")
    async def charge(event: str) -> dict[str, str]:
        return {"charge": "ch_1"}

    await charge("evt-1")
    value = cli("--url", url, "evt-1", "--namespace", "once", "--scope", "jobs.charge")
    assert value.returncode == 0, value.stderr
    assert "state        completed\n" in value.stdout
    assert "value        17 bytes" in value.stdout  # {"charge":"ch_1"}

    assert cli("--url", url).returncode == 2  # neither KEY nor --hash
    down = cli("--url", f"redis://127.0.0.1:{free_port()}/0", "k")
    assert down.returncode == 1 and "could not read the store" in down.stderr


async def test_cli_scope_hint_and_secret_free_ways_to_give_it(
    redis_server: Server, redis_store: RedisStore
) -> None:
    """A key sent with Authorization is keyed by it: the unscoped lookup says so, and the
    scope can be given without putting the secret on the command line."""
    url = redis_server.url
    app = protected(redis_store)
    assert (await post(app, "k-auth", Authorization="Bearer sk_live_1")).status_code == 201

    unscoped = cli("--url", url, "k-auth")
    assert unscoped.returncode == 0, unscoped.stderr
    assert "state       free" in unscoped.stdout
    assert "Authorization" in unscoped.stdout and "$GOBLIN_SCOPE" in unscoped.stdout
    assert "--scope -" in unscoped.stdout and "--hash" in unscoped.stdout

    from_env = cli("--url", url, "k-auth", env={"GOBLIN_SCOPE": "Bearer sk_live_1"})
    assert from_env.returncode == 0, from_env.stderr
    assert "state        completed\n" in from_env.stdout and "note" not in from_env.stdout

    from_stdin = cli("--url", url, "k-auth", "--scope", "-", stdin="Bearer sk_live_1\n")
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert "state        completed\n" in from_stdin.stdout
    assert "sk_live_1" not in from_stdin.stdout + from_env.stdout  # never echoed

    done = cli("--url", url, "k-done-elsewhere", "--scope", "Bearer someone")
    assert "state       free" in done.stdout and "note" not in done.stdout  # scope given


def test_cli_names_the_store_it_could_not_reach() -> None:
    port = free_port()
    down = cli("--url", f"redis://127.0.0.1:{port}/0", "k")
    assert down.returncode == 1
    assert f"could not read the store at 127.0.0.1:{port}: ConnectionError: " in down.stderr
    assert "Connection refused" in down.stderr


async def test_cli_require_sealed_shows_a_record_in_the_clear_as_answered(
    redis_server: Server, redis_store: RedisStore
) -> None:
    assert (await post(protected(redis_store), "k-plain")).status_code == 201
    plain = cli("--url", redis_server.url, "k-plain")
    assert "state        completed\n" in plain.stdout and "format       version 1\n" in plain.stdout
    strict = cli("--url", redis_server.url, "k-plain", "--require-sealed")
    assert strict.returncode == 0, strict.stderr
    assert "state        completed, unreadable\n" in strict.stdout
    assert "written in the clear (format version 1)" in strict.stdout
    assert "answers requests with this key with 503" in strict.stdout

    @once(redis_store, key=lambda event: event, name="jobs.plain")
    async def charge(event: str) -> dict[str, str]:
        return {"charge": "ch_1"}

    await charge("evt-1")
    value = cli("--url", redis_server.url, "evt-1", "--namespace", "once", "--scope", "jobs.plain")
    assert "state        completed\n" in value.stdout
    args = ("--namespace", "once", "--scope", "jobs.plain", "--require-sealed")
    refused = cli("--url", redis_server.url, "evt-1", *args)
    assert "state        completed, unreadable\n" in refused.stdout
    assert "in the clear, and require_sealed=True refuses" in refused.stdout
