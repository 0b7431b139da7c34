"""Standard Webhooks (standardwebhooks.com), which Svix sends too (``svix-`` headers).

The sender signs ``{webhook-id}.{webhook-timestamp}.{body}``: ``v1`` with HMAC-SHA256 under
a shared secret (``whsec_`` and base64), ``v1a`` with Ed25519 under the sender's private key,
verified with its public key (``whpk_`` and base64). ``webhook-signature`` carries one or
more space-separated ``version,base64`` entries: a sender rotating its secret signs with
both, and any one that verifies is enough. The id is signed, so it is the key as sent.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from typing import Any

from .._provider import (
    DEFAULT_TOLERANCE_SECONDS,
    Delivery,
    any_equal,
    b64decode,
    check_timestamp,
    malformed,
    tolerance,
    unverified,
)

__all__ = ["StandardWebhooks"]

_PREFIXES = ("webhook-", "svix-")


class StandardWebhooks:
    """Verifies Standard Webhooks and Svix deliveries; the key is ``webhook-id`` (or
    ``svix-id``). `secrets` are ``whsec_...`` strings (or the raw key bytes); `public_keys`
    are ``whpk_...`` Ed25519 keys for ``v1a`` signatures (the ``crypto`` extra)."""

    name = "standard-webhooks"
    headers = ("webhook-id", "webhook-timestamp", "webhook-signature")

    def __init__(
        self,
        secrets: Iterable[str | bytes] = (),
        *,
        public_keys: Iterable[str | bytes] = (),
        tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    ) -> None:
        if isinstance(secrets, (str, bytes)) or isinstance(public_keys, (str, bytes)):
            raise TypeError(
                "StandardWebhooks takes lists (several while a secret is rotated): "
                "secrets=[secret], public_keys=[key]"
            )
        self._keys = tuple(_secret(s) for s in secrets)
        self._public = tuple(_public_key(k) for k in public_keys)
        if not self._keys and not self._public:
            raise ValueError(
                "StandardWebhooks needs secrets=['whsec_...'] (v1) "
                "or public_keys=['whpk_...'] (v1a)"
            )
        self.tolerance = tolerance("StandardWebhooks", tolerance_seconds)

    def __repr__(self) -> str:  # never the secrets
        return f"StandardWebhooks({len(self._keys)} secrets, {len(self._public)} public keys)"

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        prefix = next((p for p in _PREFIXES if p + "signature" in headers), _PREFIXES[0])
        signatures = headers.get(prefix + "signature")
        if not signatures:  # not a delivery of this sender's: unverified, however formed
            raise unverified(f"The delivery has no {prefix}signature header.")
        _same_under_both_prefixes(headers)
        msg_id = headers.get(prefix + "id")
        if not msg_id:  # signed over the id: without one it cannot be verified
            raise malformed(f"The delivery has no {prefix}id header.")
        stamp = check_timestamp(headers.get(prefix + "timestamp"), self.tolerance)
        signed = f"{msg_id}.{stamp}.".encode("latin-1") + body
        v1: list[bytes] = []
        v1a: list[bytes] = []
        for entry in signatures.split(" "):
            version, _, value = entry.partition(",")
            if version == "v1":
                v1.append(value.encode("latin-1"))
            elif version == "v1a":
                v1a.append(value.encode("latin-1"))
        expected = (
            base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()) for key in self._keys
        )
        ok = any_equal(expected, v1) if v1 and self._keys else False
        if not ok and v1a and self._public:
            ok = _ed25519_any(self._public, signed, v1a)
        if not ok:
            raise unverified(
                f"No signature in {prefix}signature verifies with this endpoint's keys."
            )
        return Delivery(msg_id)


def _same_under_both_prefixes(headers: Mapping[str, str]) -> None:
    """A delivery may carry both spellings (``webhook-`` and ``svix-``), but with one value
    each: verified under one while the handler (Svix's library prefers ``svix-``) reads
    the other, a genuine signature would vouch for an id the handler never sees."""
    for part in ("id", "timestamp", "signature"):
        values = {headers[p + part] for p in _PREFIXES if p + part in headers}
        if len(values) > 1:
            raise malformed(
                f"The delivery's webhook-{part} and svix-{part} headers differ: the "
                "signature would vouch for one and the handler might read the other."
            )


def _secret(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        if not secret:
            raise ValueError("StandardWebhooks(secrets=...): a secret may not be empty")
        return secret
    if not isinstance(secret, str):
        raise TypeError(
            "StandardWebhooks(secrets=...): a secret is a str or bytes, "
            f"not {type(secret).__name__}"
        )
    text = secret.removeprefix("whsec_")
    key = b64decode(text + "=" * (-len(text) % 4))  # senders show some secrets unpadded
    if not key:
        raise ValueError(
            "StandardWebhooks(secrets=...): a secret is 'whsec_' followed by base64, "
            "as the sender shows it; pass raw key bytes as bytes"
        )
    return key


def _public_key(key: str | bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    except ImportError:
        raise RuntimeError(
            "v1a (Ed25519) signatures need the cryptography package: "
            "pip install 'goblin-idem[crypto]'"
        ) from None
    raw = key if isinstance(key, bytes) else b64decode(key.removeprefix("whpk_"))
    if raw is None or len(raw) != 32:
        raise ValueError(
            "StandardWebhooks(public_keys=...): a key is 'whpk_' followed by the base64 of "
            "a 32-byte Ed25519 public key (or those 32 bytes)"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


def _ed25519_any(keys: tuple[Any, ...], signed: bytes, sent: list[bytes]) -> bool:
    from cryptography.exceptions import InvalidSignature

    for key in keys:
        for value in sent:
            signature = b64decode(value)
            if signature is None:
                continue
            try:
                key.verify(signature, signed)
            except InvalidSignature:
                continue
            return True
    return False
