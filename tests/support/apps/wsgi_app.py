"""A plain WSGI app (no framework) under goblin_idem.wsgi.IdempotencyMiddleware, for gunicorn:
REDIS_URL names the store (the embedded MemoryStore if unset). ``POST /work`` counts its run
(tests.support.apps.counting) and answers 201 with the length of the body it read;
``POST /relay`` does the same for a delivery keyed by the `Relay` provider, whose body the
middleware streams (no Idempotency-Key: it is not read whole up front)."""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from goblin_idem import MemoryStore, RedisStore, Store
from goblin_idem.exceptions import WebhookRefusedError
from goblin_idem.webhooks import Delivery
from goblin_idem.wsgi import IdempotencyMiddleware
from tests.support.apps import counting

RELAY_TOKEN = "relay-token"


class Relay:
    """Deliveries from a trusted relay in front of the app: the id is the X-Relay-Id header,
    trusted for the relay's token; nothing covers the body, so only the middleware's own
    reading stops a body cut short from running."""

    name = "relay"
    headers = ("x-relay-id", "x-relay-token")

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        if not hmac.compare_digest(headers.get("x-relay-token", ""), RELAY_TOKEN):
            raise WebhookRefusedError("not the relay's token")
        event = headers.get("x-relay-id")
        if not event:
            raise WebhookRefusedError("no X-Relay-Id", malformed=True)
        return Delivery(event)


def plain(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    if environ["PATH_INFO"] == "/health":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    length = environ.get("CONTENT_LENGTH", "")
    body = environ["wsgi.input"].read(int(length)) if length.isdigit() else b""
    key = environ.get("HTTP_IDEMPOTENCY_KEY") or environ.get("HTTP_X_RELAY_ID", "-")
    run = counting.count(key)
    reply = json.dumps({"run": run, "read": len(body)}).encode()
    start_response("201 Created", [("Content-Type", "application/json")])
    return [reply]


def _store() -> Store:
    url = os.environ.get("REDIS_URL")
    return RedisStore.from_url(url) if url else MemoryStore()


app = IdempotencyMiddleware(plain, store=_store(), webhooks={"/relay": Relay()})
