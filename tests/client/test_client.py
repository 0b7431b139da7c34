"""The client transports (goblin_idem.client) against real servers.

End to end: the example app under uvicorn on its own redis-server, with the fault proxy of
the reliability suite in front of it to lose answers after the handler ran. Rule by rule: a
scripted uvicorn app (scripted_app.py) that answers what each test tells it to and records
what it received. Every scenario runs through both transports: `IdempotentTransport` from
sync code, and `AsyncIdempotentTransport` on an event loop in a thread, called from the
same sync test code through anyio's blocking portal. Pure logic (Retry-After, backoff, the
budget's arithmetic) is tested without servers at the end.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from goblin_idem._keys import key_names, names_of
from goblin_idem.client import (
    AsyncIdempotentTransport,
    IdempotentTransport,
    RetryBudget,
    RetryEvent,
    RetryPolicy,
    TokenBucket,
    backoff_delay,
    parse_retry_after,
)
from tests.support.procs import APPS, ROOT, start_example_app, start_uvicorn, stop
from tests.support.proxy import Proxy
from tests.support.servers import Server, free_port, start_server
from tests.support.waits import until

PROBLEM = "urn:goblin-idem:problem:"
FAST = RetryPolicy(base_delay=0.02, max_delay=0.2, budget=None)  # quick retries, no budget


# -- servers -------------------------------------------------------------------------------


@dataclass
class ExampleApp:
    url: str  # straight to uvicorn
    proxied: str  # through the fault proxy
    proxy: Proxy
    store: Server

    def ledger(self, account: str) -> dict[str, Any]:
        doc = httpx.get(f"{self.url}/ledger?account={account}", timeout=5).json()
        return dict(doc["accounts"].get(account, {"payments": 0, "by_key": {}}))

    def counters(self) -> dict[str, int]:
        return dict(httpx.get(f"{self.url}/stats", timeout=5).json()["middleware"])


@pytest.fixture(scope="module")
def example_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExampleApp]:
    """`python -m example_app` on a redis-server of this module, behind a fault proxy."""
    store = start_server("redis")
    port = free_port()
    log = tmp_path_factory.mktemp("client") / "app.log"
    try:
        proc = start_example_app(port, log, REDIS_URL=store.url)
        try:
            with Proxy(port) as proxy:
                yield ExampleApp(
                    f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy.port}", proxy, store
                )
        finally:
            stop(proc)
    finally:
        store.stop()


@dataclass
class Scripted:
    url: str

    def script(self, *responses: dict[str, Any]) -> None:
        r = httpx.post(f"{self.url}/_script", json={"responses": list(responses)}, timeout=5)
        r.raise_for_status()

    def hits(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.url}/_hits", timeout=5).json())


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    port = free_port()
    proc = start_uvicorn(port, {}, app=f"{APPS}.scripted_app:app")
    try:
        yield Scripted(f"http://127.0.0.1:{port}")
    finally:
        stop(proc)


# -- one client, sync or async, called from sync test code ----------------------------------


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as portal:
        yield portal


class Caller:
    """An httpx client over the transport under test. Sync: `httpx.Client` with
    `IdempotentTransport`. Async: `httpx.AsyncClient` with `AsyncIdempotentTransport`, its
    calls run on the portal's event loop; several threads may call at once."""

    def __init__(
        self,
        mode: str,
        portal: BlockingPortal,
        base_url: str,
        *,
        limits: httpx.Limits | None = None,
        timeout: float = 10.0,
        **options: Any,
    ) -> None:
        self.mode = mode
        self.portal = portal
        self.events: list[RetryEvent] = []
        options.setdefault("on_retry", self.events.append)
        pool = {"limits": limits} if limits is not None else {}
        if mode == "sync":
            self.transport: IdempotentTransport | AsyncIdempotentTransport = IdempotentTransport(
                httpx.HTTPTransport(**pool), **options
            )
            self.client: httpx.Client | httpx.AsyncClient = httpx.Client(
                transport=self.transport, base_url=base_url, timeout=timeout
            )
        else:
            self.transport = AsyncIdempotentTransport(httpx.AsyncHTTPTransport(**pool), **options)
            self.client = httpx.AsyncClient(
                transport=self.transport, base_url=base_url, timeout=timeout
            )

    @property
    def budget(self) -> TokenBucket:
        assert self.transport.budget is not None
        return self.transport.budget

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if isinstance(self.client, httpx.Client):
            return self.client.request(method, path, **kwargs)
        return self.portal.call(functools.partial(self.client.request, method, path, **kwargs))

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, **kwargs)

    def streaming(self, chunks: list[bytes]) -> Any:
        """A body that can be read once: a generator of the client's kind."""
        if self.mode == "sync":
            return iter(chunks)

        async def agen() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return agen()

    def close(self) -> None:
        if isinstance(self.client, httpx.Client):
            self.client.close()
        else:
            self.portal.call(self.client.aclose)


@pytest.fixture(params=["sync", "async"])
def make(request: pytest.FixtureRequest, portal: BlockingPortal) -> Iterator[Any]:
    callers: list[Caller] = []

    def factory(base_url: str, **options: Any) -> Caller:
        caller = Caller(request.param, portal, base_url, **options)
        callers.append(caller)
        return caller

    yield factory
    for caller in callers:
        caller.close()


def payment(account: str, amount: int = 100) -> dict[str, Any]:
    return {"account": account, "amount_cents": amount, "currency": "EUR"}


def ext(response: httpx.Response) -> dict[str, Any]:
    return dict(response.extensions["idempotency"])


def problem(slug: str, status: int, **headers: str) -> dict[str, Any]:
    body = f'{{"type": "{PROBLEM}{slug}", "title": "t", "status": {status}, "detail": "d"}}'
    return {
        "status": status,
        "headers": {"content-type": "application/problem+json", **headers},
        "body": body,
    }


# -- end to end: the example app behind the fault proxy ------------------------------------


def test_lost_answers_are_replayed_and_the_handler_runs_once(
    make: Any, example_app: ExampleApp
) -> None:
    """For each call the proxy loses the first `d` answers (d = 0..3) after the handler ran:
    the call returns the replay, and each key charged once.

    The proxy drops a connection when the answer's first bytes (its headers) arrive, which
    uvicorn sends before the middleware has published the body; a retry that gets there
    before the publish is told 409 in-flight and waits, as it should."""
    caller = make(example_app.proxied, policy=FAST)
    account = f"acct_drop_{caller.mode}"
    before = example_app.counters()
    dropped_before = example_app.proxy.stats.dropped_responses
    drops = [0, 1, 2, 3] * 3
    keys = []
    for i, d in enumerate(drops):
        example_app.proxy.drop_responses(d)
        r = caller.post("/payments", json=payment(account, 100 + i))
        assert r.status_code == 201
        assert r.json()["amount_cents"] == 100 + i
        info = ext(r)
        events = [e for e in caller.events if e.key == info["key"]]
        lost = [e for e in events if e.reason in ("ReadError", "RemoteProtocolError")]
        assert len(lost) == d
        assert all(e.reason == "409 in-flight" for e in events if e not in lost)
        assert info["attempts"] == 1 + len(events)
        assert info["replayed"] is (d > 0)
        keys.append(info["key"])

    calls = len(drops)
    dropped = example_app.proxy.stats.dropped_responses - dropped_before
    retries = len(caller.events)
    waited = sum(e.reason == "409 in-flight" for e in caller.events)
    ledger = example_app.ledger(account)
    runs = ledger["payments"]
    print(
        f"\n[{caller.mode}] calls={calls} dropped_responses={dropped} retries={retries} "
        f"(of which 409 in-flight: {waited}) handler_runs={runs}"
    )
    assert dropped == sum(drops) == retries - waited
    assert runs == calls
    assert len(set(keys)) == calls  # a fresh key per call, the same one on its attempts
    assert ledger["by_key"] == {k: [ledger["by_key"][k][0]] for k in keys}
    after = example_app.counters()
    assert after["claimed"] - before["claimed"] == calls
    assert after["replayed"] - before["replayed"] == sum(drops)  # each lost answer's retry
    assert after["in_flight"] - before["in_flight"] == waited


def test_concurrent_duplicates_both_get_the_answer(make: Any, example_app: ExampleApp) -> None:
    """Two calls with one explicit key against a slow handler: the one that comes second is
    told 409 in-flight, waits Retry-After, and gets the replay instead of an error."""
    budget = RetryBudget(capacity=1, per_second=0.0, per_success=0.0)
    caller = make(example_app.url, policy=RetryPolicy(budget=budget))
    account = f"acct_race_{caller.mode}"
    key = f"race-{caller.mode}"

    def call() -> httpx.Response:
        return caller.post(
            "/payments?delay_ms=600",
            json=payment(account),
            headers={"Idempotency-Key": key},
        )

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(call)
        time.sleep(0.1)
        second = pool.submit(call)
        a, b = first.result(), second.result()
    assert (a.status_code, b.status_code) == (201, 201)
    assert a.content == b.content
    ran, replay = sorted([a, b], key=lambda r: ext(r)["replayed"])
    assert (ext(ran)["replayed"], ext(replay)["replayed"]) == (False, True)
    assert ext(ran)["attempts"] == 1
    assert ext(replay)["attempts"] == 1 + len(caller.events) >= 2
    assert {e.reason for e in caller.events} == {"409 in-flight"}
    assert caller.events[0].response is not None
    assert caller.events[0].response.json()["type"] == PROBLEM + "in-flight"
    assert example_app.ledger(account)["by_key"] == {key: [a.json()["id"]]}
    # waiting for a duplicate is not a failure: the one-token budget was not touched
    assert caller.budget.tokens == 1


def test_key_reuse_and_bad_keys_are_answered_at_once(make: Any, example_app: ExampleApp) -> None:
    # Even a policy that lists 400 and 422 never retries these problem types.
    policy = RetryPolicy(retry_statuses={400, 422, 503}, base_delay=0.01, budget=None)
    caller = make(example_app.url, policy=policy)
    account = f"acct_reuse_{caller.mode}"
    key = {"Idempotency-Key": f"reuse-{caller.mode}"}
    assert caller.post("/payments", json=payment(account, 1), headers=key).status_code == 201
    reused = caller.post("/payments", json=payment(account, 2), headers=key)
    assert reused.status_code == 422
    assert reused.json()["type"] == PROBLEM + "key-reused"
    assert ext(reused) == {"key": key["Idempotency-Key"], "attempts": 1, "replayed": False}
    bad = caller.post("/payments", json=payment(account), headers={"Idempotency-Key": "k" * 300})
    assert bad.status_code == 400 and bad.json()["type"] == PROBLEM + "invalid-key"
    assert ext(bad)["attempts"] == 1
    assert caller.events == []
    assert example_app.ledger(account)["payments"] == 1


def test_deadline_ends_the_wait_for_a_duplicate(make: Any, example_app: ExampleApp) -> None:
    """A key in flight for 2.5 s; a call with a 1.8 s deadline retries once after
    Retry-After (1 s), and returns the 409 rather than wait past its deadline."""
    slow = make(example_app.url, policy=FAST)
    caller = make(example_app.url, policy=RetryPolicy(deadline=1.8, budget=None))
    account = f"acct_deadline_{caller.mode}"
    key = {"Idempotency-Key": f"deadline-{caller.mode}"}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            slow.post, "/payments?delay_ms=2500", json=payment(account), headers=key
        )
        time.sleep(0.3)
        started = time.monotonic()
        r = caller.post("/payments?delay_ms=2500", json=payment(account), headers=key)
        elapsed = time.monotonic() - started
        assert r.status_code == 409 and r.json()["type"] == PROBLEM + "in-flight"
        assert ext(r)["attempts"] == 2
        assert 1.0 <= elapsed < 1.8
        assert running.result().status_code == 201
    assert example_app.ledger(account)["payments"] == 1


def test_the_key_hash_is_the_one_the_server_stores(
    make: Any, example_app: ExampleApp, caplog: pytest.LogCaptureFixture
) -> None:
    """The retry log line names the key by the hash the server names its keys by (under
    the default scope, the Authorization header), and never shows the key."""
    caller = make(example_app.proxied, policy=FAST)
    key = f"hash-{caller.mode}-secret"
    example_app.proxy.drop_responses(1)
    with caplog.at_level(logging.INFO, logger="goblin_idem.client"):
        r = caller.post(
            "/payments",
            json=payment(f"acct_hash_{caller.mode}"),
            headers={"Idempotency-Key": key, "Authorization": "Bearer tok"},
        )
    assert ext(r) == {"key": key, "attempts": 2, "replayed": True}
    digest = key_names(b"idem", b"Bearer tok", key.encode()).hash
    assert caller.events[0].key_hash == digest
    with example_app.store.sync_client() as redis:
        assert redis.exists(names_of(b"idem", digest).result) == 1
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "goblin_idem.client"]
    assert len(lines) == 1
    assert digest in lines[0] and "attempt 1" in lines[0] and key not in lines[0]


# -- rule by rule: the scripted server -------------------------------------------------------


def test_same_key_and_body_on_every_attempt_over_one_connection(
    make: Any, scripted: Scripted
) -> None:
    """Discarded answers are drained, so every attempt reuses the pooled connection."""
    scripted.script(
        problem("store-unavailable", 503, **{"retry-after": "0"}),
        {"status": 502, "body": "bad gateway"},
        {"status": 201, "body": "done"},
    )
    caller = make(scripted.url, policy=FAST, limits=httpx.Limits(max_connections=1))
    r = caller.post("/pay", json={"amount": 1})
    assert (r.status_code, r.text) == (201, "done")
    info = ext(r)
    assert info["attempts"] == 3 and info["replayed"] is False
    hits = scripted.hits()
    assert [h["headers"]["idempotency-key"] for h in hits] == [info["key"]] * 3
    assert {base64.b64decode(h["body"]) for h in hits} == {b'{"amount":1}'}
    assert len({h["port"] for h in hits}) == 1
    assert [e.reason for e in caller.events] == ["503 store-unavailable", "502"]
    assert caller.events[1].response is not None and caller.events[1].response.text == (
        "bad gateway"
    )


def test_a_large_discarded_body_drops_its_connection(make: Any, scripted: Scripted) -> None:
    scripted.script({"status": 503, "size": 200_000}, {"status": 200, "body": "ok"})
    caller = make(scripted.url, policy=FAST)
    r = caller.post("/pay", content=b"x")
    assert r.text == "ok" and ext(r)["attempts"] == 2
    hits = scripted.hits()
    assert hits[0]["port"] != hits[1]["port"]
    assert caller.events[0].response is not None and caller.events[0].response.content == b""


def test_what_is_never_retried(make: Any, scripted: Scripted) -> None:
    caller = make(scripted.url, policy=FAST)
    cases: list[tuple[dict[str, Any], str]] = [
        # the work is done but its answer was too large to keep: repeating cannot help,
        # even when asked to come back
        (problem("not-replayable", 409, **{"retry-after": "1"}), "not-replayable"),
        ({"status": 409, "body": "version conflict"}, "a conflict that is not in flight"),
        (
            {"status": 500, "headers": {"idempotent-replayed": "true"}},
            "a stored answer, replayed",
        ),
        ({"status": 404}, "404"),
        ({"status": 413}, "413"),
        ({"status": 401}, "401"),
    ]
    for answer, why in cases:
        scripted.script(answer, {"status": 200})
        r = caller.post("/pay", json={})
        assert r.status_code == answer["status"], why
        assert ext(r)["attempts"] == 1, why
        assert len(scripted.hits()) == 1, why
    assert caller.events == []


def test_requests_without_a_key_or_with_a_stream_are_sent_once(
    make: Any, scripted: Scripted
) -> None:
    plain = make(scripted.url, policy=FAST, auto_key=False)
    scripted.script({"status": 503}, {"status": 200})
    r = plain.post("/pay", json={})
    assert r.status_code == 503 and ext(r) == {"key": None, "attempts": 1, "replayed": False}
    assert "idempotency-key" not in scripted.hits()[0]["headers"]

    caller = make(scripted.url, policy=FAST)
    for method in ("GET", "PUT", "DELETE"):  # not covered: passed through untouched
        scripted.script({"status": 503}, {"status": 200})
        r = caller.request(method, "/thing")
        assert r.status_code == 503 and "idempotency" not in r.extensions
        assert "idempotency-key" not in scripted.hits()[0]["headers"]

    scripted.script({"status": 503}, {"status": 200})
    r = caller.post("/upload", content=caller.streaming([b"a", b"b"]))
    assert r.status_code == 503 and ext(r)["attempts"] == 1
    hit = scripted.hits()
    assert len(hit) == 1 and base64.b64decode(hit[0]["body"]) == b"ab"
    assert hit[0]["headers"]["idempotency-key"] == ext(r)["key"]  # keyed all the same
    assert caller.events == []


def test_retry_after_seconds_date_cap_and_deadline(make: Any, scripted: Scripted) -> None:
    # an HTTP-date about two seconds ahead (it has whole seconds): the wait is what is left
    # until it when the answer is read (after the call was sent, before the hook was told),
    # however long the call took to get there
    told: list[float] = []

    def on_retry(event: RetryEvent) -> None:
        told.append(time.time())
        caller.events.append(event)

    caller = make(scripted.url, policy=RetryPolicy(max_delay=3.0, budget=None), on_retry=on_retry)
    target = int(time.time() + 2)
    scripted.script(
        {"status": 429, "headers": {"retry-after": formatdate(target, usegmt=True)}},
        {"status": 200},
    )
    sent, started = time.time(), time.monotonic()
    r = caller.post("/pay", json={})
    assert r.status_code == 200 and ext(r)["attempts"] == 2
    assert target - told[0] <= caller.events[-1].delay <= target - sent
    assert time.monotonic() - started >= caller.events[-1].delay

    # a Retry-After longer than max_delay waits max_delay
    capped = make(scripted.url, policy=RetryPolicy(max_delay=0.2, budget=None))
    scripted.script({"status": 503, "headers": {"retry-after": "120"}}, {"status": 200})
    started = time.monotonic()
    r = capped.post("/pay", json={})
    assert r.status_code == 200 and capped.events[0].delay == 0.2
    assert time.monotonic() - started < 2

    # one that reaches past the deadline is not waited for: the 503 comes back at once
    short = make(scripted.url, policy=RetryPolicy(deadline=2.0, budget=None))
    scripted.script({"status": 503, "headers": {"retry-after": "5"}}, {"status": 200})
    started = time.monotonic()
    r = short.post("/pay", json={})
    assert r.status_code == 503 and ext(r)["attempts"] == 1
    assert time.monotonic() - started < 1


def test_deadline_cuts_a_hanging_attempt(make: Any, scripted: Scripted) -> None:
    """The client's timeout is 10 s; the deadline of 1 s cuts the attempt's read timeout."""
    caller = make(scripted.url, policy=RetryPolicy(deadline=1.0, budget=None))
    scripted.script({"status": 200, "delay": 2.5})
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout) as raised:
        caller.post("/pay", json={})
    assert 0.9 <= time.monotonic() - started < 2.5
    assert caller.events == []  # nothing left of the deadline to retry in
    # the key the call used is on the error's request, to retry it later by hand
    assert (
        raised.value.request.headers["idempotency-key"]
        == scripted.hits()[0]["headers"]["idempotency-key"]
    )


def test_connection_errors_are_retried_up_to_max_attempts(make: Any) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    caller = make(closed, policy=RetryPolicy(max_attempts=3, base_delay=0.01, budget=None))
    with pytest.raises(httpx.ConnectError):
        caller.post("/pay", json={})
    assert [(e.attempt, e.reason) for e in caller.events] == [
        (1, "ConnectError"),
        (2, "ConnectError"),
    ]
    assert all(isinstance(e.error, httpx.ConnectError) for e in caller.events)


def test_budget_empties_under_503_and_refills_with_successes(
    make: Any, scripted: Scripted, caplog: pytest.LogCaptureFixture
) -> None:
    budget = RetryBudget(capacity=4, per_second=0.0, per_success=1.0)
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, budget=budget)
    caller = make(scripted.url, policy=policy)
    scripted.script({"status": 503})
    attempts = []
    with caplog.at_level(logging.WARNING, logger="goblin_idem.client"):
        for _ in range(3):
            r = caller.post("/pay", json={})
            assert r.status_code == 503
            attempts.append(ext(r)["attempts"])
    assert attempts == [3, 3, 1]  # 2 + 2 retries took the 4 tokens; then none is left
    assert len(scripted.hits()) == 7
    assert caller.budget.tokens == 0
    assert "the retry budget is empty" in caplog.records[-1].getMessage()

    scripted.script({"status": 200})
    for _ in range(2):
        assert caller.post("/pay", json={}).status_code == 200
    assert caller.budget.tokens == 2

    scripted.script({"status": 503})
    r = caller.post("/pay", json={})
    assert ext(r)["attempts"] == 3 and len(scripted.hits()) == 3


def test_a_failing_hook_changes_nothing(make: Any, scripted: Scripted) -> None:
    def hook(event: RetryEvent) -> None:
        raise RuntimeError("observer bug")

    caller = make(scripted.url, policy=FAST, on_retry=hook)
    scripted.script({"status": 500}, {"status": 200})
    r = caller.post("/pay", json={})
    assert r.status_code == 200 and ext(r)["attempts"] == 2


def test_custom_header_and_methods(make: Any, scripted: Scripted) -> None:
    caller = make(scripted.url, policy=FAST, header="X-Request-Key", methods=("put",))
    scripted.script({"status": 503}, {"status": 200})
    r = caller.request("PUT", "/thing", json={})
    assert ext(r)["attempts"] == 2
    assert [h["headers"]["x-request-key"] for h in scripted.hits()] == [ext(r)["key"]] * 2
    scripted.script({"status": 503}, {"status": 200})
    assert "idempotency" not in caller.post("/pay", json={}).extensions


# -- async only: cancellation ----------------------------------------------------------------


async def test_cancelled_calls_leave_no_connection_behind(scripted: Scripted) -> None:
    """A call cancelled while it waits or while its attempt is in flight gives its pooled
    connection back: the next call on a one-connection pool goes through."""
    transport = AsyncIdempotentTransport(
        httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1)),
        policy=RetryPolicy(budget=None),
    )
    async with httpx.AsyncClient(transport=transport, base_url=scripted.url, timeout=5) as c:
        # cancelled during the wait after a 503 that asks for 30 s
        scripted.script({"status": 503, "headers": {"retry-after": "30"}})
        task = asyncio.ensure_future(c.post("/pay", json={}))
        await until(scripted.hits, what="the request reached the server")
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # cancelled while the server is still working on the attempt
        scripted.script({"status": 200, "delay": 2}, {"status": 200, "body": "next"})
        task = asyncio.ensure_future(c.post("/pay", json={}))
        await until(scripted.hits, what="the request reached the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = await c.post("/pay", json={}, extensions={"timeout": {"pool": 1.0}})
        assert r.text == "next"


# -- pure logic --------------------------------------------------------------------------------


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("3", now) == 3.0
    assert parse_retry_after(" 0 ", now) == 0.0
    assert parse_retry_after("1.5", now) == 1.5
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now) == 30.0
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now) == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00", 0) == 1445412480.0  # GMT implied
    for bad in (None, "", "-1", "soon", "1e3", "Wed, 99 Foo 2015"):
        assert parse_retry_after(bad, now) is None, bad


def test_backoff_is_full_jitter_under_a_cap() -> None:
    for retry, ceiling in ((1, 0.5), (2, 1.0), (3, 2.0), (6, 10.0), (500, 10.0)):
        samples = [backoff_delay(retry, 0.5, 10.0) for _ in range(2000)]
        assert all(0.0 <= s <= ceiling for s in samples)
        # spread over the whole range, not clustered at the top
        assert min(samples) < ceiling * 0.05 and max(samples) > ceiling * 0.95


def test_token_bucket_refills_over_time_and_with_successes() -> None:
    now = [100.0]
    bucket = TokenBucket(RetryBudget(capacity=3, per_second=2.0, per_success=0.5), lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    now[0] += 0.25  # half a token
    assert not bucket.take()
    bucket.deposit()  # + 0.5: one token
    assert bucket.take() and not bucket.take()
    now[0] += 60  # never above capacity
    assert bucket.tokens == 3


def test_token_bucket_is_shared_safely_by_threads() -> None:
    """Eight threads take from one bucket at once: exactly `capacity` takes succeed (without
    the lock, about half as many again do)."""
    bucket = TokenBucket(RetryBudget(capacity=20_000, per_second=0.0, per_success=0.0))
    start = threading.Barrier(8)

    def take_many(_: int) -> int:
        start.wait()
        return sum(bucket.take() for _ in range(5_000))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to provoke races
    try:
        with ThreadPoolExecutor(8) as pool:
            taken = sum(pool.map(take_many, range(8)))
    finally:
        sys.setswitchinterval(interval)
    assert taken == 20_000 and bucket.tokens == 0


def test_configuration_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="max_attempts must be at least 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="deadline must be None or more than 0"):
        RetryPolicy(deadline=0)
    with pytest.raises(ValueError, match="retry_statuses must be HTTP status codes, not 99"):
        RetryPolicy(retry_statuses={503, 99})
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        RetryBudget(capacity=0)
    with pytest.raises(ValueError, match="header name such as 'Idempotency-Key'"):
        IdempotentTransport(header="Idempotency Key")
    with pytest.raises(TypeError, match=r"e\.g\. \('POST',\)"):
        IdempotentTransport(methods="POST")
    with pytest.raises(TypeError, match="use AsyncIdempotentTransport"):
        IdempotentTransport(httpx.AsyncHTTPTransport())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use IdempotentTransport"):
        AsyncIdempotentTransport(httpx.HTTPTransport())  # type: ignore[arg-type]
    assert RetryPolicy(retry_statuses=[503]).retry_statuses == frozenset({503})


def test_importing_goblin_idem_does_not_import_httpx() -> None:
    code = "import sys, goblin_idem; print('httpx' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
