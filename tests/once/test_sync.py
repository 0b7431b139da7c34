"""`once` on a plain ``def``: the function in its caller's thread, the claim, the lease and
the stored value on the loop thread; one run per key across threads, on the embedded store
and on real Redis/Valkey servers (script and native). A Celery worker: test_celery.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest

from goblin_idem import (
    ClaimLostError,
    InFlightError,
    KeyReusedError,
    MemoryStore,
    Store,
    current_claim,
    once,
)
from goblin_idem._threads._loop import loop_thread
from tests.support.backends import (
    sync_store,  # noqa: F401
)
from tests.support.servers import Server
from tests.support.waits import until_sync
from tests.wsgi.test_middleware import fresh_store, in_child


def in_threads(n: int, fn: Any) -> list[Any]:
    """`fn()` in `n` threads started together: what each returned, or raised."""
    outcomes: list[Any] = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = fn()
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


def test_concurrent_calls_in_threads_run_once(store: Store) -> None:
    runs: list[str] = []

    refused: list[InFlightError] = []

    @once(store, key=lambda event: event["id"])
    def charge(event: dict[str, Any]) -> dict[str, Any]:
        runs.append(threading.current_thread().name)
        until_sync(lambda: len(refused) == 7, what="the seven other callers refused")
        return {"charged": event["amount"]}

    def call() -> dict[str, Any]:
        try:
            return charge({"id": "e1", "amount": 5})
        except InFlightError as refusal:
            refused.append(refusal)
            raise

    outcomes = in_threads(8, call)
    values = [o for o in outcomes if not isinstance(o, Exception)]
    busy = [o for o in outcomes if isinstance(o, InFlightError)]
    assert values == [{"charged": 5}] and len(busy) == 7
    assert len(runs) == 1 and runs[0].startswith("Thread")  # in its caller's thread
    assert charge({"id": "e1", "amount": 5}) == {"charged": 5} and len(runs) == 1


def test_callers_that_wait_get_the_one_value(store: Store) -> None:
    runs = 0

    @once(store, key=lambda n: n, wait_seconds=5)
    def slow(n: int) -> list[int]:
        nonlocal runs
        runs += 1
        time.sleep(0.3)
        return [n, n]

    assert in_threads(6, lambda: slow(3)) == [[3, 3]] * 6 and runs == 1


def test_an_exception_releases_the_claim_and_propagates_untouched(store: Store) -> None:
    errors = [ValueError("declined"), KeyboardInterrupt()]
    runs = 0

    @once(store, key=lambda n: n)
    def flaky(n: int) -> int:
        nonlocal runs
        runs += 1
        if errors:
            raise errors.pop(0)
        return n

    for expected in (ValueError, KeyboardInterrupt):
        with pytest.raises(expected) as raised:
            flaky(1)
        assert raised.tb is not None and raised.traceback[-1].name == "flaky"
    assert flaky(1) == 1 and runs == 3  # the loop thread outlived a KeyboardInterrupt


@dataclasses.dataclass
class Receipt:
    id: str
    cents: int


def test_a_value_is_stored_by_the_return_annotation(store: Store) -> None:
    @once(store, key=lambda order: order)
    def receipt(order: str) -> Receipt:
        return Receipt(order, 1250)

    assert receipt("o1") == Receipt("o1", 1250)
    assert receipt("o1") == Receipt("o1", 1250)  # decoded from the store, a Receipt again
    assert receipt.__name__ == "receipt" and receipt.__wrapped__ is not None  # type: ignore[attr-defined]


def test_a_sync_and_an_async_function_of_one_name_share_keys_and_values() -> None:
    """The same name (the same keys): what one stored, the other returns without running."""
    store = MemoryStore()

    @once(store, key=lambda event: event, name="billing.charge")
    def charge(event: str) -> dict[str, str]:
        return {"by": "sync"}

    @once(store, key=lambda event: event, name="billing.charge")
    async def charge_async(event: str) -> dict[str, str]:
        raise AssertionError("must not run: the value is stored")

    assert charge("e9") == {"by": "sync"}
    assert asyncio.run(charge_async("e9")) == {"by": "sync"}


def test_ensure_owned_is_a_plain_call_in_the_function(redis_server: Server) -> None:
    store = fresh_store(redis_server)
    seen: list[str] = []

    @once(store, key=lambda n: n)
    def commit(n: int) -> int:
        claim = current_claim()
        assert claim is not None
        claim.ensure_owned()
        seen.append("owned")
        with redis_server.sync_client() as client:
            client.delete(claim._lease.key)  # an operator deletes the key mid-run
        claim.ensure_owned()  # raises: the run stops before it commits
        seen.append("committed")
        return n

    with pytest.raises(ClaimLostError):
        commit(1)
    assert seen == ["owned"] and current_claim() is None
    loop_thread().run(store.aclose())


def test_a_sync_function_called_from_a_coroutine_checks_its_claim_too() -> None:
    """Called in a thread that runs an event loop (blocking it), the function's claim is
    still checked by a plain call, through the loop thread."""
    store = MemoryStore()

    @once(store, key=lambda n: n)
    def commit(n: int) -> str:
        claim = current_claim()
        assert claim is not None
        loop_thread().run(store.delete(claim._lease.key))  # an operator deletes the key
        try:
            claim.ensure_owned()
        except ClaimLostError:
            return "stopped before the commit"
        return "committed"

    async def caller() -> str:
        return commit(1)

    assert asyncio.run(caller()) == "stopped before the commit"


def test_the_lease_is_renewed_for_a_run_of_three_leases(redis_server: Server) -> None:
    store = fresh_store(redis_server)
    runs = 0

    @once(store, key=lambda n: n, lease_seconds=1)
    def long(n: int) -> int:
        nonlocal runs
        runs += 1
        time.sleep(3.2)
        return n

    first = threading.Thread(target=long, args=(7,))
    first.start()
    refused = 0
    while first.is_alive():
        time.sleep(0.4)
        try:
            long(7)
        except InFlightError:
            refused += 1
    first.join()
    assert refused >= 6 and runs == 1 and long(7) == 7
    loop_thread().run(store.aclose())


def test_a_function_used_before_a_fork_works_in_the_child(redis_server: Server) -> None:
    """As a Celery prefork pool or ``gunicorn --preload`` forks: the child starts its own
    loop thread, and the store opens connections of its own."""
    store = fresh_store(redis_server)
    runs: list[int] = []

    @once(store, key=lambda n: n)
    def job(n: int) -> int:
        runs.append(n)
        return n * 10

    assert job(1) == 10
    assert in_child(lambda: [job(1), job(2), job(2)]) == [10, 20, 20]
    assert job(2) == 20 and runs == [1]  # the child's run of 2 is stored: none here
    loop_thread().run(store.aclose())


async def test_a_sync_endpoint_of_an_asgi_app_checks_its_claim_with_a_plain_call() -> None:
    """Starlette and FastAPI run a ``def`` endpoint in a thread without an event loop: the
    request's claim is checked there by calling ensure_owned(), as in any sync code."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from goblin_idem import IdempotencyMiddleware
    from tests.support.asgi import request

    store = MemoryStore()
    checks: list[str] = []

    def pay(request: Request) -> PlainTextResponse:
        claim = current_claim()
        assert claim is not None
        claim.ensure_owned()  # a plain call: no loop runs in this thread
        checks.append("owned")
        loop_thread().run(store.delete(claim._lease.key))  # an operator deletes the key
        try:
            claim.ensure_owned()
        except ClaimLostError:
            checks.append("lost")
        return PlainTextResponse("paid", status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    reply = await request(IdempotencyMiddleware(app, store=store), path="/pay", key="k")
    assert reply.status == 201 and checks == ["owned", "lost"]


def test_a_sync_function_refuses_a_key_reused_with_other_arguments(store: Store) -> None:
    runs: list[int] = []

    @once(store, key=lambda order, cents: order, name="sync-refund")
    def refund(order: str, cents: int) -> int:
        runs.append(cents)
        return cents

    assert refund("o-1", 500) == refund("o-1", cents=500) == 500
    with pytest.raises(KeyReusedError, match="first used with other arguments"):
        refund("o-1", 999)
    assert runs == [500]
