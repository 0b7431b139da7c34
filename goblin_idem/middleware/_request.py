"""What the middleware reads of a request with a key: its body, its store key names and
its fingerprint.

The names hash the key with the caller's scope (keys.py), so that two callers never share
a key; the fingerprint covers method, path, query, body and the headers the middleware is
told to include (record.py), so that a key sent again with another request is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope

from .._keys import KeyNames, default_scope, key_names
from ..exceptions import WebhookRefusedError
from ..records._format import fingerprint

if TYPE_CHECKING:
    from ..webhooks import Delivery

__all__ = ["BodyTooLarge", "DeliveryHeaders", "Identity", "ReplayReceive", "read_body"]

logger = logging.getLogger("goblin_idem.middleware")


@dataclass(slots=True)
class Identity:
    """Key names and fingerprints for one middleware's options (plain values)."""

    namespace: bytes
    scope_of: Callable[[Scope], bytes | str] | None
    fingerprint_headers: tuple[bytes, ...]
    header_name: str
    _warned: bool = field(default=False, init=False)  # logged that callers share a scope

    def identify(self, scope: Scope, key: bytes, body: bytes) -> tuple[KeyNames, bytes]:
        """The key's store names, scoped by the caller (`scope_of`'s answer, or by default
        the Authorization header), and the request's fingerprint."""
        if self.scope_of is None:
            caller, credential = default_scope(scope["headers"])
            if credential is not None and not self._warned:
                self._warn_shared_scope(credential)
        else:
            given = self.scope_of(scope)
            caller = given.encode() if isinstance(given, str) else given
        fp = fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            body,
            self._header_values(scope) if self.fingerprint_headers else (),
        )
        return key_names(self.namespace, caller, key), fp

    def delivery(
        self, scope: Scope, provider: str, delivery: Delivery, body: bytes
    ) -> tuple[KeyNames, bytes]:
        """A verified webhook delivery's store names and fingerprint. The scope is the
        provider, the route's path and the provider's own scope (signed, as the id is), NUL
        separated (no header value holds a NUL, so it never meets a caller's scope): two
        providers or two endpoints never share a key space. The fingerprint is the body
        alone: a redelivery is signed afresh (new timestamp, new signature) and is still
        the same delivery."""
        caller = b"\0".join(
            (
                b"webhook",
                provider.encode(),
                scope["path"].encode("utf-8", "surrogateescape"),
                delivery.scope.encode("utf-8", "surrogateescape"),
            )
        )
        key = delivery.id.encode("utf-8", "surrogateescape")
        return key_names(self.namespace, caller, key), fingerprint("", "", b"", body)

    @staticmethod
    def header_map(scope: Scope) -> Mapping[str, str]:
        """The request's headers as a webhook provider reads them: names in lowercase (as
        ASGI servers send them; lowered again, so that no spelling escapes the rule of
        DeliveryHeaders), values decoded as latin-1 (the bytes as sent). A plain dict when
        no name repeats, the common case: a provider's reads cost a dict's."""
        raw = scope["headers"]
        if not isinstance(raw, (list, tuple)):  # ASGI promises an iterable, not a length
            raw = list(raw)
        found = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw}
        return found if len(found) == len(raw) else DeliveryHeaders(raw)

    def _warn_shared_scope(self, name: bytes) -> None:
        """Once per middleware: a keyed request with no Authorization header but a header
        that carries a credential shares the empty default scope with every such caller."""
        self._warned = True
        logger.warning(
            "a request with an %s carries no Authorization header but a %s header: with "
            "the default scope (the Authorization header) every such caller shares one key "
            "space, so a caller who sends another's key gets the other's stored response, "
            "Set-Cookie included; pass scope= a function that returns the caller's "
            "identity (goblin_idem.header_scope or cookie_scope; docs/scope.md). "
            "Logged once.",
            self.header_name,
            name.decode("latin-1"),
        )

    def _header_values(self, scope: Scope) -> list[bytes]:
        found = dict.fromkeys(self.fingerprint_headers, b"")
        for name, value in scope["headers"]:
            if name in found:
                found[name] = value
        return list(found.values())


class DeliveryHeaders(Mapping[str, str]):
    """The headers of a webhook delivery that repeats a header name, as its provider reads
    them (see Identity.header_map).

    A header sent more than once is refused (400) as soon as the provider reads it: the
    provider would verify one value while the handler, or the framework under it, reads
    another (Starlette's `request.headers[name]` is the first), so a genuine signature could
    vouch for an id the handler never sees."""

    __slots__ = ("_repeated", "_values")

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        values: dict[str, str] = {}
        repeated: set[str] = set()
        for name, value in raw:
            text = name.decode("latin-1").lower()
            if text in values:
                repeated.add(text)
            values[text] = value.decode("latin-1")
        self._values = values
        self._repeated = repeated

    def __getitem__(self, name: str) -> str:
        if name in self._repeated:
            raise WebhookRefusedError(
                f"The delivery has more than one {name} header: the signature would vouch "
                "for one value and the handler might read another.",
                malformed=True,
            )
        return self._values[name]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class BodyTooLarge(Exception):
    """The request body is larger than the middleware takes."""


async def read_body(receive: Receive, content_length: bytes | None, limit: int) -> bytes | None:
    """The whole request body, or None if the client left; BodyTooLarge past `limit` bytes
    (refused by its Content-Length before a byte is read, if it has one)."""
    if content_length is not None and content_length.isdigit():
        if int(content_length) > limit:
            raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None  # nothing was claimed; nobody to answer
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        if not message.get("more_body", False):
            if not chunks and type(chunk) is bytes:  # the common case: one message
                return chunk
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


class ReplayReceive:
    """The request body, already read, as one message; then the client's own receive (so
    an app waiting for http.disconnect still sees it). One object where a closure was four
    (function and cells): it lives as long as the request, and every object a request keeps
    across its store round trips brings the next garbage collection nearer."""

    __slots__ = ("body", "receive")

    def __init__(self, body: bytes | None, receive: Receive) -> None:
        self.body = body
        self.receive = receive

    async def __call__(self) -> Message:
        body = self.body
        if body is not None:
            self.body = None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive()
