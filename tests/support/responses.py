"""Checks on what the middleware answered: headers, what the app itself answered, and the
slug of a problem document (RFC 9457)."""

from __future__ import annotations

import json
from collections.abc import Iterable

PROBLEM = b"application/problem+json"
TYPE_BASE = "urn:goblin-idem:problem:"
# Headers a server adds per response (not part of what the app answered).
PER_RESPONSE = frozenset({b"date", b"server", b"idempotent-replayed"})


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for n, v in headers:
        if n.lower() == name:
            return v
    return None


def app_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """What the app answered, without what the server or the replay adds per response."""
    return [(n.lower(), v) for n, v in headers if n.lower() not in PER_RESPONSE]


def problem_slug(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> str:
    """The problem type's slug of a middleware answer; AssertionError if it is not a
    well-formed problem+json (RFC 9457) answer with a matching status and length."""
    hs = list(headers)
    assert header(hs, b"content-type") == PROBLEM, (status, hs, body[:200])
    assert header(hs, b"content-length") == str(len(body)).encode(), (hs, len(body))
    data = json.loads(body)
    assert data["status"] == status, data
    assert isinstance(data["title"], str) and isinstance(data["detail"], str), data
    assert data["type"].startswith(TYPE_BASE), data
    slug: str = data["type"][len(TYPE_BASE) :]
    return slug
