"""A plain WSGI app (no framework) under goblin_idem.wsgi.IdempotencyMiddleware, for gunicorn:
REDIS_URL names the store (the embedded MemoryStore if unset). ``POST /work`` counts its run
(tests.support.apps.counting) and answers 201 with the length of the body it read."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from goblin_idem import MemoryStore, RedisStore, Store
from goblin_idem.wsgi import IdempotencyMiddleware
from tests.support.apps import counting


def plain(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    if environ["PATH_INFO"] == "/health":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    length = environ.get("CONTENT_LENGTH", "")
    body = environ["wsgi.input"].read(int(length)) if length.isdigit() else b""
    run = counting.count(environ.get("HTTP_IDEMPOTENCY_KEY", "-"))
    reply = json.dumps({"run": run, "read": len(body)}).encode()
    start_response("201 Created", [("Content-Type", "application/json")])
    return [reply]


def _store() -> Store:
    url = os.environ.get("REDIS_URL")
    return RedisStore.from_url(url) if url else MemoryStore()


app = IdempotencyMiddleware(plain, store=_store())
