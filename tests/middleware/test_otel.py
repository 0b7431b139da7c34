"""OpenTelemetry (``otel=True``): outcomes counted, store round trips timed, held leases
observed, and the outcome and key hash (never the key) set on the server span; read with the
SDK's in-memory reader and exporter, over a real Redis. Without ``otel=True`` nothing of it
is imported."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from tests.support.servers import Server
from tests.support.waits import until


@pytest.fixture(scope="module")
def telemetry() -> Iterator[tuple[InMemoryMetricReader, InMemorySpanExporter]]:
    """The SDK as an application sets it up (once per process: the providers are global)."""
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(provider)
    yield reader, spans


def points(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    found = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        found[tuple(sorted(point.attributes.items()))] = point
    return found


def outcomes(reader: InMemoryMetricReader) -> dict[str, int]:
    return {
        dict(attrs)["goblin_idem.outcome"]: point.value
        for attrs, point in points(reader, "goblin_idem.requests").items()
    }


def traced(app: ASGIApp) -> ASGIApp:
    """A server span around each request, as an instrumented ASGI server makes one."""
    tracer = trace.get_tracer("test-server")

    async def server(scope: Scope, receive: Receive, send: Send) -> None:
        with tracer.start_as_current_span(
            f"{scope['method']} {scope['path']}", kind=SpanKind.SERVER
        ):
            await app(scope, receive, send)

    return server


@pytest.fixture
async def client(
    redis_server: Server, telemetry: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, asyncio.Event]]:
    release = asyncio.Event()

    async def pay(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("slow"):
            await release.wait()
        if body.get("fail"):
            raise RuntimeError("the handler failed")
        return JSONResponse({"paid": body.get("amount")})

    store = RedisStore.from_url(redis_server.url)
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    wrapped = traced(IdempotencyMiddleware(app, store=store, otel=True))
    transport = httpx.ASGITransport(app=wrapped, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c, release
    await store.aclose()


async def test_outcomes_durations_leases_and_span_attributes(
    client: tuple[httpx.AsyncClient, asyncio.Event],
    telemetry: tuple[InMemoryMetricReader, InMemorySpanExporter],
) -> None:
    c, release = client
    reader, spans = telemetry
    before = outcomes(reader)

    def key(name: str) -> dict[str, str]:
        return {"Idempotency-Key": f"otel-{name}-{id(c)}"}

    assert (await c.post("/pay", json={"amount": 1}, headers=key("a"))).status_code == 200
    assert (await c.post("/pay", json={"amount": 1}, headers=key("a"))).status_code == 200
    assert (await c.post("/pay", json={"amount": 2}, headers=key("a"))).status_code == 422
    slow = asyncio.ensure_future(c.post("/pay", json={"slow": True}, headers=key("b")))

    def leased() -> bool:
        held = points(reader, "goblin_idem.leases")
        return bool(held) and next(iter(held.values())).value == 1

    await until(leased, what="the slow run holds its lease")
    assert (await c.post("/pay", json={"slow": True}, headers=key("b"))).status_code == 409
    release.set()
    assert (await slow).status_code == 200
    assert (await c.post("/pay", json={"fail": True}, headers=key("c"))).status_code == 500
    assert next(iter(points(reader, "goblin_idem.leases").values())).value == 0

    after = outcomes(reader)
    counted = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert {k: v for k, v in counted.items() if v} == {
        "claimed": 3,
        "replayed": 1,
        "mismatch": 1,
        "in_flight": 1,
        "released": 1,
    }
    durations = points(reader, "goblin_idem.store.duration")
    by_operation = {dict(attrs)["goblin_idem.operation"]: p for attrs, p in durations.items()}
    assert by_operation["claim"].count >= 6  # one per keyed request
    assert by_operation["publish"].count >= 2 and by_operation["release"].count >= 1
    assert 0 < by_operation["claim"].sum / by_operation["claim"].count < 1.0  # seconds
    assert by_operation["claim"].explicit_bounds[:2] == (0.0001, 0.00025)  # buckets in seconds

    finished = [s for s in spans.get_finished_spans() if s.name == "POST /pay"]
    seen: dict[str, list[str]] = {}
    for span in finished:
        attributes = dict(span.attributes or {})
        assert not any("otel-" in str(value) for value in attributes.values())  # no raw key
        if "goblin_idem.key_hash" in attributes:
            outcome = str(attributes["goblin_idem.outcome"])
            seen.setdefault(str(attributes["goblin_idem.key_hash"]), []).append(outcome)
    hashes = {n: key_names(b"idem", b"", key(n)["Idempotency-Key"].encode()).hash for n in "abc"}
    # the span of each request ends with the last thing the middleware did for it
    assert sorted(seen[hashes["a"]]) == ["claimed", "mismatch", "replayed"]
    assert sorted(seen[hashes["b"]]) == ["claimed", "in_flight"]
    assert seen[hashes["c"]] == ["released"]


def test_nothing_of_opentelemetry_is_imported_without_otel() -> None:
    """redis-py 8 imports part of OpenTelemetry itself; goblin-idem adds nothing to it."""
    code = (
        "import sys, json, redis.asyncio, starlette.routing\n"
        "before = set(sys.modules)\n"
        "from goblin_idem import IdempotencyMiddleware\n"
        "async def app(scope, receive, send): pass\n"
        "IdempotencyMiddleware(app)\n"
        "otel = ('opentelemetry', 'goblin_idem.middleware._otel')\n"
        "print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith(otel))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []


def test_otel_without_opentelemetry_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None\n"  # as if it were not installed
        "from goblin_idem import IdempotencyMiddleware\n"
        "async def app(scope, receive, send): pass\n"
        "IdempotencyMiddleware(app, otel=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "otel=True needs OpenTelemetry: pip install 'goblin-idem[otel]'" in out.stderr
