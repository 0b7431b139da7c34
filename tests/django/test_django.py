"""goblin_idem.django.IdempotencyMiddleware in process, through Django's test clients: the
sync path (as under WSGI) and the async path (as under ASGI), route marks found with
Django's resolver (function views, class-based views, REST framework views and viewset
actions), and every misconfiguration refused with ImproperlyConfigured. Under gunicorn
and uvicorn: tests/wsgi/test_servers.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, override_settings
from django.urls import path
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from goblin_idem import MemoryStore, RedisStore
from goblin_idem._keys import key_names
from goblin_idem._threads._loop import loop_thread
from goblin_idem.django import IdempotencyMiddleware
from goblin_idem.records._format import decode, encode
from goblin_idem.sql import SqlRecords, connection
from goblin_idem.store._autopipeline import AutoPipeline
from tests.store.test_replay_cache import commands_served
from tests.support.servers import Server
from tests.support.waits import until, until_sync
from tests.support.wsgi import run_until_exit

JSON = "application/json"


def key() -> str:
    return uuid.uuid4().hex  # the project's MemoryStore lives as long as the process


def post(client: Client, path: str, idem: str | None = None, body: bytes = b"{}") -> Any:
    headers = {"Idempotency-Key": idem} if idem else {}
    return client.post(path, data=body, content_type=JSON, headers=headers)


def test_a_view_runs_once_per_key_replays_and_refuses_another_body() -> None:
    client, k = Client(), key()
    first = post(client, "/work", k, b'{"n": 1}')
    again = post(client, "/work", k, b'{"n": 1}')
    assert first.status_code == 201 and first.json()["run"] == 1
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    reused = post(client, "/work", k, b'{"n": 2}')
    assert reused.status_code == 422 and reused["Content-Type"] == "application/problem+json"


@pytest.mark.parametrize("path", ["/required", "/marked", "/api/payments", "/api/orders/5/refund/"])
def test_marks_on_views_classes_methods_and_viewset_actions_require_a_key(path: str) -> None:
    client = Client()
    missing = post(client, path)
    assert missing.status_code == 400 and b"missing-key" in missing.content
    assert post(client, path, key()).status_code in (200, 201)


def test_unmarked_handlers_of_marked_views_are_not_required() -> None:
    client = Client()
    assert client.patch("/api/payments", data=b"{}", content_type=JSON).status_code == 200
    assert post(client, "/api/orders/").status_code == 201  # the viewset's create


def test_a_streamed_response_passes_through_and_is_replayed_whole() -> None:
    client, k = Client(), key()
    first = post(client, "/stream?kb=3", k)
    assert first.streaming and b"".join(first.streaming_content) == b"x" * 3072
    again = post(client, "/stream?kb=3", k)
    assert again.content == b"x" * 3072 and again["Idempotent-Replayed"] == "true"


def test_a_replay_keeps_every_cookie_and_the_view_reads_its_form() -> None:
    client, k = Client(), key()
    first = post(client, "/cookie", k)
    again = Client().post("/cookie", data=b"{}", content_type=JSON, headers={"Idempotency-Key": k})
    assert again["Idempotent-Replayed"] == "true"
    assert {n: c.value for n, c in again.cookies.items()} == {"session": "s1", "theme": "dark"}
    assert again.cookies["session"]["httponly"] and first.cookies["theme"]["samesite"] == "Lax"
    form = client.post("/form", data={"name": "ada"}, headers={"Idempotency-Key": key()})
    assert form.status_code == 201 and form.json() == {"name": "ada"}


def test_a_server_error_releases_the_key() -> None:
    client, k = Client(), key()
    assert post(client, "/fail", k).status_code == 503
    assert post(client, "/fail", k).status_code == 503  # run again: nothing was stored
    from tests.support.apps import counting

    assert counting.count(k) == 3


async def test_the_async_path_runs_once_replays_streams_and_finds_marks() -> None:
    client, k, s = AsyncClient(), key(), key()
    headers = {"Idempotency-Key": k}
    first = await client.post("/work", data=b"{}", content_type=JSON, headers=headers)
    again = await client.post("/work", data=b"{}", content_type=JSON, headers=headers)
    assert first.status_code == 201 and again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert (await client.post("/api/payments", data=b"{}", content_type=JSON)).status_code == 400
    streamed = await client.post(
        "/stream?kb=2", data=b"{}", content_type=JSON, headers={"Idempotency-Key": s}
    )
    assert b"".join([c async for c in streamed.streaming_content]) == b"x" * 2048
    replayed = await client.post(
        "/stream?kb=2", data=b"{}", content_type=JSON, headers={"Idempotency-Key": s}
    )
    assert replayed.content == b"x" * 2048 and replayed["Idempotent-Replayed"] == "true"


def test_a_scope_function_and_a_store_factory_by_dotted_path() -> None:
    views = "tests.support.apps.django_site.views"
    with override_settings(GOBLIN_IDEM={"STORE": f"{views}.store", "SCOPE": f"{views}.tenant"}):
        client, k = Client(), key()
        runs = [post_as(client, k, tenant).json()["run"] for tenant in ("t1", "t2", "t1", "t2")]
    assert runs == [1, 2, 1, 2]  # a key space per tenant; the second of each replayed


def post_as(client: Client, idem: str, tenant: str) -> Any:
    headers = {"Idempotency-Key": idem, "X-Tenant": tenant}
    return client.post("/work", data=b"{}", content_type=JSON, headers=headers)


def view(request: HttpRequest) -> HttpResponse:
    return HttpResponse()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (["STORE"], r"GOBLIN_IDEM must be a dict of options"),
        ({"LEASE": 3}, r"unknown option 'LEASE'; the options are .*LEASE_SECONDS"),
        ({"lease_seconds": 3}, r"unknown option 'lease_seconds'"),
        ({"LEASE_SECONDS": 0}, r"GOBLIN_IDEM\['LEASE_SECONDS'\]: lease_seconds must be >= 1"),
        ({"METHODS": "POST"}, r"GOBLIN_IDEM\['METHODS'\]: methods must be a list"),
        ({"STORE": "memcached://127.0.0.1"}, r"scheme 'memcached' names no store"),
        ({"STORE": "nowhere.store"}, r"GOBLIN_IDEM\['STORE'\]: cannot import 'nowhere.store'"),
        ({"STORE": "tests.support.apps.django_site.settings.SECRET_KEY"}, r"gave a str, not a"),
        ({"STORE": "tests.support.apps.django_site.views.health"}, r"of no arguments"),
        ({"SCOPE": "nowhere.scope"}, r"GOBLIN_IDEM\['SCOPE'\]: cannot import"),
        ({"KEY_PATTERN": "[unclosed"}, r"KEY_PATTERN'\] is not a valid regular expression"),
        ({"OUTCOME": [99]}, r"GOBLIN_IDEM\['OUTCOME'\]: outcome: 99 is not an HTTP status"),
        ({"OUTCOME": "nowhere.outcome"}, r"GOBLIN_IDEM\['OUTCOME'\]: cannot import"),
    ],
)
def test_every_misconfiguration_is_refused_when_django_loads_the_middleware(
    setting: object, message: str
) -> None:
    with override_settings(GOBLIN_IDEM=setting), pytest.raises(ImproperlyConfigured, match=message):
        IdempotencyMiddleware(view)


def test_records_a_wsgi_django_cannot_honour_are_refused_at_startup(tmp_path: Path) -> None:
    """Async SQL records under WSGI: no sync view can write through the run's transaction,
    and the ORM commits apart from it, so the record would cover nothing: refused, not
    silent, pointing to the records that commit with the ORM."""
    records = SqlRecords(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    with (
        override_settings(GOBLIN_IDEM={"STORE": "memory", "RECORDS": records}),
        pytest.raises(
            ImproperlyConfigured,
            match=r"\['RECORDS'\]: .* Set RECORDS to \"django\" .* or remove RECORDS",
        ),
    ):
        IdempotencyMiddleware(view)


def test_a_store_that_cannot_be_used_is_refused_at_startup(own_redis: Server) -> None:
    url = own_redis.url
    own_redis.stop()
    with (
        override_settings(GOBLIN_IDEM={"STORE": url}),
        pytest.raises(
            ImproperlyConfigured, match=r"\['STORE'\]: goblin-idem store: cannot use the Redis at"
        ),
    ):
        IdempotencyMiddleware(view)
    with override_settings(GOBLIN_IDEM={"STORE": url, "CHECK_STORE": False}):
        IdempotencyMiddleware(view)  # starts; its requests get 503 while the store is down


def test_marks_hold_for_a_fresh_process_s_first_request() -> None:
    """Django imports the URLconf (and the views' marks with it) at the first request,
    after the middleware has looked at it: the middleware loads it when it is made."""
    first_request = (
        "import django, sys; django.setup(); from django.test import Client; "
        "sys.exit(Client().post('/api/payments', data=b'{}', "
        "content_type='application/json').status_code)"
    )
    settings = {"DJANGO_SETTINGS_MODULE": "tests.support.apps.django_site.settings"}
    code, said = run_until_exit(["-c", first_request], settings)
    assert code == 400 % 256, said  # the exit status holds the HTTP status, modulo 256


def test_a_streamed_response_closed_unread_frees_its_key() -> None:
    """The server closes the response before reading its body (the client left): the
    view's stream is cut, and the key released for the retry."""
    client, k = Client(), key()
    post(client, "/stream?kb=4", k).close()
    again = post(client, "/stream?kb=4", k)
    assert "Idempotent-Replayed" not in again and b"".join(again.streaming_content) == b"x" * 4096


async def test_the_async_path_frees_the_key_of_a_stream_closed_unread() -> None:
    client, k = AsyncClient(), key()
    headers = {"Idempotency-Key": k}
    first = await client.post("/stream?kb=4", data=b"{}", content_type=JSON, headers=headers)
    first.close()
    replies = []

    async def freed() -> bool:  # once the middleware's task ends in the loop
        replies.append(
            await client.post("/stream?kb=4", data=b"{}", content_type=JSON, headers=headers)
        )
        return bool(replies[-1].status_code != 409)

    await until(freed, what="the key freed")
    again = replies[-1]
    assert again.status_code == 201 and "Idempotent-Replayed" not in again


async def pay_through_the_run(request: HttpRequest) -> HttpResponse:
    """An async view writing through the run's transaction (see the test below)."""
    conn = await connection()
    await conn.execute(text("INSERT INTO paid (ref) VALUES ('p')"))
    return HttpResponse(uuid.uuid4().hex, status=201)


urlpatterns = [path("pay", pay_through_the_run)]  # the URLconf of the test below


async def test_async_views_under_asgi_commit_with_sql_records(tmp_path: Path) -> None:
    """What the refusal under WSGI points to: under ASGI an async view's writes through
    ``await connection()`` commit with the record, and the database replays it once the
    store lost it."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    records = SqlRecords(url)
    await records.create_table()
    async with records.engine.begin() as conn:
        await conn.execute(text("CREATE TABLE paid (ref TEXT)"))
    store = MemoryStore()
    setting = {"STORE": store, "RECORDS": records}
    try:
        with override_settings(GOBLIN_IDEM=setting, ROOT_URLCONF=__name__):
            client, headers = AsyncClient(), {"Idempotency-Key": key()}
            first = await client.post("/pay", data=b"{}", content_type=JSON, headers=headers)
            assert first.status_code == 201
            await store.aclose()
            setting["STORE"] = MemoryStore()  # a store that lost everything
            again = await AsyncClient().post("/pay", data=b"{}", content_type=JSON, headers=headers)
        assert again.status_code == 201 and again.content == first.content
        assert again["Idempotent-Replayed"] == "true"
        async with records.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM paid"))).scalar_one() == 1
    finally:
        await records.aclose()


@pytest.mark.parametrize("provider", ["standard", "github"])  # a function view; a view's method
@pytest.mark.parametrize("path", ["sync", "async"])
async def test_a_webhook_view_runs_a_genuine_delivery_once_after_a_forged_one(
    provider: str, path: str
) -> None:
    """``@webhook(provider)`` on a Django view, under WSGI (sync) and ASGI (async): the
    forged delivery (first, with the genuine one's id) is refused before the claim; the
    genuine one runs once and is replayed."""
    from tests.support.apps import counting
    from tests.support.webhooks import delivery, event_body, forged

    event_id, ref = f"evt_{uuid.uuid4().hex}", uuid.uuid4().hex
    genuine = delivery(provider, event_id, event_body(event_id, ref))
    bad = forged(genuine)

    async def send(d: Any) -> Any:
        if path == "async":
            client = AsyncClient()
            return await client.post(d.path, data=d.body, content_type=JSON, headers=d.headers)
        sync = Client()
        send_sync = sync.post
        return await asyncio.to_thread(
            send_sync, d.path, data=d.body, content_type=JSON, headers=d.headers
        )

    refused = await send(bad)
    assert refused.status_code == 401 and b"webhook-unverified" in refused.content
    first = await send(genuine)
    assert first.status_code == 200 and first.json() == {"run": 1, "size": len(genuine.body)}
    again = await send(genuine)
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    assert counting.count(f"hook:{ref}") == 2  # one run, and this count


def test_records_that_cannot_be_used_are_refused_at_startup(tmp_path: Path) -> None:
    """Django has no lifespan: the SQL records are checked when Django loads the
    middleware (here under ASGI, with async views), as the store is, so a missing table
    stops the startup."""

    async def async_view(request: HttpRequest) -> HttpResponse:
        return HttpResponse(status=201)

    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    records = SqlRecords(engine, table="never_created")
    try:
        with (
            override_settings(GOBLIN_IDEM={"RECORDS": records}),
            pytest.raises(
                ImproperlyConfigured,
                match=r"\['RECORDS'\]: goblin-idem records: the table 'never_created' does not",
            ),
        ):
            IdempotencyMiddleware(async_view)
        loop_thread().run(records.create_table())
        with override_settings(GOBLIN_IDEM={"RECORDS": records}):
            IdempotencyMiddleware(async_view)  # starts
    finally:
        loop_thread().run(engine.dispose())


def test_a_replay_keeps_every_value_of_a_repeated_header(redis_server: Server) -> None:
    """A record with a header given more than once (an ASGI service on the same store
    answered it: a Django response holds one value per name) is replayed with every value,
    in order, joined as HTTP joins them; Set-Cookie stays one cookie per header."""
    k = key()
    with override_settings(GOBLIN_IDEM={"STORE": redis_server.url}):
        first = post(Client(), "/cookie", k)
        assert first.status_code == 201
        result = key_names(b"idem", b"", k.encode()).result
        with redis_server.sync_client() as r:
            record = decode(r.get(result))
            headers = [
                *record.headers,
                (b"link", b"</a>; rel=preload"),
                (b"x-trace", b"t1"),
                (b"link", b"</b>; rel=preload"),
                (b"link", b"</c>; rel=preload"),
            ]
            shared = encode(dataclasses.replace(record, headers=headers))
            assert r.set(result, shared, keepttl=True, xx=True)
        again = post(Client(), "/cookie", k)
    assert again["Idempotent-Replayed"] == "true"
    assert again["Link"] == "</a>; rel=preload, </b>; rel=preload, </c>; rel=preload"
    assert again["X-Trace"] == "t1"
    assert {n: c.value for n, c in again.cookies.items()} == {"session": "s1", "theme": "dark"}


def test_a_replay_without_a_content_type_has_none(redis_server: Server) -> None:
    """A record with no Content-Type (an ASGI service's 201 with an empty body) is
    replayed without one: Django's default (text/html) is not added, and a header whose
    name differs in case from another's is joined with it, as Django holds one per name."""
    k = key()
    with override_settings(GOBLIN_IDEM={"STORE": redis_server.url}):
        assert post(Client(), "/cookie", k).status_code == 201
        result = key_names(b"idem", b"", k.encode()).result
        with redis_server.sync_client() as r:
            record = decode(r.get(result))
            headers = [(n, v) for n, v in record.headers if n != b"content-type"]
            headers += [(b"X-Trace", b"t1"), (b"x-trace", b"t2")]
            shared = encode(dataclasses.replace(record, headers=headers))
            assert r.set(result, shared, keepttl=True, xx=True)
        again = post(Client(), "/cookie", k)
    assert again["Idempotent-Replayed"] == "true"
    assert "Content-Type" not in again
    assert again["X-Trace"] == "t1, t2"


def until_kept(store: RedisStore, result: bytes) -> None:
    """Wait for the loop thread's replay cache to hold `result` (its fill's reply)."""
    until_sync(
        lambda: any(
            isinstance(e.replays, AutoPipeline) and e.replays.cached(result, time.monotonic())
            for e in tuple(store._loops.values())
        ),
        what="the fill arrived",
        every=0.001,
    )


def test_a_replay_kept_in_memory_is_answered_in_the_request_thread(redis_server: Server) -> None:
    """With a replay cache, a duplicate is answered in the request's thread (its event
    reported there), with no command sent: the same response, cookies included, as a
    replay read from the store."""
    store = RedisStore.from_url(redis_server.url, replay_cache_bytes=4 << 20)
    seen: list[tuple[str, threading.Thread]] = []

    def hook(event: str, key_hash: str) -> None:
        seen.append((event, threading.current_thread()))

    k = key()
    try:
        with override_settings(GOBLIN_IDEM={"STORE": store, "ON_EVENT": hook}):
            assert post(Client(), "/cookie", k).status_code == 201
            # the first duplicate reads the store, whose answer is then kept in memory
            assert post(Client(), "/cookie", k).status_code == 201
            until_kept(store, key_names(b"idem", b"", k.encode()).result)
            before = commands_served(redis_server)
            again = post(Client(), "/cookie", k)
            assert commands_served(redis_server) == before
        with override_settings(GOBLIN_IDEM={"STORE": redis_server.url}):
            from_store = post(Client(), "/cookie", k)
    finally:
        loop_thread().run(store.aclose())
    assert seen[-1] == ("replayed", threading.current_thread())
    assert again.status_code == from_store.status_code == 201
    assert list(again.items()) == list(from_store.items())
    assert again.content == from_store.content
    assert again.cookies.output() == from_store.cookies.output() != ""
