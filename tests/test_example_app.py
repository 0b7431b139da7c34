"""The example app and its demo: in-process on the MemoryStore, and as a real uvicorn
process (on the MemoryStore, and on a throwaway redis-server); its payments and records in
SQLite, so a flushed store still replays from the database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from example_app import create_app
from example_app.app import TEST_WEBHOOK_SECRET, redact, serving
from example_app.demo import FORGER_SECRET, DemoResult, run_demo, standard_webhook_headers
from goblin_idem import MemoryStore
from tests.support.procs import start_example_app, stop
from tests.support.servers import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = "urn:goblin-idem:problem:"

# The order in which the demo's steps happen (retry-while-claimed repeats until the
# dead worker's lease has run out).
SCENARIOS = [
    "first-call",
    "duplicate",
    "other-body",
    "racing-duplicate",
    "slow-first-call",
    "retry-after-slow",
    "dead-worker",
    "retry-while-claimed",
    "retry-after-lease",
    "webhook-forged",
    "webhook-event",
    "webhook-redelivery",
    "order-create",
    "order-update",
    "order-stale",
    "job-busy",
    "job-run",
    "flush-pay",
    "store-flush",
    "replay-after-flush",
    "failed-after-charge",
    "rerun-after-failure",
    "card-charges",
    "ledger",
]


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
async def app() -> AsyncIterator[FastAPI]:
    app = create_app(MemoryStore(), job_lease_ms=150)
    async with serving(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        yield c


def payment(account: str = "acct_1", amount: int = 1500) -> dict[str, object]:
    return {"account": account, "amount_cents": amount, "currency": "EUR"}


def check_demo(result: DemoResult, *, dead_lease_seconds: int = 2) -> None:
    """Every step of the demo, asserted on the raw responses (not only on step.ok)."""
    failed = [(s.scenario, s.status, s.note) for s in result.steps if not s.ok]
    assert not failed
    seen = [s.scenario for s in result.steps]
    assert [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s] == SCENARIOS
    assert [s.at for s in result.steps] == sorted(s.at for s in result.steps)

    first = result.step("first-call")
    assert first.status == 201
    assert "idempotent-replayed" not in first.headers
    assert first.headers["location"] == f"/payments/{first.json()['id']}"
    assert first.json()["amount_cents"] == 1500

    dup = result.step("duplicate")
    assert (dup.status, dup.headers["idempotent-replayed"]) == (201, "true")
    assert dup.body == first.body
    assert dup.headers["location"] == first.headers["location"]

    other = result.step("other-body")
    assert other.status == 422
    assert other.json()["type"] == PROBLEM + "key-reused"

    assert first.attempts == dup.attempts == other.attempts == 1

    # The racer's 409s while the slow call runs: one, or more on a machine so loaded that
    # the slow call outlasts a Retry-After.
    racers = result.all("racing-duplicate")
    assert [r.attempts for r in racers] == list(range(1, len(racers) + 1))
    assert all(r.status == 409 and r.headers["retry-after"] == "1" for r in racers)
    assert all(r.json()["type"] == PROBLEM + "in-flight" for r in racers)
    racer = racers[0]
    slow = result.step("slow-first-call")
    assert slow.status == 201 and "idempotent-replayed" not in slow.headers
    assert slow.json()["amount_cents"] == 2500
    assert racer.at < slow.at
    replay = result.step("retry-after-slow")
    assert (replay.status, replay.headers["idempotent-replayed"]) == (201, "true")
    assert replay.body == slow.body
    # the transport waited Retry-After and sent the racer again: one call, one more attempt
    assert (slow.attempts, replay.attempts) == (1, len(racers) + 1)
    assert replay.at - racer.at >= int(racer.headers["retry-after"]) - 0.05

    dead = result.step("dead-worker")
    assert dead.status == 200
    assert dead.json()["token"].startswith("dead-worker:")
    blocked = result.all("retry-while-claimed")
    assert blocked
    assert all(s.status == 409 and s.headers["retry-after"] == "1" for s in blocked)
    assert [s.attempts for s in blocked] == list(range(1, len(blocked) + 1))
    recovered = result.step("retry-after-lease")
    assert recovered.status == 201 and "idempotent-replayed" not in recovered.headers
    assert recovered.attempts == len(blocked) + 1
    assert recovered.json()["amount_cents"] == 700
    assert recovered.at - dead.at >= dead_lease_seconds - 0.1

    assert result.step("webhook-forged").status == 401
    assert result.step("webhook-forged").json()["type"] == PROBLEM + "webhook-unverified"
    event = result.step("webhook-event")
    assert event.status == 200 and event.json()["processed"] == "charged"
    redelivery = result.step("webhook-redelivery")
    assert redelivery.status == 200 and redelivery.headers["idempotent-replayed"] == "true"
    assert redelivery.body == event.body

    created = result.step("order-create")
    updated = result.step("order-update")
    stale = result.step("order-stale")
    assert (created.status, updated.status, stale.status) == (201, 200, 412)
    assert created.headers["etag"] != updated.headers["etag"]
    assert stale.headers["etag"] == updated.headers["etag"]
    assert 0 < updated.json()["ttl_ms"] <= created.json()["ttl_ms"]
    assert updated.json()["version"] == 2 and updated.json()["quantity"] == 2

    assert result.step("job-busy").status == 409
    job = result.step("job-run")
    assert job.status == 200 and job.json()["lock_lost"] is False

    paid = result.step("flush-pay")
    assert paid.status == 201 and "idempotent-replayed" not in paid.headers
    assert result.step("store-flush").json()["flushed_keys"] > 0
    again = result.step("replay-after-flush")
    assert (again.status, again.headers["idempotent-replayed"]) == (201, "true")
    assert again.body == paid.body and again.headers["location"] == paid.headers["location"]

    # A first run that failed after the card processor charged, retried by the transport:
    # the processor charged once for it, and once for each other payment (webhooks: none).
    failure = result.step("failed-after-charge")
    assert failure.status == 500 and failure.attempts == 1
    rerun = result.step("rerun-after-failure")
    assert rerun.status == 201 and "idempotent-replayed" not in rerun.headers
    assert rerun.attempts == 2 and rerun.json()["amount_cents"] == 1100
    card = result.step("card-charges").json()["charges"]
    assert sorted(c["amount_cents"] for c in card) == [700, 900, 1100, 1500, 2500]

    # The ledger: each key charged once, by the very payment its response announced.
    ledger = result.step("ledger")
    assert ledger.status == 200
    doc = result.ledger
    assert doc["balances"] == {"EUR": 1500 + 2500 + 700 + 1200 + 900 + 1100}
    assert doc["payments"] == 6
    by_key = doc["by_key"]
    assert {k: len(v) for k, v in by_key.items()} == dict.fromkeys(result.charges, 1)
    assert by_key[first.key or ""] == [first.json()["id"]]
    assert by_key[slow.key or ""] == [slow.json()["id"]]
    assert by_key[recovered.key or ""] == [recovered.json()["id"]]
    assert by_key[event.key or ""] == [event.json()["payment"]["id"]]
    assert by_key[paid.key or ""] == [paid.json()["id"]]
    assert by_key[rerun.key or ""] == [rerun.json()["id"]]


@pytest.fixture
def app_process(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`python -m example_app` as a newcomer runs it: the embedded store, default settings."""
    port = free_port()
    log = tmp_path / "app.log"
    proc = start_example_app(port, log)
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        stop(proc)


# -- the demo --------------------------------------------------------------------------------


async def test_demo_in_process(app: FastAPI, client: httpx.AsyncClient) -> None:
    printed: list[str] = []
    started: list[dict[str, str]] = []
    result = await run_demo(
        httpx.ASGITransport(app=app),
        "http://app",
        on_start=lambda r: started.append(dict(r.store)),
        on_step=lambda s: printed.append(s.scenario),
    )
    check_demo(result)
    assert printed == [s.scenario for s in result.steps]
    assert started == [{"kind": "memory", "mode": "embedded"}]
    stats = (await client.get("/stats")).json()
    assert stats["store"] == {"kind": "memory", "mode": "embedded"}
    counters = stats["middleware"]
    # first, slow, after the dead lease, webhook, before the flush, and both runs of the
    # payment that failed after the card was charged
    assert counters["claimed"] == 7
    assert counters["replayed"] == 4  # the last one from the database
    assert counters["mismatch"] == 1 and counters["missing_key"] == 0
    assert counters["webhook_refused"] == 1  # the forged delivery, before any claim
    in_flight = result.all("racing-duplicate") + result.all("retry-while-claimed")
    assert counters["in_flight"] == len(in_flight)


async def test_demo_against_uvicorn_on_redis(redis_server: Server, tmp_path: Path) -> None:
    with redis_server.sync_client() as r:
        r.flushall()
    port = free_port()
    log = tmp_path / "app.log"
    proc = start_example_app(port, log, REDIS_URL=redis_server.url, GOBLIN_LEASE_SECONDS="2")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            stats = (await c.get("/stats")).json()
            assert stats["store"] == {"kind": "redis", "mode": "script"}
            assert stats["config"]["lease_seconds"] == 2
        result = await run_demo(httpx.AsyncHTTPTransport(), f"http://127.0.0.1:{port}")
        check_demo(result)
        # The payments are in the database; redis was flushed before the flushed payment's
        # replay, which published its record back from the database, and the payment that
        # failed after the card was charged.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            assert (await c.get("/ledger")).json()["payments_total"] == 6
        with redis_server.sync_client() as r:
            assert r.keys("ledger:*") == []
            assert len(r.keys("idem:{*}:r")) == 2
    finally:
        stop(proc)
    lines = [line for line in log.read_text().splitlines() if "example_app: store=" in line]
    assert len(lines) == 1
    assert f"store=redis at {redis_server.url} mode=script lease=2s" in lines[0]


def test_app_starts_and_demo_cli_passes(app_process: tuple[str, Path]) -> None:
    url, log = app_process
    stats = httpx.get(f"{url}/stats", timeout=5).json()
    assert stats["store"] == {"kind": "memory", "mode": "embedded"}
    assert "example_app: store=memory mode=embedded lease=30s" in log.read_text()
    demo = subprocess.run(
        [sys.executable, "-m", "example_app.demo", "--url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    lines = demo.stdout.splitlines()
    assert lines[0] == f"demo against {url} (store: memory, mode embedded)"
    assert lines[-1].startswith("all ") and lines[-1].endswith(" steps as expected")
    steps = lines[1:-1]
    assert len(steps) >= len(SCENARIOS)
    assert all("  ok  " in line for line in steps)
    assert "one per key (the flushed one too); balance 7900 (expected 7900)" in steps[-1]


# -- the store flushed: the database replays ---------------------------------------------------


def pay_once(url: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/payments", json=payment("acct_f", 900), headers={"Idempotency-Key": key}, timeout=10
    )


def one_charge(url: str, first: httpx.Response) -> None:
    doc = httpx.get(f"{url}/ledger?account=acct_f", timeout=10).json()
    assert doc["accounts"] == {
        "acct_f": {"balances": {"EUR": 900}, "payments": 1, "by_key": {"k1": [first.json()["id"]]}}
    }
    assert doc["duplicate_charges"] == {}


def test_a_flushed_store_replays_from_the_database(tmp_path: Path) -> None:
    """`python -m example_app` as a newcomer runs it (its default SQLite file): a payment,
    the store flushed, the same request: the response committed with the charge is replayed
    from the database, and nothing is charged twice. The file goes when the app stops."""
    port = free_port()
    log = tmp_path / "app.log"
    proc = start_example_app(port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        first = pay_once(url, "k1")
        assert first.status_code == 201 and "idempotent-replayed" not in first.headers
        flushed = httpx.post(f"{url}/demo/flush-store", timeout=10)
        assert flushed.status_code == 200 and flushed.json()["store"] == "memory"
        assert flushed.json()["flushed_keys"] > 0
        again = pay_once(url, "k1")
        assert (again.status_code, again.headers["idempotent-replayed"]) == (201, "true")
        assert again.content == first.content
        assert again.headers["location"] == first.headers["location"]
        one_charge(url, first)
        counters = httpx.get(f"{url}/stats", timeout=10).json()["middleware"]
        assert (counters["claimed"], counters["replayed"]) == (1, 1)
    finally:
        stop(proc)
    text = log.read_text()
    assert "goblin-idem records: table goblin_idem_records in sqlite+aiosqlite:///" in text
    (line,) = [ln for ln in text.splitlines() if "example_app: payments and records in " in ln]
    database = Path(line.split("sqlite+aiosqlite:///", 1)[1].strip())
    assert database.name.startswith("goblin-idem-example-") and database.suffix == ".db"
    assert not database.exists()  # removed at shutdown


def test_a_database_of_your_own_replays_after_a_restart(tmp_path: Path) -> None:
    """With GOBLIN_DATABASE_URL naming a file, a restart (a new, empty MemoryStore) is a
    store that lost everything: the payment's replay comes from the file."""
    database = tmp_path / "example.db"
    env = {"GOBLIN_DATABASE_URL": f"sqlite+aiosqlite:///{database}"}
    first: httpx.Response | None = None
    for run in range(2):
        port = free_port()
        proc = start_example_app(port, tmp_path / f"app{run}.log", **env)
        url = f"http://127.0.0.1:{port}"
        try:
            response = pay_once(url, "k1")
            if first is None:
                first = response
                assert response.status_code == 201
                assert "idempotent-replayed" not in response.headers
            else:
                assert response.headers["idempotent-replayed"] == "true"
                assert response.content == first.content
                one_charge(url, first)
        finally:
            stop(proc)
    assert database.exists()


async def test_without_sql_records_a_flushed_store_charges_again() -> None:
    """What the records in the database prevent: with the store alone, a key whose stored
    response was lost runs again, and charges again."""
    app = create_app(MemoryStore(), sql_records=False)
    async with serving(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            headers = {"Idempotency-Key": "k1"}
            first = await c.post("/payments", json=payment("acct_f", 900), headers=headers)
            assert (await c.post("/demo/flush-store")).status_code == 200
            again = await c.post("/payments", json=payment("acct_f", 900), headers=headers)
            assert (first.status_code, again.status_code) == (201, 201)
            assert "idempotent-replayed" not in again.headers
            doc = (await c.get("/ledger?account=acct_f")).json()
    assert doc["accounts"]["acct_f"]["payments"] == 2
    assert doc["duplicate_charges"] == {"acct_f/k1": [first.json()["id"], again.json()["id"]]}


def failed_start(tmp_path: Path, **env: str) -> tuple[int, str]:
    """`python -m example_app` whose startup fails: its PID and what it wrote."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "GOBLIN_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "example_app", "--port", str(free_port())],
        cwd=ROOT,
        env={**full_env, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode != 0
    return proc.pid, out.decode()


def test_a_database_that_cannot_be_used_fails_the_startup(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "example.db"
    _, out = failed_start(tmp_path, GOBLIN_DATABASE_URL=f"sqlite+aiosqlite:///{missing}")
    assert f"example_app: cannot create the tables in sqlite+aiosqlite:///{missing}" in out


def test_a_failed_startup_leaves_no_database_file(tmp_path: Path) -> None:
    """A store the middleware cannot reach fails the startup before the app's own (which
    makes the tables): no temporary database is left behind."""
    pid, out = failed_start(tmp_path, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    assert "Application startup failed" in out
    assert list(Path(tempfile.gettempdir()).glob(f"goblin-idem-example-{pid}-*")) == []


# -- the routes, one behaviour at a time -------------------------------------------------------


async def test_concurrent_duplicates_charge_once(client: httpx.AsyncClient) -> None:
    responses = await asyncio.gather(
        *(
            client.post(
                "/payments?delay_ms=200", json=payment("acct_c"), headers={"Idempotency-Key": "k"}
            )
            for _ in range(20)
        )
    )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [409] * 19
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 409)
    ledger = (await client.get("/ledger?account=acct_c")).json()
    assert ledger["accounts"]["acct_c"]["balances"] == {"EUR": 1500}
    assert ledger["payments_total"] == 1
    assert ledger["duplicate_charges"] == {}


async def test_payments_without_key_are_not_deduplicated(client: httpx.AsyncClient) -> None:
    a = await client.post("/payments", json=payment("acct_n"))
    b = await client.post("/payments", json=payment("acct_n"))
    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["id"] != b.json()["id"]
    got = await client.get(a.headers["location"])
    assert got.status_code == 200 and got.json() == a.json()
    doc = (await client.get("/ledger?account=acct_n")).json()["accounts"]["acct_n"]
    assert doc["balances"] == {"EUR": 3000} and doc["by_key"] == {}


async def test_invalid_payment_is_refused_and_not_charged(client: httpx.AsyncClient) -> None:
    r = await client.post("/payments", json=payment(amount=0), headers={"Idempotency-Key": "z"})
    assert r.status_code == 422
    r = await client.post(
        "/payments?delay_ms=10001", json=payment(), headers={"Idempotency-Key": "y"}
    )
    assert r.status_code == 422
    assert (await client.get("/ledger")).json()["payments_total"] == 0


async def test_webhook_rules(client: httpx.AsyncClient) -> None:
    """The webhook route is a Standard Webhooks receiver: unsigned or forged deliveries are
    refused before anything runs; a verified one runs once per webhook-id."""
    charge = json.dumps({"id": "evt_1", "type": "charge", "data": payment("acct_w", 300)})
    body = charge.encode()
    now = int(time.time())
    r = await client.post("/webhooks/acme", content=body, headers={"webhook-id": "msg_1"})
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == PROBLEM + "webhook-unverified"
    forged = standard_webhook_headers("msg_1", now, body, FORGER_SECRET)
    assert (await client.post("/webhooks/acme", content=body, headers=forged)).status_code == 401
    no_id = standard_webhook_headers("", now, body, TEST_WEBHOOK_SECRET)
    r = await client.post("/webhooks/acme", content=body, headers=no_id)
    assert r.status_code == 400 and r.json()["type"] == PROBLEM + "webhook-malformed"
    other = json.dumps({"id": "evt_3", "type": "refund", "data": {}}).encode()
    signed = standard_webhook_headers("msg_3", now, other, TEST_WEBHOOK_SECRET)
    r = await client.post("/webhooks/acme", content=other, headers=signed)
    assert r.status_code == 200 and r.json()["processed"] == "ignored"
    for n in range(3):  # redeliveries, each signed afresh
        signed = standard_webhook_headers("msg_1", now + n, body, TEST_WEBHOOK_SECRET)
        r = await client.post("/webhooks/acme", content=body, headers=signed)
        assert r.status_code == 200
        assert (r.headers.get("idempotent-replayed") == "true") == (n > 0)
    doc = (await client.get("/ledger?account=acct_w")).json()["accounts"]["acct_w"]
    assert doc["balances"] == {"EUR": 300} and doc["by_key"] == {"msg_1": ["pay_000001"]}


async def test_order_if_match_and_ttl(client: httpx.AsyncClient) -> None:
    created = await client.post("/orders", json={"item": "w", "quantity": 1, "ttl_seconds": 60})
    assert created.status_code == 201
    path, etag = created.headers["location"], created.headers["etag"]
    assert 59_000 < created.json()["ttl_ms"] <= 60_000

    r = await client.patch(path, json={"quantity": 2})
    assert r.status_code == 428
    r = await client.patch(path, json={"quantity": 2}, headers={"If-Match": f"W/{etag}"})
    assert r.status_code == 412 and r.headers["etag"] == etag  # a weak tag never matches
    r = await client.patch(path, json={"quantity": 2}, headers={"If-Match": f'"x", {etag}'})
    assert r.status_code == 200
    etag2 = r.headers["etag"]
    assert etag2 != etag and r.json()["quantity"] == 2
    r = await client.patch(path, json={"status": "paid"}, headers={"If-Match": "*"})
    assert r.status_code == 200 and r.json()["version"] == 3
    # CAS kept the TTL given at creation: it only ran down, it was never dropped or reset.
    got = await client.get(path)
    assert got.headers["etag"] == r.headers["etag"]
    assert 0 < got.json()["ttl_ms"] <= created.json()["ttl_ms"]
    assert (
        await client.patch("/orders/ord_nope", json={}, headers={"If-Match": "*"})
    ).status_code == 404


async def test_order_expires_with_its_ttl() -> None:
    store = MemoryStore()
    app = create_app(store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        created = await c.post("/orders", json={"item": "w", "quantity": 1, "ttl_seconds": 1})
        path = created.headers["location"]
        r = await c.patch(path, json={"quantity": 5}, headers={"If-Match": created.headers["etag"]})
        assert r.status_code == 200
        await asyncio.sleep(1.05)  # the update did not extend the 1 s TTL
        assert (await c.get(path)).status_code == 404


async def test_job_lock_is_renewed_and_exclusive(client: httpx.AsyncClient) -> None:
    first = asyncio.ensure_future(client.post("/jobs/nightly?duration_ms=600"))
    await asyncio.sleep(0.1)
    busy = await client.post("/jobs/nightly?duration_ms=600")
    assert busy.status_code == 409
    assert busy.json()["type"] == "urn:example-app:problem:job-running"
    done = await first
    # 600 ms under a 150 ms lease: only the watchdog's renewals kept it.
    assert done.status_code == 200 and done.json() == {
        "job": "nightly",
        "ran_ms": done.json()["ran_ms"],
        "lease_ms": 150,
        "lock_lost": False,
    }
    assert done.json()["ran_ms"] >= 600
    stats = (await client.get("/stats")).json()
    assert stats["watchdog"]["renewals"] >= 3
    assert stats["watchdog"]["lost"] == 0
    again = await client.post("/jobs/nightly?duration_ms=0")
    assert again.status_code == 200  # released at the end of the run


async def test_dead_worker_route(client: httpx.AsyncClient) -> None:
    r = await client.post("/demo/dead-worker", json={"key": "dw", "lease_seconds": 1})
    assert r.status_code == 200 and r.json()["lease_seconds"] == 1
    again = await client.post("/demo/dead-worker", json={"key": "dw"})
    assert again.status_code == 409
    blocked = await client.post("/payments", json=payment(), headers={"Idempotency-Key": "dw"})
    assert blocked.status_code == 409 and blocked.json()["type"] == PROBLEM + "in-flight"
    # Another caller (another Authorization) has its own key space.
    other = await client.post(
        "/payments", json=payment(), headers={"Idempotency-Key": "dw", "Authorization": "Bearer b"}
    )
    assert other.status_code == 201
    off = create_app(demo_routes=False)
    transport = httpx.ASGITransport(app=off)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        assert (await c.post("/demo/dead-worker", json={"key": "x"})).status_code == 404


def test_startup_log_never_shows_a_password() -> None:
    assert redact("redis://:s3cret@127.0.0.1:6380/0") == "redis://:***@127.0.0.1:6380/0"
    assert redact("redis://app:s3cret@db:6380/2") == "redis://app:***@db:6380/2"
    assert redact("redis://127.0.0.1:6380/0") == "redis://127.0.0.1:6380/0"
