"""The WSGI app for a request the middleware passes straight through, with records that keep
their transaction in the request's thread (`goblin_idem._threads._records`).

A request without a key on a route that does not require one never reaches the loop
thread (the middleware's fast path); with such records it still gets a transaction of its
own (`ThreadRecords.work`, current while the app runs), so that the app's writes through
it (``goblin_idem.sql.sync``) commit as one unit: when the response starts with a status
below 500, before anything of it reaches the server, so a commit that fails is answered
503 ``not-committed`` and never follows a 2xx; rolled back on a 5xx or an exception. As
the ASGI middleware's `Unkeyed` does for the requests it runs without a claimed key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .. import _problems as problems
from .._log import describe
from .._threads._records import ThreadRecords, ThreadWork
from ._app import WSGIApp

__all__ = ["UnkeyedApp"]

logger = logging.getLogger("goblin_idem.middleware")


class UnkeyedApp:
    """`app`, each request in a transaction of `backend`'s, committed at its response's start."""

    def __init__(self, app: WSGIApp, backend: ThreadRecords, retry_after: str) -> None:
        self.app = app
        self.backend = backend
        self.retry_after = retry_after

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        work = self.backend.work(None)
        work.begin()
        head = _Head()
        iterable: Iterable[bytes] | None = None
        token = work.enter()
        try:
            iterable = self.app(environ, head.start_response)
            chunks = iter(iterable)
            first = head.first(chunks)
            code = head.code
        except BaseException:
            work.leave(token)
            work.rollback()
            _close(iterable)
            raise
        work.leave(token)
        if code >= 500:
            work.rollback()
        elif not self._committed(work, environ):
            _close(iterable)
            return self._not_committed(start_response)
        start_response(head.status, head.headers)
        return _Rest(first, chunks, iterable)

    def _committed(self, work: ThreadWork, environ: dict[str, Any]) -> bool:
        try:
            work.commit_work()
        except Exception as exc:
            logger.error(
                "%s %s: the request's writes did not commit: answering 503 (%s)",
                environ.get("REQUEST_METHOD"),
                environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""),
                describe(exc),
            )
            return False
        return True

    def _not_committed(self, start_response: Callable[..., Any]) -> list[bytes]:
        problem = problems.NOT_COMMITTED
        body = problems.problem_body(problem, "The request's effects did not commit. Retry it.")
        start_response(
            f"{problem.status} Service Unavailable",
            [
                ("Content-Type", "application/problem+json"),
                ("Content-Length", str(len(body))),
                ("Retry-After", self.retry_after),
            ],
        )
        return [body]


class _Head:
    """The app's start_response, kept until the transaction has ended; what it wrote."""

    __slots__ = ("headers", "status", "written")

    def __init__(self) -> None:
        self.status = ""
        self.headers: list[tuple[str, str]] = []
        self.written: list[bytes] = []

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        if self.status and exc_info is None:
            raise RuntimeError("start_response was called twice without exc_info")
        self.status, self.headers = status, list(headers)
        return self.written.append

    def first(self, chunks: Iterator[bytes]) -> bytes:
        """The response's first non-empty chunk (what write() wrote first), or b"" for an
        empty body: by then the app has called start_response (PEP 3333)."""
        for chunk in chunks:
            if self.written or chunk:
                return b"".join(self.written) + bytes(chunk)
        return b"".join(self.written)

    @property
    def code(self) -> int:
        if not self.status:
            raise RuntimeError("the WSGI app returned its response without calling start_response")
        return int(self.status[:3])


class _Rest:
    """The response as the server iterates it: the first chunk, then the app's, closed."""

    __slots__ = ("_chunks", "_first", "_iterable")

    def __init__(self, first: bytes, chunks: Iterator[bytes], iterable: Iterable[bytes]) -> None:
        self._first: bytes | None = first
        self._chunks = chunks
        self._iterable = iterable

    def __iter__(self) -> _Rest:
        return self

    def __next__(self) -> bytes:
        first, self._first = self._first, None
        if first:
            return first
        return next(self._chunks)

    def close(self) -> None:
        _close(self._iterable)


def _close(iterable: Iterable[bytes] | None) -> None:
    close = getattr(iterable, "close", None)
    if close is not None:
        close()
