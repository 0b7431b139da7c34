"""The cost of verifying a webhook delivery, beside a plain keyed route, in one run.

    python3 bench/webhook_bench.py [--requests 20000] [--reps 5] [--stores memory,script]
                                   [--body-bytes 0,16384]

One IdempotencyMiddleware around overhead.py's trivial ASGI app, in process (no HTTP server,
no load generator: a difference of a microsecond shows): a plain route keyed by
``Idempotency-Key`` and one webhook path per provider (``webhooks={path: provider}``). Every
delivery is signed before the clock starts (signing is the sender's cost), with the
providers' documented algorithms. Per store and body size, each line is a provider's time
per request and its ratio to the plain keyed route measured in the same repetition (each
target in turn, each repetition starting at the next one, so that drift and the growing
heap hit each alike; medians of `--reps`), for three scenarios:

- ``new``: a fresh delivery id each time: verified, claimed, run, published; against a
  fresh Idempotency-Key on the plain route;
- ``replay``: one of 100 delivered ids again, signed afresh: verified, then answered from
  the store; against a replayed key;
- ``forged``: a wrong signature: refused (401) before the claim; against a replayed key
  (the plain route's cheapest keyed answer). Its log line is off here: a log handler's
  cost is the app's.

The body is overhead.py's event with an id (39 bytes), or padded to each
``--body-bytes``: every scheme's HMAC reads the whole body. A last line per provider times
its `verify` alone (the headers as the middleware hands them, 20,000 calls): the part of
the difference that is the signature check itself, and the steadiest figure on a busy
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import statistics
import sys
import time
import timeit
from collections.abc import Awaitable, Callable
from typing import Any

import http_bench
import overhead
import serve

STANDARD_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
STRIPE_SECRET = "whsec_bench"
GITHUB_SECRET = "bench github secret"
SHOPIFY_SECRET = "bench shopify secret"
PROVIDERS = ("standard", "stripe", "github", "shopify")
SCENARIOS = ("new", "replay", "forged")
WRONG = b"not the endpoint's secret"

Asgi = Callable[[Any, Any, Any], Awaitable[None]]
Request = tuple[dict[str, Any], bytes]  # an ASGI scope and its body


def body_of(event_id: str, size: int) -> bytes:
    event: dict[str, Any] = {"id": event_id, **json.loads(serve.BODY)}
    body = json.dumps(event).encode()
    if size > len(body):
        event["pad"] = "x" * (size - len(body) - 10)
        body = json.dumps(event).encode()
    return body


def signed(provider: str, event_id: str, body: bytes, stamp: int, forged: bool) -> list[Any]:
    """The headers `provider` sends with `body`, as its documentation specifies them."""
    if provider == "standard":
        key = WRONG if forged else base64.b64decode(STANDARD_SECRET.removeprefix("whsec_"))
        mac = hmac.new(key, f"{event_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
        return [
            (b"webhook-id", event_id.encode()),
            (b"webhook-timestamp", str(stamp).encode()),
            (b"webhook-signature", b"v1," + base64.b64encode(mac)),
        ]
    if provider == "stripe":
        key = WRONG if forged else STRIPE_SECRET.encode()
        mac_hex = hmac.new(key, f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
        return [(b"stripe-signature", f"t={stamp},v1={mac_hex}".encode())]
    if provider == "github":
        key = WRONG if forged else GITHUB_SECRET.encode()
        mac_hex = hmac.new(key, body, hashlib.sha256).hexdigest()
        return [
            (b"x-hub-signature-256", b"sha256=" + mac_hex.encode()),
            (b"x-github-delivery", event_id.encode()),
            (b"x-github-hook-id", b"1"),
        ]
    key = WRONG if forged else SHOPIFY_SECRET.encode()
    mac = hmac.new(key, body, hashlib.sha256).digest()
    return [
        (b"x-shopify-hmac-sha256", base64.b64encode(mac)),
        (b"x-shopify-event-id", event_id.encode()),
    ]


def request(path: str, extra: list[Any], body: bytes) -> Request:
    scope = overhead.scope(None)
    scope["path"], scope["raw_path"] = path, path.encode()
    headers = [h for h in scope["headers"] if h[0] != b"content-length"]
    scope["headers"] = [*headers, (b"content-length", b"%d" % len(body)), *extra]
    return scope, body


def requests_for(target: str, scenario: str, n: int, tag: str, size: int) -> list[Request]:
    """`n` requests of `scenario` to `target` ("plain" or a provider), prepared."""
    stamp = int(time.time())
    made = []
    for i in range(n):
        if scenario == "new":
            event_id = f"{tag}-{i}"
        else:
            event_id = f"replay-{i % 100}"
        body = body_of(event_id, size)
        if target == "plain":
            key = event_id if scenario == "new" else f"replay-{i % 100}"
            made.append(request(serve.PATH, [(b"idempotency-key", key.encode())], body))
        else:
            headers = signed(target, event_id, body, stamp + i % 2, scenario == "forged")
            made.append(request(f"/hooks/{target}", headers, body))
    return made


async def drive(target: Asgi, prepared: list[Request]) -> float:
    """Seconds per request, the requests split over overhead.CONCURRENCY tasks."""
    per = len(prepared) // overhead.CONCURRENCY

    async def worker(w: int) -> None:
        for scope, body in prepared[w * per : (w + 1) * per]:

            async def receive(body: bytes = body) -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            await target(dict(scope), receive, overhead.send)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(overhead.CONCURRENCY)))
    return (time.perf_counter() - started) / (per * overhead.CONCURRENCY)


def providers() -> dict[str, Any]:
    from goblin_idem.webhooks import GitHub, Shopify, StandardWebhooks, Stripe

    return {
        "standard": StandardWebhooks(secrets=[STANDARD_SECRET]),
        "stripe": Stripe(secrets=[STRIPE_SECRET]),
        "github": GitHub(secrets=[GITHUB_SECRET]),
        "shopify": Shopify(secrets=[SHOPIFY_SECRET]),
    }


def middleware(store: Any, namespace: str) -> Any:
    from goblin_idem import IdempotencyMiddleware

    paths = {f"/hooks/{name}": provider for name, provider in providers().items()}
    return IdempotencyMiddleware(
        overhead.app, store=store, namespace=namespace, webhooks=paths, max_body_bytes=1 << 20
    )


def verify_alone(size: int) -> list[str]:
    """Each provider's `verify`, on its own, in microseconds per call."""
    from goblin_idem.middleware._request import Identity

    lines = []
    for name, provider in providers().items():
        body = body_of("evt_1", size)
        scope, _ = request("/x", signed(name, "evt_1", body, int(time.time()), False), body)
        headers = Identity.header_map(scope)
        calls = 20_000
        seconds = min(
            timeit.repeat(lambda: provider.verify(headers, body), number=calls, repeat=3)  # noqa: B023
        )
        lines.append(f"verify  {name:8} {seconds / calls * 1e6:15.1f} us/call, alone")
    return lines


async def measure(store: Any, args: argparse.Namespace, size: int) -> list[str]:
    mw = middleware(store, f"wh{size}")
    targets = ("plain", *PROVIDERS)
    for target in targets:  # the 100 replayed ids and keys, and a warm-up
        await drive(mw, requests_for(target, "new", 100, "replay", size))
        await drive(mw, requests_for(target, "new", 2000, f"warm-{size}", size))
    lines = []
    for scenario in SCENARIOS:
        times: dict[str, list[float]] = {t: [] for t in targets}
        ratios: dict[str, list[float]] = {t: [] for t in PROVIDERS}
        for rep in range(args.reps):
            # Each repetition starts at another target: the heap (and the collector's work)
            # grows as a run goes, and no target is always first or last.
            order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
            tag = f"{scenario}-{size}-{rep}"
            took: dict[str, float] = {}
            for target in order:
                sent = scenario
                if target == "plain" and scenario == "forged":
                    sent = "replay"
                took[target] = await drive(mw, requests_for(target, sent, args.requests, tag, size))
            for target in targets:
                times[target].append(took[target])
            for provider in PROVIDERS:
                ratios[provider].append(took[provider] / took["plain"])
        plain_us = statistics.median(times["plain"]) * 1e6
        lines.append(f"{scenario:7} plain keyed route {plain_us:6.1f} us/request")
        for provider in PROVIDERS:
            us = statistics.median(times[provider]) * 1e6
            ratio = statistics.median(ratios[provider])
            lines.append(f"{scenario:7} {provider:8} {us:15.1f} us/request, {ratio:5.2f}x plain")
    return lines + verify_alone(size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--stores", default="memory,script")
    p.add_argument("--body-bytes", default="0,16384")
    args = p.parse_args()
    logging.getLogger("goblin_idem.middleware").setLevel(logging.ERROR)  # forged: no lines

    import uvloop

    http_bench.pin(os.getpid(), 0)
    for kind in args.stores.split(","):
        with overhead.store_of(kind) as store:
            for size in (int(s) for s in args.body_bytes.split(",")):
                print(f"-- {kind}, body {len(body_of('evt_1', size))} bytes", flush=True)
                for line in uvloop.run(measure(store, args, size)):
                    print(line, flush=True)


if __name__ == "__main__":
    http_bench.ensure_env()
    http_bench.exit_on_sigterm()
    sys.path.append(str(http_bench.ROOT))  # after PYTHONPATH, which may name another copy
    main()
