"""The middleware's part in the ASGI lifespan: check the store at startup, close it at shutdown.

Startup checks the store before the app's own startup (which may need the store) and the
SQL records after it (which may create their table), and logs a line saying what each is
and whether anything about it is risky; a store that cannot be reached, or that refuses a
command goblin-idem sends, fails startup with a message that names the fix, unless
``check_store=False``; records that cannot be written always do. Shutdown runs after the
app's own (which may still use the store). An app that does not take part in the lifespan
(Django's ASGI handler raises for it) is answered by the middleware alone, as uvicorn's
``--lifespan auto`` would. A server that offers no lifespan gets none of this: the store is
then checked on first use. Options refused while an app built the middleware fail the
startup too (`Refused`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import _log
from .._log import describe
from .._recording import Records
from ..exceptions import StorePermissionError
from ..store import MemoryStore, PostgresStore, RedisStore, Store

__all__ = ["Lifespan", "Refused", "startup_logger"]

logger = logging.getLogger("goblin_idem.lifespan")
# What the app sends once it will not use the store again: the store is closed first.
_CLOSING = frozenset(
    {"lifespan.startup.failed", "lifespan.shutdown.complete", "lifespan.shutdown.failed"}
)


# The labels whose store line was written, by store.
_announced: weakref.WeakKeyDictionary[Store, set[str]] = weakref.WeakKeyDictionary()


class _Silent(logging.LoggerAdapter[logging.Logger]):
    """Drops what it is given: a store's startup line, written already."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        return None


def _once_per_store(store: Store, label: str) -> logging.Logger | _Silent:
    """A store's startup line goes out once per process: several apps or middlewares on
    one store (an app serving a sub-app of its own) say the same line otherwise. Its check
    still runs in every lifespan."""
    said = _announced.setdefault(store, set())
    if label in said:
        return _Silent(startup_logger())
    said.add(label)
    return startup_logger()


def startup_logger() -> logging.Logger:
    """Where the startup line goes: goblin-idem's logger once the application configured
    logging for it; else the server's own log if it has one (uvicorn's default logging
    shows INFO there, and nothing of a library's INFO lines)."""
    if _log.configured(logger.name):
        return logger
    return _log.server_log() or logger


@dataclass(frozen=True, slots=True)
class Lifespan:
    """The middleware's part in one app's lifespan, built from plain values: the app it
    wraps, the store (as the application gave it), and the two options."""

    app: ASGIApp
    store: Store
    check_store: bool
    close_store: bool
    records: Records | None = None
    # Which middleware the store line is about, when an app has more than one ("" for the
    # default namespace): "goblin-idem store (namespace card): ...".
    label: str = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message.get("type") != "lifespan.startup":  # not the protocol; the app decides
            await self.app(scope, _first(message, receive), send)
            return
        try:
            await self._check_store()
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        answered = False  # the app said startup.complete or startup.failed

        async def app_send(message: Message) -> None:
            nonlocal answered
            kind = message["type"]
            if kind in ("lifespan.startup.complete", "lifespan.startup.failed"):
                answered = True
            if kind == "lifespan.startup.complete":
                message = await self._records_checked(message)
            if message["type"] in _CLOSING:
                await self._shutdown()
            await send(message)

        try:
            await self.app(scope, _first(message, receive), app_send)
        except Exception as exc:
            if answered:
                raise
            logger.debug("the app does not take part in the lifespan (%r); answered alone", exc)
        if answered:
            return
        # The app ignored the lifespan: the middleware completes it on its own.
        completed = await self._records_checked({"type": "lifespan.startup.complete"})
        await send(completed)
        if completed["type"] != "lifespan.startup.complete":
            await self._shutdown()
            return
        while (await receive())["type"] != "lifespan.shutdown":
            pass
        await self._shutdown()
        await send({"type": "lifespan.shutdown.complete"})

    async def startup(self) -> None:
        """The sync integrations' check, made when they are built (they have no lifespan):
        the store, then the records."""
        await self._check_store()
        await self._check_records()

    async def _check_records(self) -> None:
        """A database that cannot take the records fails startup, whatever `check_store`
        says."""
        if self.records is not None:
            where = await self.records.check()
            startup_logger().info("goblin-idem records: %s", where)

    async def _records_checked(self, complete: Message) -> Message:
        """The app's startup.complete, or startup.failed if the records cannot be used:
        checked after the app's own startup, which is where an app creates its tables."""
        try:
            await self._check_records()
        except Exception as exc:
            return {"type": "lifespan.startup.failed", "message": str(exc)}
        return complete

    async def _check_store(self) -> None:
        store = self.store
        log = _once_per_store(store, self.label)
        if isinstance(store, MemoryStore):
            log.info(
                "goblin-idem store%s: memory, in this process only (every worker process has "
                "its own: use RedisStore when more than one serves the app)",
                self._label,
            )
            return
        if isinstance(store, PostgresStore):
            try:
                where = await store.check()
            except Exception as exc:
                self._unusable(log, f"goblin-idem store: {exc}", exc)
                return
            log.info("goblin-idem store%s: %s", self._label, where)
            return
        if not isinstance(store, RedisStore):
            log.info("goblin-idem store%s: %s", self._label, type(store).__name__)
            return
        try:
            notes = await store.detection_notes()
        except Exception as exc:
            self._unusable(log, _unusable(store, exc), exc)
            return
        texts = [text.removeprefix("goblin-idem store").lstrip(": ") for _, text in notes]
        modes = [text for text in texts if text.startswith("mode")] or [f"mode: {store.mode}"]
        others = [text for text in texts if not text.startswith("mode")]
        parts = [f"redis at {store.address}", *modes, "every command it sends is allowed", *others]
        level = max((level for level, _ in notes), default=logging.INFO)
        log.log(level, "goblin-idem store%s: %s", self._label, "; ".join(parts))

    def _unusable(self, log: logging.Logger | _Silent, problem: str, exc: Exception) -> None:
        """A store that cannot be used stops startup, unless `check_store` is False."""
        if self.check_store:
            raise RuntimeError(problem + "; or pass check_store=False to start anyway") from exc
        log.warning("%s; starting anyway (check_store=False): those requests get 503", problem)

    @property
    def _label(self) -> str:
        return f" (namespace {self.label})" if self.label else ""

    async def _shutdown(self) -> None:
        if not self.close_store:
            return
        try:
            await self.store.aclose()
        except Exception as exc:  # shutting down goes on
            logger.warning("could not close the goblin-idem store: %s", describe(exc))


class Refused:
    """What a middleware serves as when its options were refused while an app built it:
    the lifespan's startup fails with the error's message, which the server logs before
    it exits (in every lifespan mode that runs the startup); any other scope raises the
    error (a server that runs no lifespan answers each request with a 500 and logs it)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.traceback = error.__traceback__  # as refused, however often it is raised
        self.message = f"IdempotencyMiddleware: {describe(error)}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            raise self.error.with_traceback(self.traceback)
        if (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.failed", "message": self.message})


def _first(message: Message, receive: Receive) -> Receive:
    """`message` (already read), then the server's own receive."""
    pending: list[Message] = [message]

    async def first() -> Message:
        return pending.pop() if pending else await receive()

    return first


def _unusable(store: RedisStore, exc: Exception) -> str:
    if isinstance(exc, StorePermissionError):
        return f"goblin-idem store at {store.address} refuses commands: {exc}"
    return (
        f"goblin-idem store: cannot use the Redis at {store.address} "
        f"({describe(exc)}); start it, or fix the URL the store is built from"
    )
