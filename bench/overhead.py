"""The middleware's own cost per request, in process: no HTTP server, no load generator.

    python3 bench/overhead.py [--requests 20000] [--stores memory,native,script,native-direct]
    python3 bench/overhead.py --otel   # otel=False and otel=True side by side


A trivial ASGI app (one body read, a 201 JSON response) is called directly, bare and
behind IdempotencyMiddleware, by 50 concurrent tasks on uvloop; each line is the time per
request over the bare app's, for the four scenarios of http_bench.py, and the garbage
collections per 1,000 requests. Much less noisy than the HTTP benchmark, so it shows a
change of a microsecond; the Redis stores run against a throwaway redis-server (the
native one with the goblin module loaded), pinned to core 1 while this runs on core 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import http_bench
import serve

RESPONSE = b'{"id":1,"status":"created"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"27")]
CONCURRENCY = 50

Asgi = Callable[[Any, Any, Any], Awaitable[None]]


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await asyncio.sleep(0)  # a real handler yields at least once
    await send({"type": "http.response.start", "status": 201, "headers": HEADERS})
    await send({"type": "http.response.body", "body": RESPONSE})


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": serve.BODY, "more_body": False}


async def send(message: Any) -> None:
    return None


def scope(key: bytes | None) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"user-agent", b"wrk"),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(serve.BODY)),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key))
    return {
        "type": "http",
        "method": "POST",
        "path": serve.PATH,
        "query_string": b"",
        "headers": headers,
    }


def key_for(scenario: str, worker: int, i: int, tag: str) -> bytes | None:
    if scenario == "new":
        return f"{tag}-{worker}-{i}".encode()
    if scenario == "replay":
        return f"replay-{i % 100}".encode()
    if scenario == "inflight":
        return serve.INFLIGHT_KEY.encode()
    return None


async def drive(target: Asgi, scenario: str, n: int, tag: str) -> float:
    """Seconds per request, `n` requests over CONCURRENCY tasks."""

    async def worker(w: int) -> None:
        for i in range(n // CONCURRENCY):
            await target(scope(key_for(scenario, w, i, tag)), receive, send)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
    return (time.perf_counter() - started) / (n // CONCURRENCY * CONCURRENCY)


async def measure(store: Any, args: argparse.Namespace) -> list[str]:
    from goblin_idem import IdempotencyMiddleware

    mw = IdempotencyMiddleware(app, store=store)
    if args.otel:
        return await measure_otel(mw, IdempotencyMiddleware(app, store=store, otel=True), args)
    await warm(mw)
    lines = []
    for scenario in args.scenarios:
        extra, collections = [], []
        for rep in range(args.reps):
            bare = await drive(app, scenario, args.requests, "")
            before = sum(s["collections"] for s in gc.get_stats())
            mine = await drive(mw, scenario, args.requests, f"r{rep}")
            after = sum(s["collections"] for s in gc.get_stats())
            extra.append((mine - bare) * 1e6)
            collections.append((after - before) * 1000 / args.requests)
        lines.append(
            f"{scenario:9} {statistics.median(extra):7.1f} us/request over bare   "
            f"({statistics.median(collections):5.1f} GCs per 1000 requests)"
        )
    return lines


async def measure_otel(off: Any, on: Any, args: argparse.Namespace) -> list[str]:
    """otel=False and otel=True, alternating within each repetition, over the same bare
    app; with the OpenTelemetry SDK recording (when installed), as an application has it."""
    await warm(off)
    await warm(on)
    lines = []
    for scenario in args.scenarios:
        extra: dict[str, list[float]] = {"off": [], "on": []}
        for rep in range(args.reps):
            for name, mw in (("off", off), ("on", on)):
                bare = await drive(app, scenario, args.requests, "")
                mine = await drive(mw, scenario, args.requests, f"{name}{rep}")
                extra[name].append((mine - bare) * 1e6)
        lines.append(
            f"{scenario:9} otel=False {statistics.median(extra['off']):7.1f} us/request over "
            f"bare   otel=True {statistics.median(extra['on']):7.1f} us/request over bare"
        )
    return lines


async def warm(mw: Any) -> None:
    from goblin_idem.keys import key_names

    names = key_names(b"idem", b"", serve.INFLIGHT_KEY.encode())
    await mw.store.claim(names.claim, names.result, b"holder", 3600)
    for i in range(100):
        await mw(scope(f"replay-{i}".encode()), receive, send)
    await drive(mw, "new", 2000, f"warm{id(mw)}")


def recording_sdk() -> str:
    """Install the SDK's meter provider, if the SDK is there; what records the figures."""
    try:
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    except ImportError:
        return "the OpenTelemetry API alone (no SDK installed: instruments do nothing)"
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    return "the OpenTelemetry SDK, recording into an in-memory reader"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stores", default="memory,native,script,native-direct")
    p.add_argument("--scenarios", default=",".join(http_bench.SCENARIOS))
    p.add_argument("--no-hiredis", action="store_true", help="redis-py's pure-Python parser")
    p.add_argument("--otel", action="store_true", help="otel=False and otel=True side by side")
    args = p.parse_args()
    args.scenarios = args.scenarios.split(",")
    if args.otel:
        print(f"otel=True measured with {recording_sdk()}", flush=True)

    import uvloop

    from goblin_idem import MemoryStore, RedisStore
    from goblin_idem.native import build_module
    from tests.servers import start_server

    http_bench.pin(os.getpid(), 0)
    for kind in args.stores.split(","):
        server = None
        try:
            if kind == "memory":
                store: Any = MemoryStore()
            else:
                modules = [] if kind.startswith("script") else [str(build_module())]
                server = start_server("redis", modules=modules)
                http_bench.pin(server.pid, 1)
                store = RedisStore.from_url(
                    server.url,
                    mode=kind.removesuffix("-direct"),
                    autopipeline=not kind.endswith("-direct"),
                    **serve.redis_kwargs(args.no_hiredis),
                )
            print(f"-- {kind}", flush=True)
            for line in uvloop.run(measure(store, args)):
                print(line, flush=True)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    http_bench.ensure_env()
    http_bench.exit_on_sigterm()
    sys.path.append(str(http_bench.ROOT))  # after PYTHONPATH, which may name another copy
    main()
