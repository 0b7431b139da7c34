r"""Idempotency-Key parsing and validation, and the store key names derived from it.

The key a request names: the IETF draft defines ``Idempotency-Key`` as an RFC 8941
Structured Field String, so a conforming client sends it quoted::

    Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"

with ``\"`` and ``\\`` as the only escapes and printable ASCII (0x20-0x7E) inside. A value
whose first byte is a double quote is parsed as such an Item: its String's content is the
key, so ``"abc"`` and ``abc`` name the same key (the same store keys, the same replay).
Parameters after the String (``"abc";v=1``) are parsed by RFC 8941's grammar and ignored,
as RFC 8941 section 2 bids for parameters a field does not define: they do not change the
key. Anything else that starts with a quote (unterminated, another escape, a byte outside
0x20-0x7E, text after the closing quote or a malformed parameter) is refused (400). A value
that does not start with a quote is the key as sent, as most clients send UUIDs today.

The raw key never reaches the store: claim and result keys are named by a hash of
(scope, key), so a key of any bytes cannot collide with another tenant's, cannot carry
``{}`` into the cluster hash tag, and never shows up in logs or in `SCAN` output.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Scope

__all__ = [
    "CREDENTIAL_HEADERS",
    "DEFAULT_KEY_PATTERN",
    "KeyNames",
    "cookie_scope",
    "credential_header",
    "credentials_scope",
    "default_scope",
    "failures_key",
    "header_key",
    "header_scope",
    "hop_key",
    "key_names",
    "names_of",
    "previous_names",
    "shown",
    "string_key",
    "valid_key",
]

# 1 to 255 printable ASCII characters (space included), as most payment APIs accept.
DEFAULT_KEY_PATTERN = re.compile(rb"[\x20-\x7e]{1,255}")

# RFC 8941: sf-string (3.3.3), the bare items a parameter value may be (3.3), and an Item
# with its parameters (3.1.2), followed by nothing but the spaces a field may end with (4.2).
_STRING = rb'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"'
_BARE_ITEM = (
    rb"(?:-?[0-9]{1,12}\.[0-9]{1,3}|-?[0-9]{1,15}|"
    + _STRING
    + rb"|[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*|:[A-Za-z0-9+/=]*:|\?[01])"
)
_STRING_ITEM = re.compile(
    rb"(" + _STRING + rb")(?:;\x20*[a-z*][a-z0-9_\-.*]*(?:=" + _BARE_ITEM + rb")?)*\x20*"
)
_ESCAPE = re.compile(rb"\\(.)")


def string_key(raw: bytes) -> bytes | None:
    """The key of a header value sent as an RFC 8941 String Item (it starts with a double
    quote): the String's content, unescaped; None if the value is not such an Item."""
    match = _STRING_ITEM.fullmatch(raw)
    if match is None:
        return None
    content = match.group(1)[1:-1]
    return _ESCAPE.sub(rb"\1", content) if b"\\" in content else content


def header_key(raw: bytes) -> bytes | None:
    """The key an Idempotency-Key header's value names: an RFC 8941 String's content, else
    the value as sent; None for a value that opens a String and is not one."""
    return string_key(raw) if raw[:1] == b'"' else raw


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


# Request headers that carry a caller's credential when Authorization does not: the
# session cookie, and the API-key and token headers of common APIs and gateways. A keyed
# request without Authorization but with one of them shares the anonymous (empty) default
# scope with every other such caller.
CREDENTIAL_HEADERS = frozenset(
    {
        b"cookie",
        b"x-api-key",
        b"api-key",
        b"apikey",
        b"x-apikey",
        b"x-auth-token",
        b"auth-token",
        b"x-access-token",
        b"access-token",
        b"x-token",
        b"x-session-token",
        b"x-session-id",
        b"session-id",
        b"x-goog-api-key",
        b"x-amz-security-token",
        b"x-functions-key",
        b"ocp-apim-subscription-key",
    }
)


def credential_header(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The name of the first header in CREDENTIAL_HEADERS, if any (never its value)."""
    for name, _ in headers:
        if name in CREDENTIAL_HEADERS:
            return name
    return None


_SCOPE_HEADERS = CREDENTIAL_HEADERS | {b"authorization"}


def default_scope(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes | None]:
    """`credentials_scope`, and for an empty one `credential_header`, in one pass over the
    headers (this runs for every keyed request)."""
    credential = caller = None
    for name, value in headers:
        if name in _SCOPE_HEADERS:
            if name != b"authorization":
                credential = credential or name
            elif caller is None:  # the first one's value
                if value:
                    return value, None
                caller = value
    return b"", credential


def header_scope(name: str) -> Callable[[Scope], bytes]:
    """A `scope=` for an app that authenticates by an API key header: the value of header
    `name` (empty if absent), so each key holder has its own key space."""
    wanted = name.lower().encode("latin-1")

    def scope(asgi_scope: Scope) -> bytes:
        for header, value in asgi_scope["headers"]:
            if header == wanted:
                return bytes(value)
        return b""

    return scope


def cookie_scope(name: str) -> Callable[[Scope], bytes]:
    """A `scope=` for an app that authenticates by a session cookie: the value of cookie
    `name` (empty if absent), so each session has its own key space. Name a cookie whose
    value stays the same for the session (a session id), not one that is re-signed as the
    session's data changes, or a retry after such a change runs again."""
    wanted = name.encode("latin-1")

    def scope(asgi_scope: Scope) -> bytes:
        for header, value in asgi_scope["headers"]:
            if header == b"cookie":
                for pair in value.split(b";"):
                    key, sep, cookie = pair.strip().partition(b"=")
                    if sep and key == wanted:
                        return bytes(cookie.strip(b'"'))
        return b""

    return scope


@dataclass(frozen=True, slots=True)
class KeyNames:
    claim: bytes
    result: bytes
    hash: str  # what logs and operators see instead of the key: 32 hex digits


def key_names(namespace: bytes, scope: bytes, key: bytes) -> KeyNames:
    """``<ns>:{<hash>}:c`` and ``<ns>:{<hash>}:r``: one hash tag, so both keys share a
    cluster slot (GOBLIN.CLAIM and the publish transaction touch both)."""
    # length-prefixed: (a, bc) != (ab, c)
    digest = hashlib.blake2b(
        b"".join((len(scope).to_bytes(4, "big"), scope, key)), digest_size=16
    ).digest()
    return _names(namespace, digest, digest.hex())


def names_of(namespace: bytes, digest: str) -> KeyNames:
    """The store keys of a key hash (32 hex digits, as logs print it).

    The hash is in the names as its 16 bytes, not 32 hex digits: at 86 million completed
    keys (1,000 a second, a 24 h TTL) the 32 bytes saved on the two names are 32 bytes per
    key of Redis memory (a 48-byte allocation each becomes a 32-byte one). A ``}`` byte
    would end the cluster hash tag early (and a leading one leave it empty, splitting the
    claim and the result over two slots), so it is written as ``~``: the tag is always
    the 16 bytes, at the cost of 0.09 of the hash's 128 bits. Release 0.1.0 named them by
    the hex digits (CHANGELOG.md: Upgrading from 0.1.0)."""
    return _names(namespace, bytes.fromhex(digest), digest)


def shown(name: bytes) -> str:
    """A store key name as a log line shows it: the key hash (32 hex digits, as the other
    lines print it) for a name `key_names` made, else the name with its bytes escaped. A
    ``}`` byte of the hash, written as ``~`` in the name, shows as 7e: `names_of` maps it
    back to the very same names, so ``inspect`` finds the key."""
    start = name.find(b":{") + 2
    if start >= 2 and name[start + 16 : start + 18] == b"}:" and len(name) == start + 19:
        return name[start : start + 16].hex()
    return repr(name)[2:-1]


def _names(namespace: bytes, digest: bytes, hex_digest: str) -> KeyNames:
    base = namespace + b":{" + digest.replace(b"}", b"~") + b"}:"
    return KeyNames(base + b"c", base + b"r", hex_digest)


def hop_key(names: KeyNames) -> bytes:
    """``<ns>:{<hash>}:h``: the redirects the key's runs answered (`middleware/_hops.py`),
    named as the claim and the result are, so it shares their cluster slot."""
    return names.result[:-1] + b"h"


def failures_key(names: KeyNames) -> bytes:
    """``<ns>:{<hash>}:f``: a broker consumer's count of the key's failed deliveries
    (`consumers/_run.py`), named as the claim is, so it shares its cluster slot and goes
    with it when the key is forgotten."""
    return names.claim[:-1] + b"f"


def previous_names(namespace: bytes, digest: str) -> KeyNames:
    """The names release 0.1.0 gave a key hash: its 32 hex digits in the tag. Read by the
    middleware's `previous_key_names` transition, never written."""
    base = namespace + b":{" + digest.encode() + b"}:"
    return KeyNames(base + b"c", base + b"r", digest)
