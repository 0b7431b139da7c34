"""GitHub: ``X-Hub-Signature-256: sha256=<hex>``, HMAC-SHA256 of the body under the hook's
secret.

The signature covers the body and nothing else: ``X-GitHub-Delivery`` and
``X-GitHub-Hook-ID`` are not signed, and anyone holding one genuine body (a log line, a
proxy's capture) could re-send it under new ids, or under the id of an event still to come.
So the key is the body's digest (`body_id`) within the provider and the route, and those
headers are not read. A redelivery from GitHub's settings page (the same body under a new
delivery id) is the same delivery, answered from the store.

There is no signed timestamp either: a captured body is answered from the store while its
record lives and runs again after it expires; GitHub redelivers for 3 days, so keep
`ttl_seconds` at least that long.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from ._provider import Delivery, any_equal, body_id, secret_list, unverified

__all__ = ["GitHub"]


class GitHub:
    """Verifies GitHub webhook deliveries; the key is the digest of the signed body."""

    name = "github"
    headers = ("x-hub-signature-256",)

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
        return Delivery(body_id(body))
