"""GitHub: ``X-Hub-Signature-256: sha256=<hex>``, HMAC-SHA256 of the body under the hook's
secret. There is no signed timestamp: a captured delivery replays until its record expires,
and is then answered from nothing (keep `ttl_seconds` at least as long as GitHub redelivers).

``X-GitHub-Delivery`` names the event and is shared by every hook that the event triggers
(a repository's and an organisation's, say), so the key is scoped by ``X-GitHub-Hook-ID``:
two hooks pointed at one endpoint each get their delivery processed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from ._provider import Delivery, any_equal, malformed, secret_list, unverified

__all__ = ["GitHub"]


class GitHub:
    """Verifies GitHub webhook deliveries; the key is ``X-GitHub-Delivery`` within
    ``X-GitHub-Hook-ID``."""

    name = "github"
    headers = ("x-hub-signature-256", "x-github-delivery", "x-github-hook-id")

    def __init__(self, secrets: Iterable[str | bytes]) -> None:
        self._secrets = secret_list("GitHub", secrets)

    def __repr__(self) -> str:  # never the secrets
        return f"GitHub({len(self._secrets)} secrets)"

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        header = headers.get("x-hub-signature-256", "")
        scheme, _, sent = header.partition("=")
        if scheme != "sha256" or not sent:
            raise unverified("The delivery has no X-Hub-Signature-256: sha256=... header.")
        expected = (
            ("sha256=" + hmac.new(s, body, hashlib.sha256).hexdigest()).encode()
            for s in self._secrets
        )
        if not any_equal(expected, [header.encode("latin-1")]):
            raise unverified("X-Hub-Signature-256 does not verify with this hook's secrets.")
        delivery = headers.get("x-github-delivery")
        hook = headers.get("x-github-hook-id")
        if not delivery or not hook:
            raise malformed("The delivery has no X-GitHub-Delivery or no X-GitHub-Hook-ID header.")
        return Delivery(delivery, hook)
