"""A WSGI request as the ASGI middleware sees it, and a WSGI app as its bridge runs it.

`scope_of` makes the ASGI scope of an environ: the full path (SCRIPT_NAME + PATH_INFO, its
UTF-8 decoded as an ASGI server decodes it) as `path`, SCRIPT_NAME as `root_path`, the
headers lowercased; the environ itself is there as ``scope["wsgi.environ"]`` for a `scope=`
function. A WSGI server joins repeated headers with commas, so two Idempotency-Key headers
arrive as one key (``a,b``), where an ASGI server would pass both and get a 400.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeAlias
from wsgiref.util import FileWrapper

from starlette.types import Scope

from ._bridge import ClientGone, Responder

__all__ = ["WSGIApp", "WSGIResponder", "body_cut", "body_reader", "read_whole", "scope_of"]

ExcInfo: TypeAlias = tuple[type[BaseException], BaseException, TracebackType | None]
StartResponse: TypeAlias = Callable[..., Callable[[bytes], object]]
WSGIApp: TypeAlias = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

READ_BYTES = 64 * 1024  # a request body read in chunks of this size
FILE_BLOCK_BYTES = 64 * 1024  # wsgi.file_wrapper's block, at least: one crossing per block


def scope_of(environ: dict[str, Any]) -> Scope:
    names = _HEADER_NAMES
    headers = [
        (names.get(name) or _header_name(name), value.encode("latin-1"))
        for name, value in environ.items()
        if name[:5] == "HTTP_"
    ]
    if environ.get("CONTENT_TYPE"):
        headers.append((b"content-type", environ["CONTENT_TYPE"].encode("latin-1")))
    if environ.get("CONTENT_LENGTH"):
        headers.append((b"content-length", environ["CONTENT_LENGTH"].encode("latin-1")))
    root = environ.get("SCRIPT_NAME", "")
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": environ.get("SERVER_PROTOCOL", "HTTP/1.1").partition("/")[2] or "1.1",
        "method": environ["REQUEST_METHOD"],
        "scheme": environ.get("wsgi.url_scheme", "http"),
        "path": _decoded(root + environ.get("PATH_INFO", "")),
        "raw_path": _raw_path(environ),
        "root_path": _decoded(root),
        "query_string": environ.get("QUERY_STRING", "").encode("latin-1"),
        "headers": headers,
        "client": _address(environ.get("REMOTE_ADDR"), environ.get("REMOTE_PORT")),
        "server": _address(environ.get("SERVER_NAME"), environ.get("SERVER_PORT")),
        "wsgi.environ": environ,
    }
    return scope


# An environ's header names as ASGI names them (HTTP_X_REQUEST_ID -> b"x-request-id"), made
# once per name: a request's scope is made for every keyed request, and most of its time
# went to renaming the same few headers. Bounded: the names come from clients.
_HEADER_NAMES: dict[str, bytes] = {}
_HEADER_NAMES_KEPT = 512


def _header_name(name: str) -> bytes:
    renamed = name[5:].replace("_", "-").lower().encode("latin-1")
    if len(_HEADER_NAMES) < _HEADER_NAMES_KEPT:
        _HEADER_NAMES[name] = renamed
    return renamed


def _decoded(path: str) -> str:
    """A PEP 3333 string (the bytes as latin-1) as ASGI carries it (the bytes as UTF-8)."""
    if path.isascii():  # the same either way
        return path
    return path.encode("latin-1").decode("utf-8", "replace")


def _raw_path(environ: dict[str, Any]) -> bytes | None:
    """The request target's path as sent, if the server says (gunicorn's RAW_URI)."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    return raw.partition("?")[0].encode("latin-1") if raw else None


def _address(host: str | None, port: str | None) -> tuple[str, int] | None:
    if not host:
        return None
    return (host, int(port)) if port and port.isdigit() else (host, 0)


def body_reader(environ: dict[str, Any]) -> Callable[[], tuple[bytes, bool]]:
    """The request body's next chunk (and whether more follow), read from wsgi.input: its
    Content-Length's bytes and no more, to the end for a chunked request
    (wsgi.input_terminated), else none. ClientGone for a body cut short."""
    stream = environ["wsgi.input"]
    length = environ.get("CONTENT_LENGTH", "")
    remaining = int(length) if length.isdigit() else None
    terminated = bool(environ.get("wsgi.input_terminated"))

    def read() -> tuple[bytes, bool]:
        nonlocal remaining
        if remaining is None:
            if not terminated:
                return b"", False
            chunk = _read(stream, READ_BYTES)
            return chunk, bool(chunk)
        chunk = _read(stream, min(remaining, READ_BYTES)) if remaining else b""
        if remaining and not chunk:
            raise body_cut(int(length) - remaining, int(length))
        remaining -= len(chunk)
        return chunk, remaining > 0

    return read


def read_whole(environ: dict[str, Any], limit: int) -> bytes | None:
    """The body read up front, if its Content-Length says it is within `limit` bytes:
    that many bytes, never to the end of the stream; ClientGone if fewer came."""
    length = environ.get("CONTENT_LENGTH", "")
    if not length.isdigit() or int(length) > limit:
        return None
    size = int(length)
    if not size:
        return b""
    stream = environ["wsgi.input"]
    body = _read(stream, size)
    while len(body) < size:  # a server may hand over less than asked: ask for the rest
        more = _read(stream, size - len(body))
        if not more:
            raise body_cut(len(body), size)
        body += more
    return body


def _read(stream: Any, size: int) -> bytes:
    """`size` bytes at most from wsgi.input. A server's error while reading (gunicorn's
    NoMoreData, an OSError, when a chunked body ends before its last chunk) means the
    client left."""
    try:
        chunk: bytes = stream.read(size)
    except OSError as exc:
        raise ClientGone(f"the client left while sending the body ({exc!r})") from exc
    return chunk


def body_cut(got: int, declared: int) -> ClientGone:
    """A body shorter than its Content-Length: gunicorn ends wsgi.input where the client
    disconnected, so the short body is a client gone, never a request to run."""
    return ClientGone(f"the client sent {got} of the {declared} bytes of its Content-Length")


def file_wrapper(filelike: Any, blksize: int = 8192) -> FileWrapper:
    """wsgi.file_wrapper: the file read in blocks, each one chunk of the response (a
    server's sendfile cannot serve a response that is copied on its way)."""
    return FileWrapper(filelike, max(blksize, FILE_BLOCK_BYTES))


class WSGIResponder(Responder):
    """A WSGI app run in its request's thread (PEP 3333): start_response may come as late
    as the first non-empty chunk, and again with exc_info until then; write() is kept and
    handed over before the iterable's chunks."""

    def __init__(self, app: WSGIApp, environ: dict[str, Any]) -> None:
        super().__init__()
        self.app = app
        self.environ = environ
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.iterable: Iterable[bytes] | None = None
        self._written: list[bytes] = []
        self._sent = False  # the head was handed over

    def begin(self, body: bytes | None) -> Iterable[bytes]:
        environ = dict(self.environ)
        environ["wsgi.file_wrapper"] = file_wrapper
        if body is not None:
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
        self.iterable = self.app(environ, self.start_response)
        return self.iterable

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
    ) -> Callable[[bytes], object]:
        if exc_info is not None:
            try:
                if self._sent:
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None  # no reference cycle through the traceback
        elif self.status is not None:
            raise RuntimeError("start_response was called twice without exc_info")
        self.status, self.headers = status, list(headers)
        return self.write

    def write(self, data: bytes) -> None:
        self._written.append(bytes(data))

    def pending(self) -> bytes | None:
        if not self._written:
            return None
        data = b"".join(self._written)
        self._written.clear()
        return data

    def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        if self.status is None:
            raise RuntimeError("the WSGI app returned its response without calling start_response")
        self._sent = True
        code = self.status.partition(" ")[0]
        if len(code) != 3 or not code.isdigit():
            raise ValueError(f"the WSGI app's status {self.status!r} does not start with a code")
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in self.headers
        ]
        return int(code), headers

    def close_iterable(self) -> None:
        close = getattr(self.iterable, "close", None)
        if close is not None:
            close()
