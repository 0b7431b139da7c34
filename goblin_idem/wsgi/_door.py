"""The one sync front door: what the WSGI (and Flask) adapter and Django's middleware under
WSGI do around the ASGI middleware, written once.

- which requests it takes: the ASGI middleware's own decision (`Routes.may_cover`, then
  `Routes.covering`), made in the request's thread and handed to the middleware in the
  scope (`COVERED`), so that a request the options do not cover never crosses to the loop
  thread and a covered one is not decided twice;
- a duplicate whose result the loop thread's connection keeps, answered in the request's
  thread (`MemoryReplays`);
- the bridge: the middleware started on the loop thread for the request, the app run back
  in the request's thread (`_bridge`), and the request's thread serving it (`Outer`).

Each adapter keeps only its framework's part: where the key header, the body and the
endpoint's mark come from, and how the outer response is made.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Message, Scope

from .._routes import COVERED
from .._threads._exchange import Exchange
from .._threads._loop import loop_thread
from ..middleware import IdempotencyMiddleware as ASGIIdempotencyMiddleware
from ._bridge import HANDOFF, Handoff, Outer, Responder
from ._memory import MemoryReplays

__all__ = ["SyncDoor"]


class SyncDoor:
    """The sync adapters' door onto one ASGI middleware (`core`), run on the loop thread."""

    __slots__ = ("core", "key_name", "max_body_bytes", "memory", "methods", "routes")

    def __init__(self, core: ASGIIdempotencyMiddleware, *, in_thread: bool = True) -> None:
        self.core = core
        self.routes = core.routes
        self.methods = core.methods
        self.max_body_bytes = core.max_body_bytes
        self.key_name = "HTTP_" + core.header_name.upper().replace("-", "_")  # the environ's
        # Replays from memory serve the request's thread; under ASGI (Django's async path)
        # the middleware runs in the request's own loop and replays them itself.
        self.memory = MemoryReplays.of(core) if in_thread else None

    def may_cover(self, method: str | None, key: str | None, marked: bool) -> bool:
        """Whether the request can be taken, told before its scope is made."""
        return method in self.methods and self.routes.may_cover(key is not None, marked)

    def covers(self, scope: Scope, keyed: bool) -> bool:
        """Whether the middleware takes the request (`Routes.covering`); if it does, its
        settings go in the scope, as decided."""
        settings = self.routes.covering(scope, keyed)
        if settings is None:
            return False
        scope[COVERED] = settings
        return True

    def replay(
        self, scope: Scope, key: str | None, body: bytes | None
    ) -> tuple[Message, bytes] | None:
        """A duplicate's replay from memory, its event reported: its start message and body;
        None to take the bridge (`MemoryReplays.answer`)."""
        if self.memory is None or key is None or body is None:
            return None
        return self.memory.answer(scope, scope[COVERED], key, body)

    def bridge(
        self,
        scope: Scope,
        responder: Responder,
        body: bytes | None,
        read: Callable[[], tuple[bytes, bool]] | None,
    ) -> Outer:
        """The middleware started on the loop thread for this request, its app `responder`
        run back in this thread, with the body read up front (`body`), else read a chunk a
        call (`read`); the request's thread then serves it through the `Outer` returned."""
        exchange = Exchange(loop_thread())
        handoff = Handoff(exchange, responder, body, read)
        scope[HANDOFF] = handoff
        exchange.start(self.core(scope, handoff.receive, handoff.send))
        return Outer(handoff)
