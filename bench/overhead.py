"""The middleware's own cost per request, in process: no HTTP server, no load generator.

    python3 bench/overhead.py [--requests 20000] [--stores memory,native,script,native-direct]
                              [--encryption off,on]
    python3 bench/overhead.py --otel   # otel=False and otel=True side by side
    python3 bench/overhead.py --app fastapi   # the HTTP benchmark's FastAPI app instead

A trivial ASGI app (one body read, a 201 JSON response) is called directly, bare and
behind IdempotencyMiddleware, by 50 concurrent tasks on uvloop; each line is the time per
request over the bare app's and the ratio of the two, for the four scenarios of
http_bench.py, and the garbage collections per 1,000 requests (young, middle and full
generations) and the time they took; `--app fastapi` calls the FastAPI app of
http_bench.py instead, whose heap (about 65,000 objects) makes each full collection as
long as in the HTTP server; with records sealed
(``encryption_keys``) and in the clear, side by side in the same run. Much less noisy
than the HTTP benchmark, so it shows a change of a microsecond; the Redis stores run
against a throwaway redis-server (the native one with the goblin module loaded), pinned
to core 1 while this runs on core 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
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
    """An HTTP scope of what uvicorn sends for wrk's request."""
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
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "scheme": "http",
        "method": "POST",
        "path": serve.PATH,
        "raw_path": serve.PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
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


def variants(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The middleware settings measured side by side, by label."""
    if args.otel:
        return {"otel=False": {"otel": False}, "otel=True ": {"otel": True}}
    return {
        f"encryption {v:3}": {"encryption_keys": [os.urandom(32)] if v == "on" else []}
        for v in args.encryption
    }


class Collections:
    """Garbage collections by generation, and the time they stopped the loop."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started

    def mark(self) -> tuple[list[int], float]:
        return list(self.counts), self.seconds


def target_app(args: argparse.Namespace) -> Asgi:
    """The app called bare and behind the middleware."""
    if args.app == "trivial":
        return app

    async def nothing() -> None:
        return None

    fastapi: Asgi = serve.fastapi_app([], nothing)
    return fastapi


async def measure(store: Any, args: argparse.Namespace) -> list[str]:
    from goblin_idem import IdempotencyMiddleware
    from goblin_idem._keys import key_names

    bare_app = target_app(args)
    seen = Collections()

    names = key_names(b"idem", b"", serve.INFLIGHT_KEY.encode())
    mws = {}
    for n, (label, options) in enumerate(variants(args).items()):
        # Its own namespace each, so that each replays records it sealed (or not) itself.
        mw = IdempotencyMiddleware(bare_app, store=store, namespace=f"v{n}", **options)
        await store.claim(*_names(mw, names), b"holder", 3600)
        for i in range(100):
            await mw(scope(f"replay-{i}".encode()), receive, send)
        await drive(mw, "new", 2000, f"warm{n}")
        mws[label] = mw
    lines = []
    for scenario in args.scenarios:
        extra: dict[str, list[float]] = {v: [] for v in mws}
        ratio: dict[str, list[float]] = {v: [] for v in mws}
        collections: dict[str, list[list[float]]] = {v: [] for v in mws}
        for rep in range(args.reps):  # bare, then each variant in turn: drift hits each alike
            bare = await drive(bare_app, scenario, args.requests, "")
            for variant, mw in mws.items():
                counts, seconds = seen.mark()
                mine = await drive(mw, scenario, args.requests, f"{variant}{rep}")
                after, after_seconds = seen.mark()
                extra[variant].append((mine - bare) * 1e6)
                ratio[variant].append(mine / bare)
                per_1k = [
                    (a - b) * 1000 / args.requests for a, b in zip(after, counts, strict=True)
                ]
                gc_us = (after_seconds - seconds) * 1e6 / args.requests
                collections[variant].append([*per_1k, gc_us])
        for variant in mws:
            young, middle, full, gc_us = (
                statistics.median(c[i] for c in collections[variant]) for i in range(4)
            )
            lines.append(
                f"{scenario:9} {variant} {statistics.median(extra[variant]):7.1f} "
                f"us/request over bare, {statistics.median(ratio[variant]):5.2f}x bare   "
                f"(GCs per 1000 requests: {young:5.1f} young, {middle:4.1f} middle, "
                f"{full:4.2f} full; {gc_us:4.1f} us/request)"
            )
    return lines


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


def _names(mw: Any, names: Any) -> tuple[bytes, bytes]:
    """The in-flight key's claim and result under `mw`'s namespace."""
    from goblin_idem._keys import names_of

    mine = names_of(mw.namespace, names.hash)
    return mine.claim, mine.result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stores", default="memory,native,script,native-direct")
    p.add_argument("--scenarios", default=",".join(http_bench.SCENARIOS))
    p.add_argument("--no-hiredis", action="store_true", help="redis-py's pure-Python parser")
    p.add_argument("--encryption", default="off,on", help="off, on, or both (off,on)")
    p.add_argument("--otel", action="store_true", help="otel=False and otel=True side by side")
    p.add_argument("--app", choices=("trivial", "fastapi"), default="trivial")
    args = p.parse_args()
    args.scenarios = args.scenarios.split(",")
    args.encryption = args.encryption.split(",")
    if args.otel:
        print(f"otel=True measured with {recording_sdk()}", flush=True)

    import uvloop

    http_bench.pin(os.getpid(), 0)
    for kind in args.stores.split(","):
        with store_of(kind, args.no_hiredis) as store:
            print(f"-- {kind}", flush=True)
            for line in uvloop.run(measure(store, args)):
                print(line, flush=True)


@contextlib.contextmanager
def store_of(kind: str, no_hiredis: bool = False) -> Iterator[Any]:
    """The store `kind` names: ``memory``, or a RedisStore (``native``, ``script``, either
    with ``-direct``: no autopipelining) on a throwaway redis-server pinned to core 1 (the
    native one with the goblin module loaded), stopped by its PID at the end."""
    from goblin_idem import MemoryStore, RedisStore
    from goblin_idem.native import build_module
    from tests.support.servers import start_server

    if kind == "memory":
        yield MemoryStore()
        return
    modules = [] if kind.startswith("script") else [str(build_module())]
    server = start_server("redis", modules=modules)
    try:
        http_bench.pin(server.pid, 1)
        yield RedisStore.from_url(
            server.url,
            mode=kind.removesuffix("-direct"),
            autopipeline=not kind.endswith("-direct"),
            **serve.redis_kwargs(no_hiredis),
        )
    finally:
        server.stop()


if __name__ == "__main__":
    http_bench.ensure_env()
    http_bench.exit_on_sigterm()
    sys.path.append(str(http_bench.ROOT))  # after PYTHONPATH, which may name another copy
    main()
