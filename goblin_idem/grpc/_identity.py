"""Where an RPC's key, scope and fingerprint come from.

- The key: AIP-155's ``request_id``, the request message's string field named `key_field`
  when its type has one and it is not empty; else the call's metadata `key_metadata`;
  neither, and the call is not keyed. A key is checked as an HTTP key is (1 to 255
  printable ASCII characters); a malformed one is refused with INVALID_ARGUMENT.
- The scope: the full method name (``/pkg.Service/Method``) and the caller's identity: the
  user's ``scope=`` (a function of the call's context), else the call's ``authorization``
  metadata, as HTTP's default is the Authorization header, so that two callers that pick
  the same request id never get each other's response.
- The fingerprint: the request serialized deterministically with the key field cleared
  (every message of a client stream, in order), so that a retry with the same request id
  matches and another request under it is told apart (FAILED_PRECONDITION).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from .._keys import DEFAULT_KEY_PATTERN, KeyNames, key_names

__all__ = ["Identity", "Refused"]

_STRING = FieldDescriptor.TYPE_STRING


class Refused(Exception):
    """A call whose key cannot be used: answered INVALID_ARGUMENT, nothing claimed."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Built once from the interceptor's options; asked once per call."""

    namespace: bytes
    key_field: str
    key_metadata: str  # lowercase, as gRPC delivers metadata names
    scope: Callable[[Any], bytes | str] | None
    _fields: dict[type, bool] = field(default_factory=dict)  # has the key field, per type

    def has_field(self, message: Any) -> bool:
        """Whether `message`'s type has a string field named `key_field` (once per type)."""
        kind = type(message)
        known = self._fields.get(kind)
        if known is None:
            descriptor = getattr(message, "DESCRIPTOR", None)
            found = None if descriptor is None else descriptor.fields_by_name.get(self.key_field)
            known = self._fields[kind] = (
                found is not None and found.type == _STRING and not _repeated(found)
            )
        return known

    def key(self, messages: Sequence[Any], metadata: Iterable[tuple[str, Any]]) -> str | None:
        """The call's key: the first message's field, else the metadata's; None for none.
        Refused: a later message naming another key, metadata sent twice, a bad key."""
        key = ""
        if messages and self.has_field(messages[0]):
            key = getattr(messages[0], self.key_field)
            for later in messages[1:]:
                other = getattr(later, self.key_field) if self.has_field(later) else ""
                if other and other != key:
                    raise Refused(
                        f"the messages of this call name two {self.key_field}s: a client "
                        "stream's messages carry one request id (the first message's), or "
                        "none after it"
                    )
        if not key:
            values = [v for k, v in metadata if k == self.key_metadata]
            if len(values) > 1:
                raise Refused(f"{self.key_metadata} was sent {len(values)} times; send it once")
            if not values:
                return None
            key = values[0] if isinstance(values[0], str) else ""
            if not key:
                raise Refused(f"{self.key_metadata} must be a text value, not empty or binary")
        if DEFAULT_KEY_PATTERN.fullmatch(key.encode("utf-8", "surrogatepass")) is None:
            source = self.key_field if messages and self.has_field(messages[0]) else "key"
            raise Refused(
                f"the {source} {key[:40]!r} is not a valid idempotency key: use 1 to 255 "
                "printable ASCII characters (a UUID)"
            )
        return key

    def names(
        self, method: str, key: str, context: Any, metadata: Iterable[tuple[str, Any]]
    ) -> KeyNames:
        """The store key names of `key` in its scope: the method, then the caller."""
        if self.scope is None:
            who: bytes = b""
            for name, value in metadata:
                if name == "authorization":
                    who = value.encode() if isinstance(value, str) else bytes(value)
                    break
        else:
            given = self.scope(context)
            if not isinstance(given, (bytes, str)):
                raise TypeError(
                    f"scope= must return the caller's identity as bytes or str, not "
                    f"{type(given).__name__}"
                )
            who = given.encode() if isinstance(given, str) else given
        # A method name has no newline: (method, who) can be read back from the scope.
        return key_names(self.namespace, method.encode() + b"\n" + who, key.encode())

    def fingerprint(self, messages: Sequence[Any]) -> bytes:
        """16 bytes for the request's messages, each serialized deterministically with the
        key field cleared (and put back: the handler sees the request as it came)."""
        h = hashlib.blake2b(digest_size=16)
        for message in messages:
            key = None
            if self.has_field(message):
                key = getattr(message, self.key_field)
                setattr(message, self.key_field, "")
            try:
                data = message.SerializeToString(deterministic=True)
            finally:
                if key:
                    setattr(message, self.key_field, key)
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
        return h.digest()


def _repeated(descriptor: Any) -> bool:
    # protobuf 5.x deprecates `label` in favour of `is_repeated`; both are read.
    repeated = getattr(descriptor, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return bool(descriptor.label == FieldDescriptor.LABEL_REPEATED)
