"""Configuration that cannot work is refused at construction, with a message that names the
option and says what to pass instead."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis.asyncio

from goblin_idem import (
    IdempotencyMiddleware,
    Lock,
    MemoryStore,
    RedisStore,
    RoutePolicy,
    idempotent,
    once,
)
from tests.support.asgi import request


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


BAD = [
    # (keyword arguments, exception, words the message must contain)
    ({"store": "redis://:s3cret@127.0.0.1:6379/0"}, TypeError, ["RedisStore.from_url(url)"]),
    ({"store": object()}, TypeError, ["MemoryStore()"]),
    ({"header": ""}, ValueError, ["header", "not a valid header name"]),
    ({"header": "Idempotency Key"}, ValueError, ["no spaces"]),
    ({"header": b"Idempotency-Key"}, ValueError, ["header"]),
    ({"methods": []}, ValueError, ["at least one method"]),
    ({"methods": "POST"}, TypeError, ["['POST']"]),
    ({"methods": ["PO ST"]}, ValueError, ["not a valid method"]),
    ({"required": 1}, TypeError, ["required", "True or False"]),
    ({"lease_seconds": 0}, ValueError, ["lease_seconds", ">= 1"]),
    ({"lease_seconds": 0.5}, ValueError, ["lease_seconds", ">= 1"]),
    ({"lease_seconds": float("nan")}, ValueError, ["lease_seconds", "finite"]),
    ({"lease_seconds": True}, TypeError, ["lease_seconds", "not a bool"]),
    ({"ttl_seconds": -1}, ValueError, ["ttl_seconds", ">= 1"]),
    ({"ttl_seconds": "86400"}, TypeError, ["ttl_seconds", "not a str"]),
    ({"include": "/api/*"}, TypeError, ["include", "['/api/*']"]),
    ({"exclude": [1]}, TypeError, ["exclude", "not an int"]),
    ({"required_paths": "/hooks/*"}, TypeError, ["required_paths", "['/hooks/*']"]),
    ({"key_pattern": re.compile("[a-z]+")}, TypeError, ["key_pattern", "rb'[a-z]+'"]),
    ({"key_pattern": "[a-z]+"}, TypeError, ["key_pattern", "re.compile(rb'...')"]),
    ({"scope": "Authorization"}, TypeError, ["scope", "function of the ASGI scope"]),
    ({"fingerprint_headers": "X-Currency"}, TypeError, ["['X-Currency']"]),
    ({"fingerprint_headers": ["X Currency"]}, ValueError, ["fingerprint_headers"]),
    ({"max_body_bytes": 0}, ValueError, ["max_body_bytes", ">= 1"]),
    ({"max_body_bytes": None}, TypeError, ["max_body_bytes", "whole number"]),
    ({"max_response_bytes": -1}, ValueError, ["max_response_bytes", ">= 0"]),
    ({"retry_after_seconds": -1}, ValueError, ["retry_after_seconds", ">= 0"]),
    ({"retry_after_seconds": "1"}, TypeError, ["retry_after_seconds", "number of seconds"]),
    ({"wait_seconds": -1}, ValueError, ["wait_seconds", ">= 0"]),
    (
        {"wait_seconds": 0.5, "poll_interval_seconds": 0},
        ValueError,
        ["poll_interval_seconds", "busy loop"],
    ),
    ({"poll_interval_seconds": -5}, ValueError, ["poll_interval_seconds", ">= 0"]),
    ({"store_server_errors": "yes"}, TypeError, ["store_server_errors", "True or False"]),
    ({"fail_open": 1}, TypeError, ["fail_open", "True or False"]),
    ({"namespace": ""}, ValueError, ["namespace", "not be empty"]),
    ({"namespace": "app{1}"}, ValueError, ["namespace", "hash tag"]),
    ({"namespace": b"idem"}, TypeError, ["namespace", "str"]),
    ({"on_event": "metrics"}, TypeError, ["on_event", "function"]),
]


def _id(kwargs: dict[str, Any]) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): no
    object addresses."""
    return re.sub(r" at 0x[0-9a-f]+", "", str(kwargs))


@pytest.mark.parametrize(("kwargs", "error", "words"), BAD, ids=[_id(b[0]) for b in BAD])
def test_unworkable_option_is_refused(
    kwargs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        IdempotencyMiddleware(app, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_a_store_url_is_never_echoed() -> None:
    """The message says what to do, without repeating a URL that may carry a password."""
    with pytest.raises(TypeError) as info:
        IdempotencyMiddleware(app, store="redis://:s3cret@127.0.0.1:6379/0")
    assert "s3cret" not in str(info.value)


async def test_a_redis_client_is_told_to_wrap_itself() -> None:
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)  # never connected
    try:
        with pytest.raises(TypeError, match=r"RedisStore\(client\)"):
            IdempotencyMiddleware(app, store=client)
    finally:
        await client.aclose()


def test_a_store_class_is_told_to_be_an_instance() -> None:
    """The class has the Store methods (unbound), so it would pass for a store and every
    keyed request would fail."""
    for cls in (RedisStore, MemoryStore):
        with pytest.raises(TypeError, match=f"not the class {cls.__name__}: pass store="):
            IdempotencyMiddleware(app, store=cls)
        with pytest.raises(TypeError, match=f"not the class {cls.__name__}"):
            once(cls, key=lambda n: n)  # type: ignore[arg-type]


def test_not_an_app_is_refused() -> None:
    with pytest.raises(TypeError, match="ASGI application"):
        IdempotencyMiddleware(None)  # type: ignore[arg-type]


async def test_edge_values_that_do_work_are_accepted() -> None:
    mw = IdempotencyMiddleware(
        app,
        store=MemoryStore(),
        header="X-Request-Key",
        methods=("post", "PUT"),
        max_response_bytes=0,
        retry_after_seconds=0,
        wait_seconds=0,
        poll_interval_seconds=0,  # unused without wait_seconds
        lease_seconds=60,
        ttl_seconds=10,  # shorter than the lease: the result TTL wins once published
        include=["/api/*"],
        key_pattern=lambda k: k.isalnum(),
    )
    assert mw.methods == {"POST", "PUT"}
    first = await request(mw, "PUT", "/api/x", headers=[("X-Request-Key", "k1")])
    again = await request(mw, "PUT", "/api/x", headers=[("X-Request-Key", "k1")])
    assert first.status == 200 and again.status == 409  # stored, but not its 2-byte body


BAD_MARKS = [
    ({"ttl_seconds": 0}, ValueError, "ttl_seconds"),
    ({"ttl_seconds": True}, TypeError, "ttl_seconds"),
    ({"lease_seconds": 0.5}, ValueError, "lease_seconds"),
    ({"required": "yes"}, TypeError, "required"),
    ({"enabled": None}, TypeError, "enabled"),
]


@pytest.mark.parametrize(("kwargs", "error", "word"), BAD_MARKS, ids=[_id(b[0]) for b in BAD_MARKS])
def test_unworkable_route_mark_is_refused(
    kwargs: dict[str, Any], error: type[Exception], word: str
) -> None:
    with pytest.raises(error, match=rf"@idempotent\({word}=\.\.\.\)"):
        idempotent(**kwargs)
    with pytest.raises(error):
        RoutePolicy(**kwargs)


def test_a_mark_given_a_positional_value_says_to_use_keywords() -> None:
    with pytest.raises(TypeError, match=r"keyword arguments only, as in @idempotent\("):
        idempotent(True)  # type: ignore[call-overload]


def test_durations_are_seconds_and_the_old_millisecond_names_still_work() -> None:
    """Every duration is in seconds (fractions too); wait_ms, poll_interval_ms,
    Lock(lease_ms=) and RedisStore(wait_timeout_ms=) work for one more release, warned."""

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    mw = IdempotencyMiddleware(
        app, wait_seconds=0.25, poll_interval_seconds=0.01, lease_seconds=1.5, ttl_seconds=2.5
    )
    assert (mw.wait_seconds, mw.poll_interval) == (0.25, 0.01)
    settings = mw.routes.defaults
    assert (settings.lease_ms, settings.claim_seconds, settings.ttl_ms) == (1500, 2, 2500)
    with pytest.warns(DeprecationWarning, match="wait_ms is deprecated.*wait_seconds="):
        old = IdempotencyMiddleware(app, wait_ms=250, poll_interval_ms=10)
    assert (old.wait_seconds, old.poll_interval) == (0.25, 0.01)
    with pytest.warns(DeprecationWarning, match="lease_ms is deprecated.*lease_seconds="):
        lock = Lock(MemoryStore(), "x", lease_ms=1500)
    assert (lock.lease_seconds, lock.lease_ms) == (1.5, 1500)
    with pytest.warns(DeprecationWarning, match="wait_timeout_ms is deprecated"):
        store = RedisStore.from_url("redis://127.0.0.1:1/0", wait_replicas=1, wait_timeout_ms=250)
    assert (store.wait_timeout_seconds, store.wait_timeout_ms) == (0.25, 250)
