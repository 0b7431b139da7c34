"""A scripted HTTP server for the client tests: it answers what the test told it to, and
records every request it got.

- ``POST /_script`` with ``{"responses": [...]}`` sets the answers (each ``{"status",
  "headers", "body", "size", "delay"}``; ``size`` pads the body to that many bytes,
  ``delay`` sleeps that many seconds first); the last one repeats. It also forgets the hits.
- ``GET /_hits``: every request since, as ``{"method", "path", "port", "headers", "body"}``
  (``port`` is the client's, so a test can tell whether attempts shared a connection).
- ``GET /health``; any other request gets the next scripted answer.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

script: list[dict[str, Any]] = [{"status": 200}]
hits: list[dict[str, Any]] = []


async def set_script(request: Request) -> Response:
    global script
    script = list((await request.json())["responses"]) or [{"status": 200}]
    hits.clear()
    return JSONResponse({"ok": True})


async def get_hits(request: Request) -> Response:
    return JSONResponse(hits)


async def health(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def answer(request: Request) -> Response:
    body = await request.body()
    hits.append(
        {
            "method": request.method,
            "path": request.url.path,
            "port": request.client.port if request.client else None,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": base64.b64encode(body).decode(),
        }
    )
    step = script.pop(0) if len(script) > 1 else script[0]
    if step.get("delay"):
        await asyncio.sleep(step["delay"])
    content = step.get("body", "").encode()
    content += b"x" * max(0, step.get("size", 0) - len(content))
    return Response(content, status_code=step["status"], headers=step.get("headers", {}))


app = Starlette(
    routes=[
        Route("/_script", set_script, methods=["POST"]),
        Route("/_hits", get_hits, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/{path:path}", answer, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
)
