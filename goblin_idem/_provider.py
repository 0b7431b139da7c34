"""What a webhook provider is: a pure function of a delivery's headers and raw body to the
delivery's id and scope, or a refusal (WebhookRefusedError).

The middleware asks the provider before its claim step, so nothing unverified reaches the
store: a forged request carrying a genuine delivery's id is refused without a claim, and
cannot delay, block or answer that delivery. A provider knows nothing of stores, routes or
frameworks; the middleware scopes its id by the provider's name and the route's path.

The id comes only from what the signature covers. Where a scheme signs its delivery id
(Standard Webhooks, Stripe's event id in the body) that id is the key; where it signs the
body alone (GitHub, Shopify) the key is the body's digest (`body_id`), and the id headers,
which anyone holding one genuine body can set to anything, add nothing to it.

Every comparison of a signature is `hmac.compare_digest`, over bytes of the same kind (the
expected and the sent signature in the form the header carries), so the time it takes does
not tell a forger how much of a guess was right. Secrets are checked when the provider is
made: a wrong one stops the app's startup.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ._durations import seconds
from .exceptions import WebhookRefusedError

__all__ = [
    "DEFAULT_TOLERANCE_SECONDS",
    "Delivery",
    "Provider",
    "any_equal",
    "b64decode",
    "body_id",
    "check_timestamp",
    "malformed",
    "secret_list",
    "tolerance",
    "unverified",
]

#: How far a signed timestamp may be from this server's clock, either way: what the
#: providers' own libraries default to.
DEFAULT_TOLERANCE_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class Delivery:
    """A verified delivery: its id (the idempotency key) and what makes that id unique
    besides the provider and the route (empty for most). Both come from what the
    signature covers: a value a forger can choose would let one genuine body run again
    under each new value, or take another delivery's key first."""

    id: str
    scope: str = ""


@runtime_checkable
class Provider(Protocol):
    """A webhook sender's scheme. `verify` reads the headers (names in lowercase, values
    as sent, decoded as latin-1) and the raw body, and returns the Delivery or raises
    WebhookRefusedError. `name` scopes the ids (two providers never share a key space);
    `headers` lists the request headers the scheme reads, for the OpenAPI document."""

    @property
    def name(self) -> str: ...

    @property
    def headers(self) -> tuple[str, ...]: ...

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery: ...


def unverified(reason: str) -> WebhookRefusedError:
    """A 401 refusal: the signature is missing, wrong, or its timestamp out of tolerance."""
    return WebhookRefusedError(reason)


def malformed(reason: str) -> WebhookRefusedError:
    """A 400 refusal: a delivery without the parts the scheme requires (its id)."""
    return WebhookRefusedError(reason, malformed=True)


def secret_list(owner: str, secrets: Iterable[str | bytes] | str | bytes) -> tuple[bytes, ...]:
    """The secrets as bytes (a text secret as UTF-8), one at least; several while a secret
    is being rotated (any of them verifies)."""
    if isinstance(secrets, (str, bytes)):
        raise TypeError(
            f"{owner}(secrets=...) takes a list of secrets (several while one is rotated): "
            f"pass [secret], not the secret itself"
        )
    found: list[bytes] = []
    for secret in secrets:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, bytes) or not secret:
            raise ValueError(f"{owner}(secrets=...): every secret must be a non-empty str or bytes")
        found.append(secret)
    if not found:
        raise ValueError(f"{owner}(secrets=...) needs at least one secret")
    return tuple(found)


def tolerance(owner: str, value: float) -> float:
    return seconds(f"{owner}(tolerance_seconds=...)", value, minimum=1)


def b64decode(text: str | bytes) -> bytes | None:
    """Strict base64 (RFC 4648 alphabet, padded); None for anything else."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def check_timestamp(raw: str | None, limit: float) -> int:
    """The signed Unix timestamp (whole seconds), refused (401) if it is further than
    `limit` seconds from this server's clock: a captured delivery replayed later with its
    signature intact is refused even after its record has expired."""
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 12:
        raise unverified("The delivery's timestamp is missing or not a Unix time in seconds.")
    stamp = int(raw)
    if abs(time.time() - stamp) > limit:
        raise unverified(
            f"The delivery's timestamp is more than {limit:g} seconds from this server's "
            "clock; a provider's retry is signed afresh."
        )
    return stamp


def body_id(body: bytes) -> str:
    """The id of a delivery whose scheme signs the body and not the id: the SHA-256 of the
    exact signed bytes. The same body re-sent under any delivery id (the provider's manual
    redelivery, or a forger's copy) is the same delivery, answered from the store; it cannot
    take another event's key, whose body differs. Two events whose bodies are byte for byte
    the same are one delivery."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


def any_equal(expected: Iterable[bytes], sent: Iterable[bytes]) -> bool:
    """Whether any sent signature equals any expected one, each pair compared in constant
    time (every pair is compared: how many match does not change the time either)."""
    found = False
    sent = tuple(sent)
    for mine in expected:
        for theirs in sent:
            found |= hmac.compare_digest(mine, theirs)
    return found
