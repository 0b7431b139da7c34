"""GitHub: ``X-Hub-Signature-256: sha256=<hex>``, HMAC-SHA256 of the body under the hook's
secret.

The signature covers the body and nothing else (``X-GitHub-Delivery`` and
``X-GitHub-Hook-ID`` are not signed), so the key is the body's digest (`body_id`, which
says why) within the provider and the route, and the delivery id is not read.

The hook id counts only where it is checked: with ``hooks={hook_id: [secret]}`` each hook
has a secret of its own, a delivery verifies only with the secrets of the hook it names,
and the hook id scopes the key. Two hooks (a repository's and an organisation's) pointed at
one route then each run their delivery of one event, and a body re-sent under another
hook's id does not verify. With ``secrets=[...]`` the hook id is not read.

There is no signed timestamp: a captured body is answered from the store while its record
lives and runs again after it expires; GitHub redelivers for 3 days, so keep
`ttl_seconds` at least that long.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from .._provider import Delivery, any_equal, body_id, secret_list, unverified

__all__ = ["GitHub"]


class GitHub:
    """Verifies GitHub webhook deliveries; the key is the digest of the signed body, within
    the hook that signed it when each hook has its own secrets (`hooks`)."""

    name = "github"
    headers: tuple[str, ...] = ("x-hub-signature-256",)

    def __init__(
        self,
        secrets: Iterable[str | bytes] | None = None,
        *,
        hooks: Mapping[str | int, Iterable[str | bytes]] | None = None,
    ) -> None:
        if (secrets is None) == (hooks is None):
            raise TypeError(
                "GitHub takes secrets=[...] (the hook id not read) or hooks={hook_id: [...]} "
                "(each hook its own secrets, the hook id checked by them): one of the two"
            )
        self._secrets: tuple[bytes, ...] = ()
        self._hooks: dict[str, tuple[bytes, ...]] | None = None
        if hooks is None:
            assert secrets is not None
            self._secrets = secret_list("GitHub", secrets)
        else:
            self._hooks = _hooks(hooks)
            self.headers = ("x-hub-signature-256", "x-github-hook-id")

    def __repr__(self) -> str:  # never the secrets
        if self._hooks is not None:
            return f"GitHub({len(self._hooks)} hooks)"
        return f"GitHub({len(self._secrets)} secrets)"

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        header = headers.get("x-hub-signature-256", "")
        scheme, _, sent = header.partition("=")
        if scheme != "sha256" or not sent:
            raise unverified("The delivery has no X-Hub-Signature-256: sha256=... header.")
        hook = ""
        secrets = self._secrets
        if self._hooks is not None:
            hook = headers.get("x-github-hook-id", "")
            found = self._hooks.get(hook)
            if found is None:  # hook ids are not secret: refused without comparing
                raise unverified("X-GitHub-Hook-ID names none of this endpoint's hooks.")
            secrets = found
        expected = (
            ("sha256=" + hmac.new(s, body, hashlib.sha256).hexdigest()).encode() for s in secrets
        )
        if not any_equal(expected, [header.encode("latin-1")]):
            raise unverified("X-Hub-Signature-256 does not verify with this hook's secrets.")
        return Delivery(body_id(body), hook)


def _hooks(hooks: Mapping[str | int, Iterable[str | bytes]]) -> dict[str, tuple[bytes, ...]]:
    """Each hook's secrets, none shared: a secret two hooks share would verify a body re-sent
    under the other hook's id, and the hook id would scope nothing it checked."""
    if not isinstance(hooks, Mapping) or not hooks:
        raise ValueError("GitHub(hooks=...) maps each hook id to its secrets: {12345: [secret]}")
    found: dict[str, tuple[bytes, ...]] = {}
    owner: dict[bytes, str] = {}
    for key, secrets in hooks.items():
        hook = str(key)
        if isinstance(key, bool) or not hook.isascii() or not hook.isdigit():
            raise ValueError(
                f"GitHub(hooks=...): a hook id is the number GitHub sends as X-GitHub-Hook-ID, "
                f"not {key!r}"
            )
        found[hook] = secret_list(f"GitHub(hooks[{hook}])", secrets)
        for secret in found[hook]:
            if owner.setdefault(secret, hook) != hook:
                raise ValueError(
                    f"GitHub(hooks=...): hooks {owner[secret]} and {hook} share a secret, so "
                    "neither hook id would be checked; give each hook its own secret, or "
                    "use secrets=[...] (the hooks' deliveries of one body then run once)"
                )
    return found
