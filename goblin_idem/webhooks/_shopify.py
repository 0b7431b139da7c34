"""Shopify: ``X-Shopify-Hmac-Sha256``, the base64 of HMAC-SHA256 of the body under the app's
client secret.

The signature covers the body alone: ``X-Shopify-Event-Id`` is not signed, and a captured
body sent first under another event's id would hold that event's key with the wrong body
(422 to the genuine delivery and every retry of it). So the key is the body's digest
(`body_id`) within the provider and the route; the event id is not read. Every retry of one
event carries the same body. No signed timestamp: see GitHub's note on `ttl_seconds`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping

from .._provider import Delivery, any_equal, body_id, secret_list, unverified

__all__ = ["Shopify"]


class Shopify:
    """Verifies Shopify webhook deliveries; the key is the digest of the signed body."""

    name = "shopify"
    headers = ("x-shopify-hmac-sha256",)

    def __init__(self, secrets: Iterable[str | bytes]) -> None:
        self._secrets = secret_list("Shopify", secrets)

    def __repr__(self) -> str:  # never the secrets
        return f"Shopify({len(self._secrets)} secrets)"

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        sent = headers.get("x-shopify-hmac-sha256")
        if not sent:
            raise unverified("The delivery has no X-Shopify-Hmac-Sha256 header.")
        expected = (
            base64.b64encode(hmac.new(s, body, hashlib.sha256).digest()) for s in self._secrets
        )
        if not any_equal(expected, [sent.encode("latin-1")]):
            raise unverified("X-Shopify-Hmac-Sha256 does not verify with this app's secrets.")
        return Delivery(body_id(body))
