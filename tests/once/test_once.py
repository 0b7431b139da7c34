"""`once` and `current_claim`: one run per key for any coroutine, on the embedded store and on
real Redis/Valkey servers (script and native), a crashed process, and a Redis Cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from pydantic import BaseModel
from redis.asyncio.cluster import RedisCluster

from goblin_idem import (
    ClaimLostError,
    IdempotencyMiddleware,
    InFlightError,
    KeyReusedError,
    MemoryStore,
    RedisStore,
    Store,
    Watchdog,
    current_claim,
    once,
)
from goblin_idem._keys import key_names
from goblin_idem.exceptions import RecordError
from goblin_idem.once._arguments import Fingerprint
from tests.support.asgi import request
from tests.support.backends import Backend, open_backend, server_for
from tests.support.procs import APPS, spawn, stop
from tests.support.servers import Server, start_cluster
from tests.support.waits import until

STORES = ["memory", "redis-script", "valkey-native", "postgres-asyncpg"]


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param.startswith("postgres-"):
        async with open_backend(request, request.param) as opened:
            yield opened.store
        return
    server = server_for(request, request.param)
    store = RedisStore.from_url(server.url, mode=request.param.split("-")[1])
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    yield store
    await store.aclose()


def claim_key(name: str, key: str, namespace: str = "once") -> bytes:
    return key_names(namespace.encode(), name.encode(), key.encode()).claim


# -- one run per key ------------------------------------------------------------------------


async def test_fifty_concurrent_calls_one_run(store: Store) -> None:
    runs = 0
    release = asyncio.Event()

    @once(store, key=lambda event: event["id"])
    async def handle(event: dict[str, Any]) -> dict[str, Any]:
        nonlocal runs
        runs += 1
        await release.wait()
        return {"charged": event["amount"], "tags": ("a", "b")}

    first = asyncio.create_task(handle({"id": "evt_1", "amount": 1500}))
    await until(lambda: runs == 1)
    others = await asyncio.gather(
        *[handle({"id": "evt_1", "amount": 1500}) for _ in range(49)], return_exceptions=True
    )
    assert all(isinstance(o, InFlightError) for o in others)
    refused = [o for o in others if isinstance(o, InFlightError)]
    assert len({o.key_hash for o in refused}) == 1 and all(o.retry_after > 0 for o in refused)
    release.set()
    value = await first
    # The first caller gets what every later caller gets: the stored value, decoded.
    assert value == {"charged": 1500, "tags": ["a", "b"]}
    replays = await asyncio.gather(*[handle({"id": "evt_1", "amount": 1500}) for _ in range(50)])
    assert replays == [value] * 50 and runs == 1


async def test_fifty_waiting_calls_get_the_one_value(store: Store) -> None:
    runs = 0

    @once(store, key=lambda event: event["id"], wait_seconds=20)
    async def handle(event: dict[str, Any]) -> dict[str, int]:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.3)
        return {"run": runs}

    values = await asyncio.gather(*[handle({"id": "evt_w"}) for _ in range(50)])
    assert values == [{"run": 1}] * 50 and runs == 1


async def test_an_exception_releases_the_claim_and_the_next_call_runs(store: Store) -> None:
    runs = 0

    @once(store, key=lambda n: n, name="flaky")
    async def flaky(n: int) -> int:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("declined")
        return runs

    with pytest.raises(RuntimeError, match="declined"):
        await flaky(7)
    assert await store.get(claim_key("flaky", "7")) is None
    assert await flaky(7) == 2
    assert await flaky(7) == 2 and runs == 2


async def test_a_cancelled_run_releases_the_claim(store: Store) -> None:
    started = asyncio.Event()
    runs = 0

    @once(store, key=lambda n: n, name="cancelled")
    async def slow(n: int) -> int:
        nonlocal runs
        runs += 1
        started.set()
        await asyncio.sleep(0 if runs > 1 else 60)
        return runs

    task = asyncio.create_task(slow(1))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.get(claim_key("cancelled", "1")) is None  # released before it raised
    assert await slow(1) == 2


async def test_two_functions_with_one_key_are_independent(store: Store) -> None:
    calls: list[str] = []

    @once(store, key=lambda event_id: event_id)
    async def charge(event_id: str) -> str:
        calls.append("charge")
        return "charged"

    @once(store, key=lambda event_id: event_id)
    async def notify(event_id: str) -> str:
        calls.append("notify")
        return "notified"

    @once(store, key=lambda event_id: event_id, name=f"{charge.__module__}.{charge.__qualname__}")
    async def renamed_charge(event_id: str) -> str:
        calls.append("renamed")
        return "never"

    assert await charge("evt_9") == "charged"
    assert await notify("evt_9") == "notified"
    assert await renamed_charge("evt_9") == "charged"  # name= keeps the old function's keys
    assert calls == ["charge", "notify"]


# -- codecs -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Amount:
    cents: int
    currency: str


@dataclasses.dataclass
class Receipt:
    payment_id: str
    amount: Amount
    refund: Amount | None = None


class Charge(BaseModel):
    id: str
    amount: Amount
    captured: bool


class Upper:
    def encode(self, value: Any) -> bytes:
        return str(value).upper().encode()

    def decode(self, data: bytes) -> Any:
        return data.decode()


async def test_values_round_trip_by_codec(store: Store) -> None:
    runs = 0

    @once(store, key=lambda n: n)
    async def receipt(n: int) -> Receipt:
        nonlocal runs
        runs += 1
        return Receipt(f"pay_{n}", Amount(100 * n, "EUR"))

    @once(store, key=lambda n: n)
    async def charge(n: int) -> Charge:
        nonlocal runs
        runs += 1
        return Charge(id=f"ch_{n}", amount=Amount(n, "USD"), captured=True)

    @once(store, key=lambda n: n, codec=Upper())
    async def shout(n: int) -> str:
        nonlocal runs
        runs += 1
        return f"done {n}"

    first = await receipt(3), await charge(3), await shout(3)
    again = await receipt(3), await charge(3), await shout(3)
    assert runs == 3
    assert (
        first
        == again
        == (
            Receipt("pay_3", Amount(300, "EUR")),
            Charge(id="ch_3", amount=Amount(3, "USD"), captured=True),
            "DONE 3",
        )
    )
    assert isinstance(again[0].amount, Amount) and isinstance(again[1], Charge)


async def test_a_value_json_cannot_encode_is_a_type_error_and_releases(store: Store) -> None:
    runs = 0

    @once(store, key=lambda n: n, name="sets")
    async def as_set(n: int) -> Any:
        nonlocal runs
        runs += 1
        return {n} if runs == 1 else [n]

    with pytest.raises(TypeError, match=r"cannot store .*set is not JSON serializable"):
        await as_set(1)
    assert await store.get(claim_key("sets", "1")) is None  # released: nothing was stored
    assert await as_set(1) == [1] and runs == 2


@dataclasses.dataclass
class Refund:
    order: str
    cents: int


class Client:
    """A connection-like argument: context, not the request."""


async def test_a_key_reused_with_other_arguments_raises(store: Store) -> None:
    """The HTTP path answers 422 to a key reused with another body; `once` raises
    KeyReusedError for a key reused with other arguments, and runs nothing. The same call
    spelled otherwise (by keyword, a default given, a whole float, a dict in another order,
    another client object) is the same call."""
    runs: list[int] = []

    @once(store, key=lambda order, *_, **__: order, name="refund")
    async def refund(
        order: str, cents: int, meta: dict[str, Any] | None = None, client: Any = None
    ) -> dict[str, int]:
        runs.append(cents)
        return {"cents": cents}

    meta = {"a": 1, "b": [1, 2]}
    assert await refund("o-1", 500, meta, Client()) == {"cents": 500}
    same = [
        refund("o-1", cents=500, meta={"b": (1, 2), "a": 1.0}, client=Client()),
        refund(order="o-1", cents=500.0, meta=meta, client=Client()),
    ]
    for call in same:
        assert await call == {"cents": 500}
    others = [
        refund("o-1", 999, meta, Client()),
        refund("o-1", 500, {"a": 2, "b": [1, 2]}, Client()),
    ]
    for other in others:
        with pytest.raises(KeyReusedError, match="first used with other arguments") as caught:
            await other
        assert caught.value.key_hash == key_names(b"once", b"refund", b"o-1").hash
    assert runs == [500]

    @once(store, key=lambda refund: refund.order, name="refund-dc")
    async def by_dataclass(refund: Refund) -> int:
        runs.append(refund.cents)
        return refund.cents

    assert await by_dataclass(Refund("o-2", 5)) == await by_dataclass(Refund("o-2", 5)) == 5
    with pytest.raises(KeyReusedError):
        await by_dataclass(Refund("o-2", 6))


async def test_fingerprint_false_returns_the_value_whatever_the_arguments(store: Store) -> None:
    runs: list[int] = []

    @once(store, key=lambda order, attempt: order, name="attempts", fingerprint=False)
    async def deliver(order: str, attempt: int) -> int:
        runs.append(attempt)
        return attempt

    assert await deliver("o-1", 1) == await deliver("o-1", 2) == 1
    assert runs == [1]
    names = key_names(b"once", b"attempts", b"o-1")
    assert await store.get(names.result) == b"GO\x011"  # stored as 0.2.0 stored it
    with pytest.raises(TypeError, match="fingerprint must be True, False, or a function"):
        once(store, key=lambda n: n, fingerprint="no")  # type: ignore[arg-type]


async def test_the_stored_value_is_versioned(store: Store) -> None:
    @once(store, key=lambda n: n, name="versioned")
    async def value(n: int) -> dict[str, int]:
        return {"n": n}

    await value(1)
    names = key_names(b"once", b"versioned", b"1")
    fp = Fingerprint(value.__wrapped__)((1,), {})  # type: ignore[attr-defined]
    assert await store.get(names.result) == b"GO\x03" + fp + b'{"n":1}'
    await store.set(names.result, b'GO\x01{"n":2}', ex=60)  # as 0.2.0 stored it: no fingerprint
    assert await value(1) == {"n": 2}
    await store.set(names.result, b'GO\x09{"n":1}', ex=60)  # a format this version predates
    with pytest.raises(RecordError, match="version this reader knows"):
        await value(1)


async def test_sealed_values_are_bound_to_their_key_and_rotate(store: Store) -> None:
    """With encryption_keys the stored bytes hold no plaintext; a value copied under another
    key does not open and nothing runs again; [new, old] opens old values; a plain value
    stored before encryption was turned on is still read."""
    old, new = b"o" * 32, b"n" * 32
    runs: list[str] = []

    def charge(keys: list[bytes] | None) -> Any:
        @once(store, key=lambda event: event, name="sealed", encryption_keys=keys or [])
        async def run(event: str) -> dict[str, str]:
            runs.append(event)
            return {"card": f"4242-{event}"}

        return run

    sealed_old = charge([old])
    assert await sealed_old("a") == {"card": "4242-a"}
    a = key_names(b"once", b"sealed", b"a")
    raw = await store.get(a.result)
    assert raw is not None and raw.startswith(b"GO\x04") and b"4242" not in raw
    assert await charge([new, old])("a") == {"card": "4242-a"}  # rotation opens old values
    with pytest.raises(RecordError, match="not among the configured keys"):
        await charge([new])("a")
    with pytest.raises(RecordError, match="no encryption_keys"):
        await charge(None)("a")

    b = key_names(b"once", b"sealed", b"b")
    await store.claim(b.claim, b.result, b"moved", 60)
    await store.set(b.result, raw, ex=60)  # a's sealed value, copied under b's key

    @once(store, key=lambda event: "b", name="sealed", encryption_keys=[old])
    async def under_b(event: str) -> dict[str, str]:
        return {}

    with pytest.raises(RecordError, match="does not open"):
        await under_b("a")  # the arguments of a's value, so only the seal can tell

    assert await charge(None)("c") == {"card": "4242-c"}  # in the clear
    assert await charge([new])("c") == {"card": "4242-c"}  # read with keys on
    assert runs == ["a", "c"]


async def test_require_sealed_refuses_a_value_in_the_clear(store: Store) -> None:
    """A value in the clear (stored before keys, or by anyone who can write to the store)
    raises RecordError with require_sealed, and nothing runs; a sealed one is returned."""
    key = b"k" * 32
    runs: list[str] = []

    def charge(keys: list[bytes], **options: bool) -> Any:
        @once(store, key=lambda event: event, name="strict", encryption_keys=keys, **options)
        async def run(event: str) -> dict[str, str]:
            runs.append(event)
            return {"card": f"4242-{event}"}

        return run

    assert await charge([])("plain") == {"card": "4242-plain"}
    forged = key_names(b"once", b"strict", b"forged")
    await store.claim(forged.claim, forged.result, b"x", 60)
    await store.set(forged.result, b'GO\x01{"card":"forged"}', ex=60)
    assert await charge([key])("forged") == {"card": "forged"}  # what the option is for
    strict = charge([key], require_sealed=True)
    for event in ("plain", "forged"):
        with pytest.raises(RecordError, match="in the clear, and require_sealed=True refuses"):
            await strict(event)
    assert await strict("sealed") == await strict("sealed") == {"card": "4242-sealed"}
    assert runs == ["plain", "sealed"]
    with pytest.raises(ValueError, match="no encryption keys are configured"):
        once(store, key=lambda n: n, encryption_keys=[], require_sealed=True)


# -- the lease ----------------------------------------------------------------------------------


async def test_the_lease_is_renewed_for_a_run_of_three_leases(redis_server: Server) -> None:
    store = RedisStore.from_url(redis_server.url)
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    dog = Watchdog.for_store(store)
    runs = 0
    finish = asyncio.Event()

    @once(store, key=lambda n: n, lease_seconds=1, name="long")
    async def long_run(n: int) -> int:
        nonlocal runs
        runs += 1
        for renewals in range(1, 10):  # 3 s: three leases, renewed at a third of each
            await until(lambda n=renewals: dog.renewals >= n, what=f"{renewals} renewals")
            claim = current_claim()
            assert claim is not None and not claim.lost
            await claim.ensure_owned()
        await finish.wait()
        return runs

    task = asyncio.create_task(long_run(1))
    # past two leases: only renewals keep the claim
    await until(lambda: dog.renewals >= 7, what="seven renewals")
    with pytest.raises(InFlightError):
        await long_run(1)
    finish.set()
    assert await task == 1 and dog.renewals >= 5
    assert await long_run(1) == 1 and runs == 1
    await store.aclose()


async def test_a_process_killed_mid_run_is_run_once_more_after_its_lease(
    redis_server: Server,
) -> None:
    store = RedisStore.from_url(redis_server.url)
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    proc = spawn(["-m", f"{APPS}.once_worker", redis_server.url, "evt_k", "60000", "2"], {})
    try:
        await until(lambda: client.exists("runs:evt_k"), timeout=20)
        stop(proc, signal.SIGKILL)  # dies holding the claim
        killed_at = time.monotonic()

        @once(store, key=lambda event: event["id"], lease_seconds=2, name="charge", wait_seconds=15)
        async def charge(event: dict[str, str]) -> dict[str, int]:
            return {"run": int(await client.incr("runs:" + event["id"]))}

        assert await charge({"id": "evt_k"}) == {"run": 2}
        waited = time.monotonic() - killed_at
        assert 0.3 < waited < 6  # taken over when the dead run's lease ran out
        assert await charge({"id": "evt_k"}) == {"run": 2}
        assert await client.get("runs:evt_k") == b"2"
    finally:
        stop(proc)
        await store.aclose()


async def test_a_run_paused_past_its_lease_returns_its_own_value_and_changes_no_other(
    redis_server: Server, tmp_path: Path
) -> None:
    """A process's run is paused (SIGSTOP) past its lease; a call in another process takes
    the lapsed key and stores its value. The paused run resumes and publishes late: its
    caller gets its own value, but the stored one stands and every later call gets it."""
    store = RedisStore.from_url(redis_server.url)
    client = store.client
    assert isinstance(client, redis.asyncio.Redis)
    await client.flushall()
    out = tmp_path / "value.json"
    proc = spawn(["-m", f"{APPS}.once_worker", redis_server.url, "evt_p", "300", "2", str(out)], {})
    paused = False
    try:
        await until(lambda: client.exists("runs:evt_p"), timeout=20)
        os.kill(proc.pid, signal.SIGSTOP)
        paused = True

        async def lapsed() -> bool:
            return await client.exists(claim_key("charge", "evt_p")) == 0

        await until(lapsed, timeout=10)  # the paused run's lease ran out

        @once(store, key=lambda event: event["id"], lease_seconds=2, name="charge")
        async def charge(event: dict[str, str]) -> dict[str, int]:
            return {"run": int(await client.incr("runs:" + event["id"]))}

        assert await charge({"id": "evt_p"}) == {"run": 2}  # the lapsed key, taken over
        os.kill(proc.pid, signal.SIGCONT)
        paused = False
        assert await asyncio.to_thread(proc.wait, 20) == 0
        assert json.loads(out.read_text()) == {"run": 1}  # the late run's caller: its own
        assert await charge({"id": "evt_p"}) == {"run": 2}  # everyone else: the first
        assert await client.get("runs:evt_p") == b"2"
    finally:
        if paused:
            os.kill(proc.pid, signal.SIGCONT)
        stop(proc)
        await store.aclose()


async def test_a_stored_value_wins_over_a_lost_claim(backend: Backend) -> None:
    """The claim vanished (evicted, lost in a restart) while the value stayed: the next call
    returns the value without running, and takes the claim back for the value's TTL."""
    store = backend.store
    runs: list[str] = []

    @once(store, key=lambda event: event, ttl_seconds=600, name="lost")
    async def work(event: str) -> int:
        runs.append(event)
        return len(runs)

    assert await work("e") == 1
    names = key_names(b"once", b"lost", b"e")
    assert await store.delete(names.claim) == 1
    assert await work("e") == 1 and runs == ["e"]
    read_at = time.monotonic()
    result_ttl = await store.pttl(names.result)
    claim_ttl = await store.pttl(names.claim)
    between_ms = (time.monotonic() - read_at) * 1000  # a loaded machine reads slowly
    assert 590_000 < result_ttl <= 600_000
    assert result_ttl - 10 - between_ms <= claim_ttl <= 600_000
    assert await work("e") == 1 and runs == ["e"]


# -- current_claim ------------------------------------------------------------------------------


async def test_ensure_owned_raises_once_the_claim_is_deleted_or_taken(store: Store) -> None:
    steps: list[str] = []
    go = asyncio.Event()

    @once(store, key=lambda case: case, lease_seconds=30, name="owned")
    async def commit(case: str) -> str:
        claim = current_claim()
        assert claim is not None
        await claim.ensure_owned()
        steps.append(f"{case} owned")
        await go.wait()
        await claim.ensure_owned()  # raises: the key was deleted or taken meanwhile
        steps.append(f"{case} committed")
        return case

    for case in ("deleted", "taken"):
        go.clear()
        task = asyncio.create_task(commit(case))
        await until(lambda case=case: f"{case} owned" in steps)
        if case == "deleted":
            await store.delete(claim_key("owned", case))
        else:
            await store.set(claim_key("owned", case), b"another-token", ex=30)
        go.set()
        with pytest.raises(ClaimLostError):
            await task
    assert steps == ["deleted owned", "taken owned"]
    assert await store.get(claim_key("owned", "taken")) == b"another-token"  # not released
    assert current_claim() is None


async def test_lost_turns_true_when_a_renewal_finds_the_claim_gone(store: Store) -> None:
    seen: list[bool] = []

    @once(store, key=lambda n: n, lease_seconds=1, name="lost")
    async def work(n: int) -> int:
        claim = current_claim()
        assert claim is not None
        seen.append(claim.lost)
        await store.delete(claim_key("lost", str(n)))
        await until(lambda: claim.lost, what="the next renewal found the claim gone")
        seen.append(claim.lost)
        await claim.ensure_owned()
        return n

    with pytest.raises(ClaimLostError):
        await work(1)
    assert seen == [False, True]


async def test_current_claim_in_a_handler_run_by_the_middleware(store: Store) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        claim = current_claim()
        seen.append(claim)
        if claim is not None:
            await claim.ensure_owned()
            seen.append(await store.get(key_names(b"idem", b"", b"k1").claim) == claim.token)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k1")).status == 201
    claim = seen[0]
    assert claim is not None and claim.key_hash == key_names(b"idem", b"", b"k1").hash
    assert seen[1] is True
    assert (await request(mw)).status == 201  # no key: no claim
    assert seen[2] is None and current_claim() is None


def test_bad_options_and_objects_with_an_async_call_are_refused() -> None:
    store = MemoryStore()

    class Handler:
        async def __call__(self, n: int) -> int:
            return n

    with pytest.raises(TypeError, match="whose __call__ is async"):
        once(store, key=lambda n: n)(Handler())
    with pytest.raises(TypeError, match=r"RedisStore\.from_url"):
        once("redis://127.0.0.1:1/0", key=lambda n: n)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a store"):
        once(None, key=lambda n: n)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key must be a function"):
        once(store, key="id")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease_seconds must be >= 1"):
        once(store, key=lambda n: n, lease_seconds=0)
    with pytest.raises(ValueError, match="must not contain"):
        once(store, key=lambda n: n, namespace="a{b}")
    with pytest.raises(TypeError, match="codec must have encode"):
        once(store, key=lambda n: n, codec=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wait_seconds"):
        once(store, key=lambda n: n, wait_seconds=-1)


async def test_a_key_of_another_type_is_refused_before_claiming() -> None:
    store = MemoryStore()

    @once(store, key=lambda event: event.get("id"), name="typed")
    async def handle(event: dict[str, Any]) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError, match="must return str, bytes or int, not NoneType"):
        await handle({})


# -- Redis Cluster ------------------------------------------------------------------------------


async def test_cluster_keys_on_every_primary() -> None:
    cluster = start_cluster("redis", masters=3)
    store = RedisStore.from_url(cluster.servers[0].url, cluster=True)
    runs: list[int] = []
    try:

        @once(store, key=lambda n: n, name="spread", wait_seconds=10)
        async def spread(n: int) -> int:
            runs.append(n)
            return n * 2

        events = list(range(30))
        first = await asyncio.gather(*[spread(n) for n in events for _ in range(3)])
        assert first == [n * 2 for n in events for _ in range(3)]
        assert sorted(runs) == events  # one run per key, whichever node holds it
        assert await asyncio.gather(*[spread(n) for n in events]) == [n * 2 for n in events]
        client = store.client
        assert isinstance(client, RedisCluster)
        slots = {
            client.keyslot(key_names(b"once", b"spread", str(n).encode()).claim) for n in events
        }
        assert all(
            client.keyslot(key_names(b"once", b"spread", str(n).encode()).result)
            == client.keyslot(key_names(b"once", b"spread", str(n).encode()).claim)
            for n in events
        )
        holders = []
        for server in cluster.servers:
            with server.sync_client() as r:
                holders.append(r.dbsize())
        assert len(slots) > 3 and all(n > 0 for n in holders)  # spread over all primaries
        assert sum(holders) == 2 * len(events)  # a claim and a result per key
    finally:
        await store.aclose()
        cluster.stop()
