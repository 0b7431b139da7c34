"""Stripe: ``Stripe-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>...]``.

Stripe signs ``{t}.{body}`` with HMAC-SHA256 under the endpoint's signing secret (the
``whsec_...`` text itself is the key) and sends every signature (one per active secret while
one is rolled) as a ``v1`` entry; other schemes (``v0``) are ignored. The event id is in the
body (``{"id": "evt_..."}``), read only after the signature verified it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping

from .._provider import (
    DEFAULT_TOLERANCE_SECONDS,
    Delivery,
    any_equal,
    check_timestamp,
    malformed,
    secret_list,
    tolerance,
    unverified,
)

__all__ = ["Stripe"]


class Stripe:
    """Verifies Stripe webhook events; the key is the event's ``id``."""

    name = "stripe"
    headers = ("stripe-signature",)

    def __init__(
        self,
        secrets: Iterable[str | bytes],
        *,
        tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    ) -> None:
        self._secrets = secret_list("Stripe", secrets)
        self.tolerance = tolerance("Stripe", tolerance_seconds)

    def __repr__(self) -> str:  # never the secrets
        return f"Stripe({len(self._secrets)} secrets)"

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        header = headers.get("stripe-signature")
        if not header:
            raise unverified("The delivery has no Stripe-Signature header.")
        stamp = None
        sent: list[bytes] = []
        for item in header.split(","):
            name, _, value = item.strip().partition("=")
            if name == "t":
                if stamp is not None:  # which one was signed is anyone's guess: neither
                    raise malformed("Stripe-Signature has more than one t= timestamp.")
                stamp = value
            elif name == "v1" and value:
                sent.append(value.encode("latin-1"))
        if not sent:  # a timestamp alone, or other schemes only (v0), vouches for nothing
            raise unverified("Stripe-Signature has no v1 signature.")
        check_timestamp(stamp, self.tolerance)
        signed = f"{stamp}.".encode() + body
        expected = (hmac.new(s, signed, hashlib.sha256).hexdigest().encode() for s in self._secrets)
        if not any_equal(expected, sent):
            raise unverified(
                "No v1 signature in Stripe-Signature verifies with this endpoint's secrets."
            )
        try:
            event = json.loads(body)
        except ValueError:
            event = None
        event_id = event.get("id") if isinstance(event, dict) else None
        if not isinstance(event_id, str) or not event_id:
            raise malformed('The event has no "id" in its JSON body.')
        return Delivery(event_id)
