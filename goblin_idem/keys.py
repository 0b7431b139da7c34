"""Idempotency-Key validation and the store key names derived from it.

The raw key never reaches the store: claim and result keys are named by a hash of
(scope, key), so a key of any bytes cannot collide with another tenant's, cannot carry
``{}`` into the cluster hash tag, and never shows up in logs or in `SCAN` output.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_KEY_PATTERN",
    "KeyNames",
    "credentials_scope",
    "key_names",
    "names_of",
    "valid_key",
]

# 1 to 255 printable ASCII characters (space included), as most payment APIs accept.
DEFAULT_KEY_PATTERN = re.compile(rb"[\x20-\x7e]{1,255}")


def valid_key(raw: bytes, pattern: re.Pattern[bytes] | Callable[[bytes], bool]) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(raw) is not None
    return bool(pattern(raw))


def credentials_scope(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The default scope: the caller's Authorization header (empty for anonymous callers),
    so two clients that pick the same key never see each other's response."""
    for name, value in headers:
        if name == b"authorization":
            return value
    return b""


@dataclass(frozen=True, slots=True)
class KeyNames:
    claim: bytes
    result: bytes
    hash: str  # what logs and operators see instead of the key


def key_names(namespace: bytes, scope: bytes, key: bytes) -> KeyNames:
    """``<ns>:{<hash>}:c`` and ``<ns>:{<hash>}:r``: one hash tag, so both keys share a
    cluster slot (GOBLIN.CLAIM and the publish transaction touch both)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(scope).to_bytes(4, "big"))  # length-prefixed: (a, bc) != (ab, c)
    h.update(scope)
    h.update(key)
    return names_of(namespace, h.hexdigest())


def names_of(namespace: bytes, digest: str) -> KeyNames:
    """The store keys of a key hash (32 hex digits, as logs print it)."""
    base = namespace + b":{" + digest.encode() + b"}:"
    return KeyNames(base + b"c", base + b"r", digest)
