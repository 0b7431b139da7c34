"""`python -m example_app.demo [--url URL]`: what the middleware does, one line per step.

Without ``--url`` the demo starts the app in this process (embedded MemoryStore) and talks
to it through httpx's ASGI transport; with ``--url`` it drives a running app, e.g.
``python -m example_app`` (on the MemoryStore, or on Redis with ``REDIS_URL``).

Its client calls go through `goblin_idem.client.AsyncIdempotentTransport`, as a real client's
would: a 409 for a duplicate in flight is waited out and retried by the transport, and each
409 it retries is shown as a step (from its ``on_retry`` hook). The demo names every key
itself (``auto_key=False``), so that the timeline can show them and so that its requests
without a key reach the app without one.

The scenarios: a first call and its duplicate; a duplicate racing a slow first call; the
same key with another body; a worker that dies holding a claim; a signed webhook (a
forged delivery refused before it claims anything, the genuine one, its redelivery); a
stale If-Match; two starts of one job; a payment whose key the store then loses (flushed),
replayed from the database; a payment whose first run fails after the card processor
charged, run again by the transport's retry and charged once at the processor; and the
ledger, which must show one charge per key.

Each run uses fresh keys and a fresh account, so it can be repeated against one server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from goblin_idem.client import AsyncIdempotentTransport, RetryEvent, RetryPolicy

__all__ = ["DemoResult", "Step", "format_step", "main", "run_demo"]

PROBLEM = "urn:goblin-idem:problem:"
CURRENCY = "EUR"
# Enough attempts to wait out the dead worker's lease at Retry-After: 1.
POLICY = RetryPolicy(max_attempts=10, deadline=30.0)
# A forger's guess at the webhook route's secret (the app's is app.TEST_WEBHOOK_SECRET).
FORGER_SECRET = "whsec_" + base64.b64encode(b"a forger's guess at the secret").decode()


@dataclass
class Step:
    """One request of the demo and whether its response was what the scenario expects."""

    scenario: str  # a stable id, e.g. "duplicate"
    method: str
    path: str
    key: str | None
    status: int
    ok: bool
    note: str  # what happened, for the timeline
    at: float  # seconds since the demo started, when the response arrived
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    attempts: int = 1  # the transport's attempt that got this response

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class DemoResult:
    account: str
    store: dict[str, str] = field(default_factory=dict)  # GET /stats: the store's kind and mode
    steps: list[Step] = field(default_factory=list)
    charges: dict[str, int] = field(default_factory=dict)  # Idempotency-Key -> amount charged
    ledger: dict[str, Any] = field(default_factory=dict)  # GET /ledger?account=... at the end

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)

    def all(self, scenario: str) -> list[Step]:
        return [step for step in self.steps if step.scenario == scenario]

    def step(self, scenario: str) -> Step:
        """The last step of `scenario`."""
        found = self.all(scenario)
        if not found:
            raise KeyError(scenario)
        return found[-1]


def format_step(step: Step) -> str:
    mark = "ok  " if step.ok else "FAIL"
    request = f"{step.method} {step.path}"
    key = f"key={step.key}" if step.key else ""
    return f"{step.at:6.2f}s  {mark}  {step.status}  {request:<40} {key:<24} {step.note}"


# What a retried response of one key is recorded as: its scenario, and whether it is what
# the scenario expects with a note for the timeline.
RetryView = tuple[str, Callable[[httpx.Response], tuple[bool, str]]]


class _Recorder:
    def __init__(self, result: DemoResult, on_step: Callable[[Step], None] | None) -> None:
        self.result = result
        self.on_step = on_step
        self.t0 = time.monotonic()
        self.arrived: dict[int, float] = {}  # id(response) -> when it arrived
        self.retries: dict[str, RetryView] = {}  # key -> how its retried responses show
        self.client: httpx.AsyncClient  # set by run_demo

    def on_retry(self, event: RetryEvent) -> None:
        """The transport's hook: a response it discards to retry becomes a step."""
        view = self.retries.get(event.key)
        if view is None or event.response is None:
            return
        scenario, judge = view
        ok, note = judge(event.response)
        self.arrived[id(event.response)] = time.monotonic() - self.t0
        self.record(
            scenario, event.response, key=event.key, ok=ok, note=note, attempt=event.attempt
        )

    async def send(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        all_headers = dict(headers or {})
        if key is not None:
            all_headers["Idempotency-Key"] = key
        if content is not None:  # bytes as signed
            response = await self.client.request(method, path, content=content, headers=all_headers)
        else:
            response = await self.client.request(method, path, json=body, headers=all_headers)
        self.arrived[id(response)] = time.monotonic() - self.t0
        return response

    def record(
        self,
        scenario: str,
        response: httpx.Response,
        *,
        key: str | None,
        ok: bool,
        note: str,
        attempt: int | None = None,
    ) -> Step:
        request = response.request
        path = request.url.raw_path.decode()
        step = Step(
            scenario=scenario,
            method=request.method,
            path=path,
            key=key,
            status=response.status_code,
            ok=ok,
            note=note,
            at=self.arrived.pop(id(response), time.monotonic() - self.t0),
            headers={k.lower(): v for k, v in response.headers.items()},
            body=response.content,
            attempts=_attempts(response) if attempt is None else attempt,
        )
        self.result.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
        return step


def standard_webhook_headers(msg_id: str, stamp: int, body: bytes, secret: str) -> dict[str, str]:
    """A Standard Webhooks sender's headers: the base64 HMAC-SHA256, under the secret after
    ``whsec_`` (base64), of ``id.timestamp.body``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


def _problem_type(response: httpx.Response) -> str:
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return ""
    try:
        return str(response.json().get("type", ""))
    except ValueError:
        return ""


def _replayed(response: httpx.Response) -> bool:
    return bool(response.headers.get("idempotent-replayed") == "true")


def _attempts(response: httpx.Response) -> int:
    return int(response.extensions.get("idempotency", {}).get("attempts", 1))


def _in_flight(response: httpx.Response) -> bool:
    return (
        response.status_code == 409
        and response.headers.get("retry-after") is not None
        and _problem_type(response) == PROBLEM + "in-flight"
    )


async def run_demo(
    transport: httpx.AsyncBaseTransport,
    base_url: str,
    *,
    run_id: str | None = None,
    slow_ms: int = 1200,
    head_start: float = 0.3,
    dead_lease_seconds: int = 2,
    job_ms: int = 1200,
    on_start: Callable[[DemoResult], None] | None = None,
    on_step: Callable[[Step], None] | None = None,
) -> DemoResult:
    """Run every scenario against the app that `transport` reaches at `base_url`; each
    response becomes a Step. The client wraps `transport` in an AsyncIdempotentTransport,
    and closes it at the end.

    `on_start` sees the result once the app's store is known, `on_step` each step as it is
    recorded (the command line prints them). The app needs its demo routes (a dead worker,
    a store flush). The run takes about slow_ms + dead_lease_seconds + job_ms, plus a second
    of Retry-After waits.
    """
    run_id = run_id or secrets.token_hex(3)
    account = f"acct_{run_id}"
    result = DemoResult(account)
    rec = _Recorder(result, on_step)
    keyed = AsyncIdempotentTransport(
        transport, policy=POLICY, auto_key=False, on_retry=rec.on_retry
    )
    async with httpx.AsyncClient(transport=keyed, base_url=base_url, timeout=30) as client:
        rec.client = client
        result.store = (await client.get("/stats")).json()["store"]
        if on_start is not None:
            on_start(result)
        await _scenarios(rec, run_id, slow_ms, head_start, dead_lease_seconds, job_ms)
    return result


async def _scenarios(
    rec: _Recorder,
    run_id: str,
    slow_ms: int,
    head_start: float,
    dead_lease_seconds: int,
    job_ms: int,
) -> None:
    result = rec.result
    account = result.account

    def payment(amount: int) -> dict[str, Any]:
        return {"account": account, "amount_cents": amount, "currency": CURRENCY}

    # 1. First call: the key is claimed and the handler runs.
    key = f"demo-{run_id}-first"
    first = await rec.send("POST", "/payments", key=key, body=payment(1500))
    location = first.headers.get("location", "")
    rec.record(
        "first-call",
        first,
        key=key,
        ok=first.status_code == 201 and location.startswith("/payments/") and not _replayed(first),
        note=f"claimed and ran: {location or 'no Location'} charged 1500",
    )
    result.charges[key] = 1500

    # 2. Duplicate: the stored response, byte for byte, marked as a replay.
    dup = await rec.send("POST", "/payments", key=key, body=payment(1500))
    same = dup.content == first.content and dup.headers.get("location") == location
    rec.record(
        "duplicate",
        dup,
        key=key,
        ok=dup.status_code == 201 and _replayed(dup) and same,
        note=f"replayed (Idempotent-Replayed: true), {'same' if same else 'DIFFERENT'} bytes",
    )

    # 3. Same key, another body: refused, nothing runs.
    other = await rec.send("POST", "/payments", key=key, body=payment(9999))
    rec.record(
        "other-body",
        other,
        key=key,
        ok=other.status_code == 422 and _problem_type(other) == PROBLEM + "key-reused",
        note=f"refused: {_problem_type(other) or 'no problem type'}",
    )

    # 4. A duplicate racing a slow first call: 409 + Retry-After while it runs; the
    # transport waits that long and retries, and gets the replay.
    key = f"demo-{run_id}-slow"
    path = f"/payments?delay_ms={slow_ms}"

    def racing(racer: httpx.Response) -> tuple[bool, str]:
        retry_after = racer.headers.get("retry-after")
        return _in_flight(racer), f"in flight: Retry-After: {retry_after}, nothing run"

    rec.retries[key] = ("racing-duplicate", racing)
    slow_task = asyncio.ensure_future(rec.send("POST", path, key=key, body=payment(2500)))
    await asyncio.sleep(head_start)
    racer = await rec.send("POST", path, key=key, body=payment(2500))
    slow = await slow_task
    if _replayed(
        slow
    ):  # the later-sent request reached the server first, so it is the one that ran
        slow, racer = racer, slow
    rec.record(
        "slow-first-call",
        slow,
        key=key,
        ok=slow.status_code == 201 and not _replayed(slow) and _attempts(slow) == 1,
        note=f"the slow call finished after {slow_ms} ms and charged 2500 once",
    )
    result.charges[key] = 2500
    rec.record(
        "retry-after-slow",
        racer,
        key=key,
        ok=racer.status_code == 201
        and _replayed(racer)
        and racer.content == slow.content
        and _attempts(racer) == 1 + len(result.all("racing-duplicate")),
        note=f"the transport retried after Retry-After: the replay (attempts: {_attempts(racer)})",
    )

    # 5. A worker dies holding the claim: 409 until its lease runs out, then one run. The
    # transport keeps retrying after each Retry-After until then.
    key = f"demo-{run_id}-dead"
    dead = await rec.send(
        "POST", "/demo/dead-worker", body={"key": key, "lease_seconds": dead_lease_seconds}
    )
    claimed_at = time.monotonic()
    rec.record(
        "dead-worker",
        dead,
        key=key,
        ok=dead.status_code == 200,
        note=f"a worker claims the key ({dead_lease_seconds} s lease) and dies before charging",
    )

    def claimed(retry: httpx.Response) -> tuple[bool, str]:
        waited = time.monotonic() - claimed_at
        retry_after = retry.headers.get("retry-after")
        note = f"still claimed by the dead worker ({waited:.1f} s); Retry-After: {retry_after}"
        return _in_flight(retry), note

    rec.retries[key] = ("retry-while-claimed", claimed)
    retry = await rec.send("POST", "/payments", key=key, body=payment(700))
    waited = time.monotonic() - claimed_at
    blocked = len(result.all("retry-while-claimed"))
    rec.record(
        "retry-after-lease",
        retry,
        key=key,
        ok=retry.status_code == 201
        and not _replayed(retry)
        and blocked > 0
        and _attempts(retry) == 1 + blocked
        and waited >= dead_lease_seconds - 0.05,
        note=f"the lease expired ({waited:.1f} s after the claim): attempt {_attempts(retry)} "
        "ran, charged 700",
    )
    result.charges[key] = 700

    # 6. Webhooks: Standard Webhooks deliveries, signed; the webhook-id is the key.
    from .app import TEST_WEBHOOK_SECRET  # the test secret, published with the app

    event_id = f"msg_{run_id}"
    event = json.dumps({"id": event_id, "type": "charge", "data": payment(1200)}).encode()
    now = int(time.time())
    forged = await rec.send(
        "POST",
        "/webhooks/acme",
        content=event,
        headers=standard_webhook_headers(event_id, now, event, FORGER_SECRET),
    )
    rec.record(
        "webhook-forged",
        forged,
        key=None,
        ok=forged.status_code == 401 and _problem_type(forged) == PROBLEM + "webhook-unverified",
        note="a forged signature with the event's id: refused, nothing claimed",
    )
    signed = standard_webhook_headers(event_id, now, event, TEST_WEBHOOK_SECRET)
    delivery = await rec.send("POST", "/webhooks/acme", content=event, headers=signed)
    rec.record(
        "webhook-event",
        delivery,
        key=event_id,
        ok=delivery.status_code == 200 and not _replayed(delivery),
        note="verified and processed: charged 1200",
    )
    result.charges[event_id] = 1200
    resigned = standard_webhook_headers(event_id, now + 1, event, TEST_WEBHOOK_SECRET)
    redelivery = await rec.send("POST", "/webhooks/acme", content=event, headers=resigned)
    rec.record(
        "webhook-redelivery",
        redelivery,
        key=event_id,
        ok=redelivery.status_code == 200
        and _replayed(redelivery)
        and redelivery.content == delivery.content,
        note="the provider redelivers, signed afresh: replayed, not processed again",
    )

    # 7. Orders: If-Match with compare-and-set; the TTL set at creation is kept.
    created = await rec.send("POST", "/orders", body={"item": "widget", "quantity": 1})
    etag1 = created.headers.get("etag", "")
    ttl1 = created.json().get("ttl_ms", -2) if created.status_code == 201 else -2
    rec.record(
        "order-create",
        created,
        key=None,
        ok=created.status_code == 201 and bool(etag1) and ttl1 > 0,
        note=f"ETag {etag1}, ttl_ms {ttl1}",
    )
    order_path = created.headers.get("location", "/orders/missing")
    updated = await rec.send("PATCH", order_path, body={"quantity": 2}, headers={"If-Match": etag1})
    etag2 = updated.headers.get("etag", "")
    ttl2 = updated.json().get("ttl_ms", -2) if updated.status_code == 200 else -2
    rec.record(
        "order-update",
        updated,
        key=None,
        ok=updated.status_code == 200 and etag2 not in ("", etag1) and 0 < ttl2 <= ttl1,
        note=f"If-Match {etag1} matched: ETag {etag2}, ttl_ms {ttl2} (TTL kept)",
    )
    stale = await rec.send("PATCH", order_path, body={"quantity": 3}, headers={"If-Match": etag1})
    rec.record(
        "order-stale",
        stale,
        key=None,
        ok=stale.status_code == 412 and stale.headers.get("etag") == etag2,
        note=f"If-Match {etag1} is stale: current ETag {stale.headers.get('etag')}",
    )

    # 8. Jobs: a Lock (renewed by the watchdog) lets one start of a job run at a time.
    job_path = f"/jobs/report-{run_id}?duration_ms={job_ms}"

    def record_busy(second: httpx.Response) -> None:
        rec.record(
            "job-busy",
            second,
            key=None,
            ok=second.status_code == 409,
            note="a second start while the job runs: the lock is busy",
        )

    job_task = asyncio.ensure_future(rec.send("POST", job_path))
    await asyncio.sleep(head_start)
    second = await rec.send("POST", job_path)
    if second.status_code == 409:
        record_busy(second)
        job = await job_task
    else:
        job, second = second, await job_task
        record_busy(second)
    lease_ms = job.json().get("lease_ms") if job.status_code == 200 else None
    rec.record(
        "job-run",
        job,
        key=None,
        ok=job.status_code == 200 and job.json().get("lock_lost") is False,
        note=f"ran {job_ms} ms under a {lease_ms} ms lease, renewed, never lost",
    )

    # 9. The store loses everything (flushed, as a Redis restarted without persistence):
    # the same request again is replayed from the database, where the charge and its
    # response committed together; nothing runs twice.
    key = f"demo-{run_id}-flush"
    paid = await rec.send("POST", "/payments", key=key, body=payment(900))
    rec.record(
        "flush-pay",
        paid,
        key=key,
        ok=paid.status_code == 201 and not _replayed(paid),
        note="claimed and ran: charged 900; the charge and the response commit together",
    )
    result.charges[key] = 900
    flushed = await rec.send("POST", "/demo/flush-store")
    gone = flushed.json().get("flushed_keys") if flushed.status_code == 200 else None
    rec.record(
        "store-flush",
        flushed,
        key=None,
        ok=flushed.status_code == 200 and isinstance(gone, int) and gone > 0,
        note=f"the store is flushed: {gone} keys gone, the stored responses with them",
    )
    again = await rec.send("POST", "/payments", key=key, body=payment(900))
    same = again.content == paid.content
    rec.record(
        "replay-after-flush",
        again,
        key=key,
        ok=again.status_code == 201 and _replayed(again) and same,
        note=f"replayed from the database, {'same' if same else 'DIFFERENT'} bytes, "
        "not charged again",
    )

    # 10. A payment whose first run fails after the card processor charged (as a crash
    # would): the transport retries the 500 with the same key, the second run sends the
    # processor the key derived from its claim, the same as the first run's, and the
    # processor answers from its record: one card charge.
    key = f"demo-{run_id}-rerun"

    def failed(response: httpx.Response) -> tuple[bool, str]:
        ok = _problem_type(response) == "urn:example-app:problem:failed-after-charge"
        return ok, "the first run failed after the card processor charged 1100"

    rec.retries[key] = ("failed-after-charge", failed)
    rerun = await rec.send("POST", "/payments?fail_once=true", key=key, body=payment(1100))
    rec.record(
        "rerun-after-failure",
        rerun,
        key=key,
        ok=rerun.status_code == 201 and not _replayed(rerun) and _attempts(rerun) == 2,
        note="the transport retried: the second run charged the card with the first run's key",
    )
    result.charges[key] = 1100
    by_card = {k: v for k, v in result.charges.items() if k != event_id}  # webhooks: no card
    card = await rec.send("GET", f"/card/charges?account={account}")
    charges = card.json().get("charges", []) if card.status_code == 200 else []
    total = sum(c.get("amount_cents", 0) for c in charges)
    rec.record(
        "card-charges",
        card,
        key=None,
        ok=len(charges) == len(by_card) and total == sum(by_card.values()),
        note=f"the card processor: {len(charges)} charges for {len(by_card)} paid keys, "
        f"{total} charged (expected {sum(by_card.values())})",
    )

    # 11. The ledger: one payment per key, and the balance is the sum of one charge each.
    ledger = await rec.send("GET", f"/ledger?account={account}")
    doc = ledger.json().get("accounts", {}).get(account, {}) if ledger.status_code == 200 else {}
    result.ledger = doc
    by_key = doc.get("by_key", {})
    balance = doc.get("balances", {}).get(CURRENCY)
    expected = sum(result.charges.values())
    one_each = set(by_key) == set(result.charges) and all(len(v) == 1 for v in by_key.values())
    rec.record(
        "ledger",
        ledger,
        key=None,
        ok=one_each and balance == expected and doc.get("payments") == len(result.charges),
        note=(
            f"{account}: {doc.get('payments')} payments for {len(result.charges)} keys, "
            f"{'one per key (the flushed one too)' if one_each else 'NOT one per key'}; "
            f"balance {balance} "
            f"(expected {expected})"
        ),
    )


async def _run(url: str | None, on_step: Callable[[Step], None]) -> DemoResult:
    if url is not None:

        def banner(result: DemoResult) -> None:
            print(
                f"demo against {url} (store: {result.store['kind']}, mode {result.store['mode']})"
            )

        return await run_demo(httpx.AsyncHTTPTransport(), url, on_start=banner, on_step=on_step)
    from .app import create_app, serving

    app = create_app()
    async with serving(app):
        print("demo against the app in this process (store: memory, embedded)")
        return await run_demo(httpx.ASGITransport(app=app), "http://demo", on_step=on_step)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app.demo")
    parser.add_argument(
        "--url",
        default=None,
        help="a running app, e.g. http://127.0.0.1:8000 (default: start one in this process)",
    )
    args = parser.parse_args(argv)

    def show(step: Step) -> None:
        print(format_step(step), flush=True)

    try:
        result = asyncio.run(_run(args.url, show))
    except httpx.HTTPError as exc:
        print(f"error: {exc!r}", file=sys.stderr)
        return 1
    failed = [step.scenario for step in result.steps if not step.ok]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print(f"all {len(result.steps)} steps as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
