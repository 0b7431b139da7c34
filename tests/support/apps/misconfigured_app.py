"""An app whose IdempotencyMiddleware is given an option it refuses, for the startup tests:
``FRAMEWORK`` is ``fastapi`` (``app.add_middleware``) or ``starlette``
(``middleware=[Middleware(...)]``); ``BAD`` is ``store`` (a URL string where a store is
meant) or ``lease`` (``lease_seconds=0.5``)."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from goblin_idem import IdempotencyMiddleware

BAD: dict[str, dict[str, Any]] = {
    "store": {"store": "redis://127.0.0.1:6379/0"},
    "lease": {"lease_seconds": 0.5},
}
options = BAD[os.environ["BAD"]]


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


app: Any
if os.environ["FRAMEWORK"] == "fastapi":
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, **options)
    app.add_route("/health", health)
else:
    app = Starlette(
        routes=[Route("/health", health)],
        middleware=[Middleware(IdempotencyMiddleware, **options)],
    )
