"""The providers on their own (published test vectors, Ed25519, options), and what the
middleware does with a provider of the user's own, in process."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Mapping

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware, MemoryStore
from goblin_idem.webhooks import (
    Delivery,
    GitHub,
    Provider,
    Shopify,
    StandardWebhooks,
    Stripe,
    WebhookRefusedError,
    webhook,
)
from tests.support.apps.webhook_app import (
    GITHUB_SECRETS,
    SHOPIFY_SECRETS,
    STANDARD_SECRETS,
    STRIPE_SECRETS,
)
from tests.support.asgi import problem, request
from tests.support.webhooks import delivery as signed_delivery
from tests.support.webhooks import event_body, forged


def test_github_published_test_vector() -> None:
    """docs.github.com, "Validating webhook deliveries": this secret and payload give this
    signature."""
    github = GitHub(secrets=["It's a Secret to Everybody"])
    headers = {
        "x-hub-signature-256": (
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        ),
        "x-github-delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        "x-github-hook-id": "292430182",
    }
    key = Delivery("sha256:" + hashlib.sha256(b"Hello, World!").hexdigest())
    assert github.verify(headers, b"Hello, World!") == key
    unsigned = {"x-github-delivery": "another", "x-github-hook-id": "1"}  # not signed: not read
    assert github.verify({**headers, **unsigned}, b"Hello, World!") == key
    with pytest.raises(WebhookRefusedError) as refused:
        github.verify(headers, b"Hello, World?")
    assert not refused.value.malformed


def test_standard_webhooks_v1a_ed25519() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    signing = Ed25519PrivateKey.generate()
    public = signing.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    provider = StandardWebhooks(public_keys=["whpk_" + base64.b64encode(public).decode()])
    stamp = str(int(time.time()))
    body = b'{"type":"user.created"}'
    signature = base64.b64encode(signing.sign(f"msg_1.{stamp}.".encode() + body)).decode()
    headers = {"webhook-id": "msg_1", "webhook-timestamp": stamp}
    ok = {**headers, "webhook-signature": f"v1,bm90LWl0 v1a,{signature}"}
    assert provider.verify(ok, body) == Delivery("msg_1")
    with pytest.raises(WebhookRefusedError):
        provider.verify(ok, body + b" ")
    other = Ed25519PrivateKey.generate().sign(f"msg_1.{stamp}.".encode() + body)
    forged = {**headers, "webhook-signature": "v1a," + base64.b64encode(other).decode()}
    with pytest.raises(WebhookRefusedError):
        provider.verify(forged, body)


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda: GitHub(secrets="s3cret"), TypeError, "a list of secrets"),
        (lambda: GitHub(), TypeError, "one of the two"),
        (lambda: GitHub(["a"], hooks={1: ["b"]}), TypeError, "one of the two"),
        (lambda: GitHub(hooks={1: ["a"], 2: ["b", "a"]}), ValueError, "hooks 1 and 2 share"),
        (lambda: GitHub(hooks={"repo": ["a"]}), ValueError, "X-GitHub-Hook-ID"),
        (lambda: GitHub(hooks={}), ValueError, "each hook id to its secrets"),
        (lambda: Shopify(secrets=[]), ValueError, "at least one secret"),
        (lambda: Stripe(secrets=[""]), ValueError, "non-empty"),
        (lambda: Stripe(secrets=["s"], tolerance_seconds=0), ValueError, "tolerance_seconds"),
        (lambda: StandardWebhooks(), ValueError, "whsec_"),
        (lambda: StandardWebhooks(secrets=["whsec_not base64!"]), ValueError, "base64"),
        (lambda: StandardWebhooks(public_keys=["whpk_AAAA"]), ValueError, "32-byte"),
        (lambda: webhook("stripe"), TypeError, "webhook provider"),  # type: ignore[arg-type]
        (
            lambda: IdempotencyMiddleware(
                Starlette(), store=MemoryStore(), webhooks={"hooks": GitHub(secrets=["s"])}
            ),
            ValueError,
            "starting with '/'",
        ),
        (
            lambda: IdempotencyMiddleware(
                Starlette(), store=MemoryStore(), webhooks={"/hooks": object()}
            ),
            TypeError,
            "webhook provider",
        ),
    ],
)
def test_a_wrong_option_says_what_to_change(make: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        make()  # type: ignore[operator]


def test_repr_never_shows_a_secret() -> None:
    for provider in (
        GitHub(secrets=["gh-secret"]),
        GitHub(hooks={1: ["gh-secret"]}),
        Shopify(secrets=["shop-secret"]),
        Stripe(secrets=["whsec_stripe"]),
        StandardWebhooks(secrets=["whsec_c2VjcmV0"]),
    ):
        assert "secret" not in repr(provider).replace("secrets", "")
        assert "c2VjcmV0" not in repr(provider)


class Bearer:
    """A provider of the user's own: a shared token and an ``X-Event`` id, scoped by the
    sender account."""

    name = "bearer"
    headers = ("authorization", "x-event", "x-account")

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        token = headers.get("authorization", "").encode()
        if not hmac.compare_digest(token, b"Bearer let-me-in"):
            raise WebhookRefusedError("The delivery's token is not this endpoint's.")
        if "x-event" not in headers:
            raise WebhookRefusedError("No X-Event header.", malformed=True)
        return Delivery(headers["x-event"], headers.get("x-account", ""))


def _app(runs: list[bytes]) -> Starlette:
    async def receive(request: Request) -> JSONResponse:
        body = await request.body()
        runs.append(body)
        return JSONResponse({"n": len(runs)})

    marked = webhook(Bearer(), ttl_seconds=60)(receive)
    return Starlette(
        routes=[Route("/custom", marked, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )


async def test_a_provider_of_ones_own(caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(Bearer(), Provider)
    runs: list[bytes] = []
    app = _app(runs)
    good = [("Authorization", "Bearer let-me-in"), ("X-Event", "e1"), ("X-Account", "a")]
    with caplog.at_level(logging.WARNING, "goblin_idem.middleware"):
        bad = await request(app, path="/custom", body=b"{}", headers=[("X-Event", "e1")])
    mw = IdempotencyMiddleware.of(app)
    assert bad.status == 401
    assert problem(bad)["type"].endswith("webhook-unverified")
    assert "token is not this endpoint's" in caplog.text
    assert mw.counters.webhook_refused == 1
    assert mw.counters.claimed == 0
    first = await request(app, path="/custom", body=b"{}", headers=good)
    again = await request(app, path="/custom", body=b"{}", headers=good)
    assert first.status == again.status == 200
    assert again.header("idempotent-replayed") == b"true"
    other_account = [*good[:2], ("X-Account", "b")]
    assert (await request(app, path="/custom", body=b"{}", headers=other_account)).status == 200
    missing = await request(app, path="/custom", body=b"{}", headers=good[:1])
    assert missing.status == 400
    assert runs == [b"{}", b"{}"]
    assert mw.counters.webhook_refused == 2
    # An Idempotency-Key on a webhook route changes nothing: the delivery id is the key.
    keyed = await request(app, path="/custom", key="k", body=b"{}", headers=good)
    assert keyed.header("idempotent-replayed") == b"true"


async def test_openapi_documents_the_providers_headers() -> None:
    import httpx
    from fastapi import FastAPI
    from openapi_spec_validator import validate

    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())

    @app.post("/hooks/stripe")
    @webhook(Stripe(secrets=["whsec_x"]))
    async def hook(request: Request) -> dict[str, bool]:
        return {"received": True}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        schema = (await c.get("/openapi.json")).json()
    validate(schema)
    operation = schema["paths"]["/hooks/stripe"]["post"]
    names = [p["name"] for p in operation["parameters"] if p["in"] == "header"]
    assert names == ["stripe-signature"]
    assert "Idempotency-Key" not in json.dumps(operation["parameters"])
    examples = operation["responses"]["401"]["content"]["application/problem+json"]["examples"]
    assert list(examples) == ["webhook-unverified"]
    assert (
        "webhook-malformed"
        in operation["responses"]["400"]["content"]["application/problem+json"]["examples"]
    )


def test_shopify_signature_is_the_base64_hmac_of_the_body() -> None:
    body = b'{"id":1}'
    mac = base64.b64encode(hmac.new(b"shh", body, hashlib.sha256).digest()).decode()
    shopify = Shopify(secrets=["old", "shh"])
    headers = {"x-shopify-hmac-sha256": mac, "x-shopify-event-id": "ev-1"}
    assert shopify.verify(headers, body) == Delivery("sha256:" + hashlib.sha256(body).hexdigest())
    with pytest.raises(WebhookRefusedError):
        shopify.verify({**headers, "x-shopify-hmac-sha256": mac.lower()}, body)


_PROVIDERS_BY_NAME = {
    "standard": lambda: StandardWebhooks(secrets=STANDARD_SECRETS),
    "stripe": lambda: Stripe(secrets=STRIPE_SECRETS),
    "github": lambda: GitHub(secrets=GITHUB_SECRETS),
    "shopify": lambda: Shopify(secrets=SHOPIFY_SECRETS),
}


@pytest.mark.parametrize("name", list(_PROVIDERS_BY_NAME))
def test_signatures_are_compared_in_constant_time(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every signature a provider checks goes through `hmac.compare_digest`: a provider
    that compared with ``==`` would verify the genuine delivery below without a call."""
    provider = _PROVIDERS_BY_NAME[name]()
    genuine = signed_delivery(name, "evt_1", event_body("evt_1", "r"))
    compared: list[tuple[bytes, bytes]] = []

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    provider.verify(genuine.headers, genuine.body)
    assert any(a == b for a, b in compared)
    compared.clear()
    bad = forged(genuine)
    with pytest.raises(WebhookRefusedError):
        provider.verify(bad.headers, bad.body)
    assert compared and not any(a == b for a, b in compared)


def test_a_header_sent_twice_is_refused_when_the_provider_reads_it() -> None:
    """However a server spells the two names: the provider would verify one value and the
    handler read the other."""
    from goblin_idem.middleware._request import Identity

    raw = [(b"Webhook-Id", b"msg_evil"), (b"webhook-id", b"msg_1"), (b"x-other", b"1")]
    headers = Identity.header_map({"type": "http", "headers": raw})
    assert "webhook-id" in headers and headers["x-other"] == "1"
    with pytest.raises(WebhookRefusedError, match="more than one webhook-id") as refused:
        headers.get("webhook-id")
    assert refused.value.malformed
