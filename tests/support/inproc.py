"""An in-process handler that records every real run, and a client loop that retries a key
until it completes, for the scenarios that drive the middleware over ASGI directly."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from tests.support.asgi import request
from tests.support.responses import header, problem_slug


class CountingApp:
    """Each run appends its response body to ``runs[key]``; the body carries a nonce, so a
    replay can be traced to the one run that produced it."""

    def __init__(self, work_s: float = 0.0) -> None:
        self.work_s = work_s
        self.runs: dict[str, list[bytes]] = defaultdict(list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        key = scope["path"].rsplit("/", 1)[-1]
        body = json.dumps({"key": key, "nonce": secrets.token_hex(8)}).encode()
        self.runs[key].append(body)
        if self.work_s:
            await asyncio.sleep(self.work_s)
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


@dataclass
class Answer:
    status: int
    slug: str = ""
    replayed: bool = False
    retry_after: bytes | None = None
    body: bytes = b""
    took: float = 0.0
    escaped: str = ""  # an exception that came out of the middleware instead of an answer
    trace: str = ""


@dataclass
class Tally:
    answers: list[tuple[str, Answer]] = field(default_factory=list)
    completed: dict[str, Answer] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)  # (event, key hash)

    def on_event(self, event: str, key_hash: str) -> None:
        """The middleware's `on_event` hook: every event it reports, in order."""
        self.events.append((event, key_hash))


async def send_once(app: ASGIApp, key: str, body: bytes = b"{}") -> Answer:
    """One request; an exception out of the middleware is an answer with status 0 (an ASGI
    server would drop the connection or answer 500)."""
    start = time.monotonic()
    try:
        reply = await request(app, "POST", f"/task/{key}", key=key, body=body)
    except Exception as exc:
        return Answer(
            0,
            took=time.monotonic() - start,
            escaped=f"{type(exc).__name__}: {exc}",
            trace=traceback.format_exc(),
        )
    answer = Answer(reply.status, body=reply.body, took=time.monotonic() - start)
    answer.replayed = reply.header("idempotent-replayed") == b"true"
    answer.retry_after = header(reply.headers, b"retry-after")
    if reply.status != 201:
        answer.slug = problem_slug(reply.status, reply.headers, reply.body)
    return answer


async def until_done(
    app: ASGIApp, key: str, tally: Tally, deadline: float, pause: float = 0.05
) -> None:
    """Send `key` until it completes (201) or `deadline` (monotonic) passes."""
    while time.monotonic() < deadline:
        answer = await send_once(app, key)
        tally.answers.append((key, answer))
        if answer.status == 201:
            tally.completed.setdefault(key, answer)
            return
        await asyncio.sleep(pause)
