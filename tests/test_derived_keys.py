"""Keys derived from a run's claim (`Claim.derive_key`, the transports' outgoing keys), seen
from the run: `once` on a MemoryStore holds a real claim (and the WSGI middleware, for a
view in a thread of its own). What they do across two real services is
tests/sql/test_downstream.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from goblin_idem import MemoryStore, current_claim, once
from goblin_idem._keys import DEFAULT_KEY_PATTERN, key_names
from goblin_idem.client import AsyncIdempotentTransport, IdempotentTransport
from goblin_idem.wsgi import IdempotencyMiddleware as WSGIMiddleware
from tests.support.wsgi import call

# The same run key in a process of its own: the same function name, namespace and key.
IN_ANOTHER_PROCESS = """
import asyncio, json, sys
from goblin_idem import MemoryStore, current_claim, once

@once(MemoryStore(), key=lambda k: k, name="pay")
async def run(k):
    return current_claim().derive_key(sys.argv[1])

print(json.dumps(asyncio.run(run(sys.argv[2]))))
"""


def in_run(work: Any, key: str = "event-1", **options: Any) -> Any:
    """`work(claim)` inside a `once` run of `key` (a new run each call: a fresh store)."""

    @once(MemoryStore(), key=lambda k: k, name="pay", **options)
    def run(k: str) -> Any:
        claim = current_claim()
        assert claim is not None
        return work(claim)

    return run(key)


def test_a_label_names_one_key_per_run_key() -> None:
    charge, refund = in_run(lambda c: [c.derive_key("charge"), c.derive_key("refund")])
    assert charge != refund
    assert in_run(lambda c: c.derive_key("charge")) == charge  # a re-run: the same key
    assert in_run(lambda c: c.derive_key("charge"), key="event-2") != charge
    assert in_run(lambda c: c.derive_key("charge", secret=b"app secret")) != charge


def test_a_derived_key_is_a_valid_key_that_shows_nothing_of_the_run() -> None:
    key = "order-7"
    derived = in_run(lambda c: c.derive_key("charge"), key=key)
    names = key_names(b"once", b"pay", key.encode())
    assert DEFAULT_KEY_PATTERN.fullmatch(derived.encode())
    assert len(derived) == 36 and derived[14] == "8"  # an RFC 9562 version 8 UUID
    for part in (key, names.hash, names.hash[:8], "pay", "once"):
        assert part not in derived
    assert derived != key


def test_the_same_run_key_in_another_process_derives_the_same_key() -> None:
    here = in_run(lambda c: c.derive_key("charge"), key="event-9")
    out = subprocess.run(
        [sys.executable, "-c", IN_ANOTHER_PROCESS, "charge", "event-9"],
        capture_output=True,
        check=True,
        text=True,
    )
    assert json.loads(out.stdout) == here


def test_bad_labels_and_secrets_are_refused_with_what_to_pass() -> None:
    with pytest.raises(TypeError, match="non-empty str"):
        in_run(lambda c: c.derive_key(""))
    with pytest.raises(TypeError, match="non-empty str"):
        in_run(lambda c: c.derive_key(7))
    with pytest.raises(ValueError, match="pass None"):
        in_run(lambda c: c.derive_key("charge", secret=b""))
    with pytest.raises(TypeError, match="bytes or str"):
        IdempotentTransport(key_secret=7)  # type: ignore[arg-type]


class Echo(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """What the transports put on the wire, without a server: the key each request carried
    (a wire-level check of key choice; the servers' side is test_downstream.py)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.keys.append(request.headers["idempotency-key"])
        return httpx.Response(201, json={})

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self.handle_request(request)


@pytest.fixture
def echo() -> Iterator[Echo]:
    yield Echo()


def calls(echo: Echo, **options: Any) -> Any:
    """Inside a run: two labelled POSTs to one URL, one to another, a label repeated, and
    one with a key of the caller's own."""

    def work(claim: Any) -> list[str]:
        with httpx.Client(transport=IdempotentTransport(echo, **options)) as client:
            url = "http://127.0.0.1:9/charges"
            client.post(url, json={"n": 1}, extensions={"idempotency_label": "a"})
            client.post(url, json={"n": 2}, extensions={"idempotency_label": "b"})
            client.post(
                "http://127.0.0.1:9/refunds", json={}, extensions={"idempotency_label": "a"}
            )
            client.post(url, json={}, extensions={"idempotency_label": "a"})
            client.post(url, json={}, headers={"Idempotency-Key": "mine"})
        return list(echo.keys)

    return work


def test_outgoing_keys_inside_a_run(echo: Echo) -> None:
    first = in_run(calls(echo))
    a, b, other, a_again, mine = first
    assert len({a, b, other}) == 3  # each label, and each URL, has a key of its own
    assert a_again == a  # a label names one call: repeating it repeats the key
    assert mine == "mine"  # a key the caller set is sent as it is
    assert in_run(calls(Echo())) == first  # a re-run sends the same keys
    assert in_run(calls(Echo()), key="event-2")[:4] != first[:4]
    assert in_run(calls(Echo(), key_secret="s"))[:4] != first[:4]
    assert [a, b] != in_run(lambda c: [c.derive_key("a"), c.derive_key("b")])


def test_derivation_off_and_outside_a_run_keys_are_random(echo: Echo) -> None:
    off = in_run(calls(echo, derived_keys=False))
    assert off != in_run(calls(Echo(), derived_keys=False))
    outside = calls(Echo())(None)
    assert outside != calls(Echo())(None)
    assert all(DEFAULT_KEY_PATTERN.fullmatch(k.encode()) for k in off + outside)


def test_an_unlabelled_call_is_refused_in_a_run_and_random_outside(echo: Echo) -> None:
    def unlabelled(**options: Any) -> Any:
        def work(claim: Any) -> None:
            with httpx.Client(transport=IdempotentTransport(echo, **options)) as client:
                client.post("http://127.0.0.1:9/charges", json={})

        return work

    with pytest.raises(TypeError, match=r"idempotency_label.*Nothing was sent"):
        in_run(unlabelled())
    assert echo.keys == []
    unlabelled()(None)  # outside a run
    in_run(unlabelled(derived_keys=False))
    assert len(set(echo.keys)) == 2


async def test_the_async_transport_derives_the_same_keys() -> None:
    sync_keys = in_run(calls(Echo()), key="event-3")
    echo = Echo()

    @once(MemoryStore(), key=lambda k: k, name="pay")
    async def run(k: str) -> list[str]:
        transport = AsyncIdempotentTransport(echo)
        async with httpx.AsyncClient(transport=transport) as client:
            url = "http://127.0.0.1:9/charges"
            await client.post(url, json={"n": 1}, extensions={"idempotency_label": "a"})
            await client.post(url, json={"n": 2}, extensions={"idempotency_label": "b"})
        return echo.keys

    assert await run("event-3") == sync_keys[:2]


def test_a_bad_label_extension_is_refused() -> None:
    def work(claim: Any) -> None:
        with httpx.Client(transport=IdempotentTransport(Echo())) as client:
            client.post("http://127.0.0.1:9/x", extensions={"idempotency_label": 3})

    with pytest.raises(TypeError, match="idempotency_label"):
        in_run(work)


def test_a_wsgi_view_rerun_sends_the_same_keys() -> None:
    """The sync adapters run a view in a thread of its own: the claim is there too."""
    echo = Echo()
    runs: list[str] = []

    def view(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        claim = current_claim()
        assert claim is not None
        runs.append(claim.derive_key("charge"))
        with httpx.Client(transport=IdempotentTransport(echo)) as client:
            client.post(
                "http://127.0.0.1:9/charges", json={}, extensions={"idempotency_label": "charge"}
            )
        if len(runs) == 1:
            raise RuntimeError("failed after the charge")  # the key is released
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b"{}"]

    app = WSGIMiddleware(view, store=MemoryStore())
    with pytest.raises(RuntimeError):
        call(app, key="order-1")
    assert call(app, key="order-1").status == "201 Created"
    assert call(app, key="order-2").status == "201 Created"
    assert runs[0] == runs[1] != runs[2]
    assert echo.keys[0] == echo.keys[1] != echo.keys[2]
