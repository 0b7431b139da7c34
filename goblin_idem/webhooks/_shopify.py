"""Shopify: ``X-Shopify-Hmac-Sha256``, the base64 of HMAC-SHA256 of the body under the app's
client secret. No signed timestamp (see GitHub's note on `ttl_seconds`). The key is
``X-Shopify-Event-Id``: every delivery of one event carries it, retries included.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping

from ._provider import Delivery, any_equal, malformed, secret_list, unverified

__all__ = ["Shopify"]


class Shopify:
    """Verifies Shopify webhook deliveries; the key is ``X-Shopify-Event-Id``."""

    name = "shopify"
    headers = ("x-shopify-hmac-sha256", "x-shopify-event-id")

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
        event = headers.get("x-shopify-event-id")
        if not event:
            raise malformed("The delivery has no X-Shopify-Event-Id header.")
        return Delivery(event)
