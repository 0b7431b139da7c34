"""The OpenAPI document of a FastAPI app shows what the middleware does on each operation,
and nothing on the ones it leaves alone: the example app's /openapi.json (the reference,
served by uvicorn, valid OpenAPI 3.1), and routers whose documentation is checked against
what a request without a key, and one with a bad key, actually get."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from openapi_spec_validator import validate

from goblin_idem import IdempotencyMiddleware, idempotent
from tests.support.procs import start_example_app, stop
from tests.support.servers import free_port

PROBLEM = "application/problem+json"
REF = {"$ref": "#/components/schemas/IdempotencyProblem"}


def key_header(operation: dict[str, Any], name: str = "Idempotency-Key") -> dict[str, Any] | None:
    found = [
        p for p in operation.get("parameters", []) if p["in"] == "header" and p["name"] == name
    ]
    assert len(found) <= 1
    return found[0] if found else None


def problem_slugs(response: dict[str, Any]) -> set[str]:
    assert response["content"][PROBLEM]["schema"] == REF
    return set(response["content"][PROBLEM]["examples"])


def assert_documented(operation: dict[str, Any], *, required: bool) -> None:
    header = key_header(operation)
    assert header is not None
    assert header["required"] is required
    assert header["schema"] == {"type": "string", "minLength": 1, "maxLength": 255}
    responses = operation["responses"]
    assert problem_slugs(responses["400"]) == (
        {"missing-key", "invalid-key"} if required else {"invalid-key"}
    )
    assert problem_slugs(responses["409"]) == {"in-flight", "not-replayable"}
    assert "Retry-After" in responses["409"]["headers"]
    assert problem_slugs(responses["413"]) == {"body-too-large"}
    assert problem_slugs(responses["422"]) == {"key-reused"}
    assert problem_slugs(responses["503"]) == {"store-unavailable"}
    assert "Retry-After" in responses["503"]["headers"]


def assert_untouched(operation: dict[str, Any]) -> None:
    assert key_header(operation) is None
    text = str(operation)
    assert "IdempotencyProblem" not in text and "Idempotent-Replayed" not in text


def test_the_example_apps_openapi_json(tmp_path: Path) -> None:
    port = free_port()
    proc = start_example_app(port, tmp_path / "app.log")
    try:
        doc = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=10).json()
        unsigned = httpx.post(
            f"http://127.0.0.1:{port}/webhooks/acme", json={"id": "e", "type": "x"}, timeout=10
        )
    finally:
        stop(proc)
    validate(doc)  # OpenAPI 3.1, by the schema of the specification
    paths = doc["paths"]
    payments = paths["/payments"]["post"]
    assert_documented(payments, required=False)
    assert "Idempotent-Replayed" in payments["responses"]["201"]["headers"]
    # FastAPI's own 422 stays, the key's misuse is added beside it
    assert set(payments["responses"]["422"]["content"]) == {"application/json", PROBLEM}
    webhook = paths["/webhooks/{provider}"]["post"]  # a Standard Webhooks receiver
    assert key_header(webhook) is None
    headers = [p["name"] for p in webhook["parameters"] if p["in"] == "header"]
    assert headers == ["webhook-id", "webhook-timestamp", "webhook-signature"]
    assert problem_slugs(webhook["responses"]["401"]) == {"webhook-unverified"}
    assert unsigned.status_code == 401 and unsigned.json()["type"].endswith("webhook-unverified")
    assert_documented(paths["/orders/{order_id}"]["patch"], required=False)
    assert_untouched(paths["/demo/dead-worker"]["post"])  # @idempotent(enabled=False)
    for method in ("get",):  # methods the middleware does not cover
        assert_untouched(paths["/payments/{payment_id}"][method])
        assert_untouched(paths["/orders/{order_id}"][method])
    schema = doc["components"]["schemas"]["IdempotencyProblem"]
    assert schema["required"] == ["type", "title", "status", "detail"]


def routed_app(**options: Any) -> FastAPI:
    """Marks on routes of an app, a router and a router included in a router."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, **options)
    outer, inner = APIRouter(), APIRouter()

    @inner.post("/hooks/{source}")
    @idempotent(required=True)
    async def hook(source: str) -> dict[str, str]:
        return {"ran": source}

    @inner.patch("/items/{item_id}")
    async def patch_item(item_id: int) -> dict[str, int]:
        return {"ran": item_id}

    @outer.post("/exempt")
    @idempotent(enabled=False)
    async def exempt() -> dict[str, str]:
        return {"ran": "exempt"}

    @outer.post("/plain")
    async def plain() -> dict[str, str]:
        return {"ran": "plain"}

    @app.post("/internal/sync")
    async def internal() -> dict[str, str]:
        return {"ran": "internal"}

    @app.put("/items/{item_id}")
    async def put_item(item_id: int) -> dict[str, int]:
        return {"ran": item_id}

    outer.include_router(inner, prefix="/v2")
    app.include_router(outer, prefix="/api")
    return app


@pytest.fixture
async def routed() -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
    app = routed_app(exclude=["/internal/*"])
    transport = httpx.ASGITransport(app=app)  # no lifespan: the first request hooks it
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c, (await c.get("/openapi.json")).json()


async def test_routers_are_documented_as_requests_meet_them(
    routed: tuple[httpx.AsyncClient, dict[str, Any]],
) -> None:
    c, doc = routed
    validate(doc)
    checked = 0
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            url = path.replace("{source}", "github").replace("{item_id}", "7")
            header = key_header(operation)
            without = await c.request(method, url)
            bad = await c.request(method, url, headers={"Idempotency-Key": "x" * 256})
            if header is None:
                assert_untouched(operation)
                assert (without.status_code, bad.status_code) == (200, 200), path
            else:
                assert_documented(operation, required=header["required"])
                assert bad.json()["type"].endswith("invalid-key"), path
                if header["required"]:
                    assert without.json()["type"].endswith("missing-key"), path
                else:
                    assert without.status_code == 200, path
            checked += 1
    assert checked == 6
    paths = doc["paths"]
    assert key_header(paths["/api/v2/hooks/{source}"]["post"])["required"] is True  # type: ignore[index]
    assert key_header(paths["/api/v2/items/{item_id}"]["patch"]) is not None
    assert key_header(paths["/api/plain"]["post"]) is not None
    assert key_header(paths["/api/exempt"]["post"]) is None
    assert key_header(paths["/internal/sync"]["post"]) is None  # exclude=
    assert key_header(paths["/items/{item_id}"]["put"]) is None  # not in methods


async def test_the_document_follows_the_options_and_the_apps_own_openapi() -> None:
    app = routed_app(header="X-Request-Key", fail_open=True, required=True)
    built = app.openapi

    def custom() -> dict[str, Any]:  # FastAPI's documented way to extend the schema
        schema = built()
        schema["info"]["x-logo"] = "logo.png"
        return schema

    app.openapi = custom  # type: ignore[method-assign]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        first = (await c.get("/openapi.json")).json()
        again = (await c.get("/openapi.json")).json()
    assert first == again  # documenting twice adds nothing twice
    validate(first)
    assert first["info"]["x-logo"] == "logo.png"
    plain = first["paths"]["/api/plain"]["post"]
    assert key_header(plain) is None
    header = key_header(plain, "X-Request-Key")
    assert header is not None and header["required"] is True
    assert "503" not in plain["responses"]  # fail_open runs the handler instead
    assert problem_slugs(plain["responses"]["400"]) == {"missing-key", "invalid-key"}
