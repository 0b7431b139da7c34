"""Webhook deliveries as each provider sends them, signed by the provider's own library where
it has one (standardwebhooks, svix, stripe) and by the documented algorithm where it has
not (GitHub, Shopify), for the receivers of apps/webhook_app.py."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from tests.support.apps.webhook_app import (
    GITHUB_SECRETS,
    SHOPIFY_SECRETS,
    STANDARD_SECRETS,
    STRIPE_SECRETS,
)

PROVIDERS = ("standard", "svix", "stripe", "github", "shopify")
TIMESTAMPED = ("standard", "svix", "stripe")
SIGNED_IDS = ("standard", "svix", "stripe")  # the delivery id is covered by the signature
UNSIGNED_IDS = ("github", "shopify")  # only the body is: the id headers can be anything
WRONG_SECRET = "whsec_dGhpcyBpcyBub3QgdGhlIGVuZHBvaW50J3Mga2V5"


@dataclass(frozen=True)
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes


def event_body(event_id: str, ref: str, mode: str = "", size: int = 0) -> bytes:
    """A JSON event: Stripe's id in the body; padded to at least `size` bytes."""
    event: dict[str, str] = {"id": event_id, "ref": ref, "type": "invoice.paid"}
    if mode:
        event["mode"] = mode
    body = json.dumps(event).encode()
    if size > len(body):
        event["pad"] = "x" * (size - len(body))
        body = json.dumps(event).encode()
    return body


def delivery(
    provider: str,
    event_id: str,
    body: bytes,
    *,
    secret: int | str = 0,
    timestamp: float | None = None,
    hook_id: str = "1",
    path: str | None = None,
) -> Delivery:
    """`body` as `provider` delivers it under `event_id`, signed with the endpoint's secret
    number `secret` (or the secret text given) at `timestamp` (now by default)."""
    stamp = int(time.time() if timestamp is None else timestamp)
    if provider in ("standard", "svix"):
        key = STANDARD_SECRETS[secret] if isinstance(secret, int) else secret
        when = datetime.fromtimestamp(stamp, tz=timezone.utc)
        if provider == "standard":
            from standardwebhooks.webhooks import Webhook

            signature = Webhook(key).sign(event_id, when, body)
        else:
            from svix.webhooks import Webhook as SvixWebhook

            signature = SvixWebhook(key).sign(event_id, when, body.decode())
        prefix = "webhook-" if provider == "standard" else "svix-"
        headers = {
            prefix + "id": event_id,
            prefix + "timestamp": str(stamp),
            prefix + "signature": signature,
        }
        return Delivery(path or "/hooks/standard", headers, body)
    if provider == "stripe":
        import stripe

        key = STRIPE_SECRETS[secret] if isinstance(secret, int) else secret
        header = stripe.WebhookSignature.generate_signature_header(body.decode(), key, stamp)
        return Delivery(path or "/hooks/stripe", {"stripe-signature": header}, body)
    if provider == "github":
        key = GITHUB_SECRETS[secret] if isinstance(secret, int) else secret
        headers = {
            "x-hub-signature-256": github_signature(key, body),
            "x-github-delivery": event_id,
            "x-github-hook-id": hook_id,
            "x-github-event": "push",
        }
        return Delivery(path or "/hooks/github", headers, body)
    if provider == "shopify":
        key = SHOPIFY_SECRETS[secret] if isinstance(secret, int) else secret
        headers = {
            "x-shopify-hmac-sha256": shopify_signature(key, body),
            "x-shopify-event-id": event_id,
            "x-shopify-topic": "orders/create",
        }
        return Delivery(path or "/hooks/shopify", headers, body)
    raise ValueError(provider)


def github_signature(secret: str, body: bytes) -> str:
    """GitHub's documented algorithm: ``sha256=`` and the hex HMAC-SHA256 of the body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def shopify_signature(secret: str, body: bytes) -> str:
    """Shopify's documented algorithm: the base64 of the HMAC-SHA256 of the body."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def forged(genuine: Delivery) -> Delivery:
    """The same id and body under a signature made with a key the endpoint does not have."""
    provider = next(p for p in PROVIDERS if _carries(p, genuine))
    event_id = _id_of(provider, genuine)
    hook = genuine.headers.get("x-github-hook-id", "1")
    wrong = WRONG_SECRET if provider in ("standard", "svix") else "not the endpoint's secret"
    return delivery(provider, event_id, genuine.body, secret=wrong, hook_id=hook, path=genuine.path)


def _carries(provider: str, d: Delivery) -> bool:
    marker = {
        "standard": "webhook-id",
        "svix": "svix-id",
        "stripe": "stripe-signature",
        "github": "x-github-delivery",
        "shopify": "x-shopify-event-id",
    }[provider]
    return marker in d.headers


def _id_of(provider: str, d: Delivery) -> str:
    if provider == "stripe":
        return str(json.loads(d.body)["id"])
    name = {
        "standard": "webhook-id",
        "svix": "svix-id",
        "github": "x-github-delivery",
        "shopify": "x-shopify-event-id",
    }[provider]
    return d.headers[name]
