"""One request's run of the app under the claim it won (Starlette's responder pattern).

The middleware decides; a `Run` does. Built from the middleware's `RunConfig` (plain
values computed once) and the request's key names, token and fingerprint, with no
reference back to the middleware, it is the core's run under a won claim (`_run.Held`:
the lease, the claim's context, the publish or the release, the events) for an ASGI
response: it passes the response through as it streams and keeps a copy, and closes with
one store step: publish the response (the result and the claim's new TTL in one
MULTI/EXEC) before the client gets the message that ends it, or release the key (CAD with
the run's token) if the app failed, or its status is not the request's outcome
(`_outcome`: a redirect, a throttle, an authentication refusal; a redirect is remembered
first, `_hops`). With SQL records (`records=`), the response is held back until the run's
transaction commits with its record, before the publish (`_recorded.Recorded`).

A response ends, by the ASGI spec and its extensions, with the body message whose
`more_body` is false, a `http.response.pathsend`, or a `http.response.zerocopysend` whose
`more_body` is false; if its start said `trailers: True`, with the `http.response.trailers`
message whose `more_trailers` is false instead. A file that pathsend or zerocopysend names
is read here, up to what may still be stored, and sent on as a body message of the bytes
read: what is stored is then what the client got, even if the file changes afterwards. A
file too large to store goes to the server as it came, and the response is stored as not
replayable; one that cannot be read goes as it came too, and the key is released, as for a
response that failed. Other messages (`http.response.debug`, early hints) pass through and
are not stored.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from redis.exceptions import ResponseError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import _options as options
from .._claim import Claim
from .._closing import ClosingStep, start_again
from .._events import log_store_error
from .._keys import KeyNames, hop_key
from .._log import describe
from .._outcome import is_outcome
from .._routes import Settings
from .._run import Core, Held
from .._threads._loop import in_loop_thread
from ..exceptions import DatabaseUnavailableError
from ..records._compression import Compressor
from ..records._format import Record, encode
from ..records._sealing import Sealer
from ..store._server_errors import VALUE_TOO_LARGE
from . import _hops
from ._recorded import HOLDING, Recorded, Recording

__all__ = ["Run", "RunConfig"]

logger = logging.getLogger("goblin_idem.middleware")

# Never stored or replayed: they describe one connection, not the response.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
HOP_BY_HOP_BUT_TRAILER = HOP_BY_HOP - {b"trailer"}


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What every run of one middleware shares, computed once in its ``__init__``.

    `core` is what the runs of every door share (the store, its watchdog, the event
    function, the records, the closing steps started again after a cancel); `warned` holds
    the one-time warnings already logged: with `core.background`, the only state runs share."""

    core: Core
    app: ASGIApp
    sealer: Sealer | None
    compressor: Compressor | None
    compress_above: int
    max_response_bytes: int
    fingerprint_headers: frozenset[str]  # lowercase names the key covers (for Vary)
    warned: set[str]
    recording: Recording | None = None  # records=: the response commits before it is sent

    @classmethod
    def from_options(
        cls,
        core: Core,
        app: ASGIApp,
        *,
        encryption_keys: Sequence[bytes] | Sealer | None,
        compression: str | None,
        compress_above_bytes: int,
        max_response_bytes: int,
        fingerprint_headers: Iterable[bytes],
    ) -> RunConfig:
        """The middleware's options on what is stored, checked (a wrong one raises)."""
        return cls(
            core,
            app,
            options.sealer(encryption_keys),
            options.compressor(compression),
            options.whole_number("compress_above_bytes", compress_above_bytes, minimum=0),
            options.whole_number("max_response_bytes", max_response_bytes, minimum=0),
            frozenset(h.decode("latin-1") for h in fingerprint_headers),
            set(),
        )

    def encoded(self, record: Record, name: bytes) -> bytes:
        """The record's bytes, sealed for the store key `name`."""
        return encode(
            record,
            sealer=self.sealer,
            name=name,
            codec=self.compressor,
            compress_above=self.compress_above,
        )


@dataclass(eq=False, slots=True)
class Run(Held):
    """The one run of the app under a won claim. Its `send` passes the response through as
    it streams, keeps a copy, and holds back the message that ends the response until the
    response is published (or the claim released), so a client that saw the whole response
    can rely on its replay (how a response ends: the module docstring)."""

    config: RunConfig
    _send: Send
    fp: bytes
    settings: Settings
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    keep: bool = True  # False: release the key at the end, store nothing
    hop: bool = False  # a complete redirect, remembered as the key is released (_hops)
    trailers: list[tuple[bytes, bytes]] | None = None  # None: none declared
    finished: bool = False  # the closing step has started
    recorded: Recorded | None = None  # records=: the run's transaction and held response

    async def __call__(self, scope: Scope, receive: Receive) -> None:
        """Run the app once, holding the claim's lease, and close with one store step."""
        config = self.config
        if config.recording is not None:  # connection() in the handler: this run's
            self.recorded = config.recording.recorded(self, self._send, self.fp, scope)
        self.hold(self.settings.lease_ms)
        self.enter(self)  # current_claim() in the handler: self.claim()
        unavailable: DatabaseUnavailableError | None = None
        try:
            await config.app(scope, receive, self.send)
        except Exception as exc:
            # The database unavailable to the work (at connection(), or its own writes:
            # SQLite busy past its timeout) is answered 503, once the key is released,
            # below; any other error of the app is the app's.
            if self.recorded is None or self.recorded.sent or self.tx is None:
                raise
            unavailable = self.tx.unavailable(exc)
            if unavailable is None:
                raise
        finally:
            self.leave()
            if not self.finished:
                # Raised, cancelled, or returned without a complete response: the work
                # may not have happened, so free the key for the client's retry.
                self.keep = self.hop = False
                await self._finish()
        if unavailable is not None:
            assert self.recorded is not None
            if not await self.recorded.answer_unavailable(unavailable):
                raise unavailable.__cause__ or unavailable

    def claim(self) -> Claim:
        """This run's claim, for current_claim() in the handler: built when asked."""
        return Claim(self.core.store, self.lease, in_loop_thread)

    # -- the response, as it streams --

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            self.keep = is_outcome(self.settings.outcome, self.status)
            self.hop = not self.keep and self.status in _hops.REPEAT_ELSEWHERE
            if message.get("trailers", False):
                self.trailers = []
                self.hop = False
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            if self.keep or self.hop:
                self.size += len(chunk)
                if self.size <= self.config.max_response_bytes:
                    self.chunks.append(chunk)
                else:
                    self.chunks.clear()
            if not message.get("more_body", False) and self.trailers is None and not self.finished:
                self.finished = True  # inline, as the hot path: no coroutine for it, nor
                step = self._closing_step()  # run_to_end's (a cancel: started again)
                try:
                    await step()
                except asyncio.CancelledError:
                    start_again(step, self.core.background)
                    raise
        else:
            message = await self._other(message)
        if self.recorded is None:
            await self._send(message)
        else:
            await self._held(message, self.recorded)

    async def _held(self, message: Message, recorded: Recorded) -> None:
        """With records: `message` held until the record commits (`Recorded`). A response
        too large to hold commits when it reaches `max_response_bytes`, as completed but
        not replayable, and then streams on."""
        if (
            recorded.state == HOLDING
            and self.keep
            and not self.finished
            and self.size > self.config.max_response_bytes
        ):
            await self.to_end(self._commit_early)
        # A response that is not the outcome (a 5xx, a redirect, a 429) commits nothing: it
        # passes, and the run's transaction is rolled back when the key is released.
        await recorded.pass_on(message, self.finished or not self.keep)

    async def _commit_early(self) -> None:
        assert self.recorded is not None
        self.data = self.config.encoded(
            Record(self.status, [], b"", self.fp, replayable=False), self.names.result
        )
        if await self.recorded.commit(self.data) is None:
            self.keep = False  # nothing happened: the key is released at the end

    async def _other(self, message: Message) -> Message:
        """The other ends of a response (trailers, pathsend, zerocopysend); any other
        message passes as it came."""
        kind = message["type"]
        if kind == "http.response.trailers":
            if self.trailers is not None:
                self.trailers += message.get("headers", ())
            if not message.get("more_trailers", False):
                await self._finish()
        elif kind == "http.response.pathsend" or kind == "http.response.zerocopysend":
            message = await self._file_as_body(message)
            if not message.get("more_body", False) and self.trailers is None:
                await self._finish()
        return message

    async def _file_as_body(self, message: Message) -> Message:
        """The body message of the bytes a pathsend or zerocopysend names, or the message
        itself if they are not to be stored (see the module docstring)."""
        room = self.config.max_response_bytes - self.size
        self.hop = False  # a redirect sent as a file is not remembered
        if not self.keep or room < 0:
            return message
        try:
            data = await asyncio.to_thread(_read_file, message, room)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning(
                "key %s: could not read the file the response sends (%s); the key is released",
                self.names.hash,
                describe(exc),
            )
            self.keep = False
            return message
        if data is None:
            self.size = self.config.max_response_bytes + 1  # more than may be stored
            self.chunks.clear()
            return message
        self.size += len(data)  # no more than the room left
        self.chunks.append(data)
        return {
            "type": "http.response.body",
            "body": data,
            "more_body": message.get("more_body", False),
        }

    # -- the closing step: publish, or release --

    async def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            await self.to_end(self._closing_step())

    def _closing_step(self) -> ClosingStep:
        """Publish the response, or release the key (see `_outcome`); counted here, once.
        Run to its end by `run_to_end`, even if the request is cancelled meanwhile."""
        config, names = self.config, self.names
        if not self.keep:
            self.core.report("released", names.hash)
            if self.hop and self.size <= config.max_response_bytes:
                body = b"".join(self.chunks)
                headers = _replay_headers(self.status, self.headers, body, False)
                record = Record(self.status, headers, body, self.fp)
                self.data = config.encoded(record, hop_key(names))
            else:
                self.hop = False
            return self.release
        if self.size > config.max_response_bytes:
            self.core.report("too_large", names.hash)
            record = Record(self.status, [], b"", self.fp, replayable=False)
        else:
            body = b"".join(self.chunks)
            headers = _replay_headers(self.status, self.headers, body, self.trailers is not None)
            if "vary" not in config.warned:
                _warn_vary(headers, names, config)
            record = Record(self.status, headers, body, self.fp, trailers=self.trailers)
        # Encoded now, kept as bytes (which the garbage collector never tracks): the record,
        # its header list and tuples are freed before the publish waits for the store.
        self.data = config.encoded(record, names.result)
        return self.publish if self.recorded is None else self._publish

    async def rollback(self) -> None:
        if self.recorded is not None:
            await self.recorded.settled()  # a commit under way ends first
        await Held.rollback(self)  # the run's writes vanish with its claim

    async def releasing(self) -> None:
        if self.hop:  # while the claim is held: before any run that follows the redirect
            await _hops.remember(
                self.core.store, self.names, self.fp, self.data, self.settings.ttl_ms
            )

    async def _publish(self) -> None:
        """With records: the run's writes and its record, committed together before the
        response goes out; published is what committed (another run's record, if its row
        was first)."""
        assert self.recorded is not None
        committed = await self.recorded.commit(self.data)
        if committed is None:  # the effects did not happen: 503, the key released
            await self.release()
            return
        self.data = committed
        if self.refused:
            _log_refused(self.names, self.core.records)
        await self.publish()

    async def instead(self, exc: Exception) -> bool:
        if not _too_large(exc) or self.size > self.config.max_response_bytes:
            return False
        # More than the store takes (its max_value_bytes, at most what its server accepts):
        # kept as a response over max_response_bytes is, status alone.
        self.size = self.config.max_response_bytes + 1
        step = self._closing_step()  # reports too_large, encodes the status alone
        await step()
        return True

    def unpublished(self, exc: Exception) -> None:
        log_store_error(
            self.core.store,
            logging.ERROR,
            exc,
            "could not publish the response for key %s; a retry after the lease "
            "may run the work again",
            self.names.hash,
        )

    def superseded(self) -> None:
        if not self.refused:  # refused: the stored response is the one this run answered
            _log_superseded(self.names)

    async def lapsed(self) -> None:
        try:
            holder = await self.retake()
        except Exception as exc:
            logger.error(
                "key %s: the claim lapsed before the response was published and "
                "could not be retaken (%s); the next duplicate's claim finds the "
                "stored response, replays it and takes the claim back",
                self.names.hash,
                describe(exc),
            )
            return
        _log_retaken(self.names, self.token, holder, self.core.records, self.refused)


def _too_large(exc: Exception) -> bool:
    """The store refused the record for its size (nothing was sent, or stored)."""
    return isinstance(exc, ResponseError) and str(exc) == VALUE_TOO_LARGE


def _joined(records: object) -> str:
    """Which writes join a run's transaction, as the records say (`joined`: those of a
    backend kept in the request's thread are its `backend`'s)."""
    joined = getattr(getattr(records, "backend", records), "joined", None)
    return joined or "through goblin_idem.sql's connection() or session()"


def _log_superseded(names: KeyNames) -> None:
    logger.warning(
        "key %s: a response was already stored when this run published its own "
        "(another run took the key after this run's claim lapsed or was lost): the "
        "stored one stands and every duplicate gets it; this run's went to its own "
        "client only",
        names.hash,
    )


def _log_refused(names: KeyNames, records: object) -> None:
    """This run's commit was refused by the key's row: another run, which took the key
    after this run's claim lapsed, committed first. Said from the commit's result, once,
    whatever the publish that follows finds (that run's response stored, or its claim)."""
    logger.warning(
        "key %s: another run committed this key first (this run's claim had lapsed or was "
        "lost, and that run took the key): this run's commit was refused, so its writes %s "
        "rolled back and it answered with that run's response; what it committed on a "
        "connection of its own (a session the app made itself) is not rolled back: it "
        "happened twice",
        names.hash,
        _joined(records),
    )


def _log_retaken(
    names: KeyNames, token: bytes, holder: bytes | None, records: object, refused: bool
) -> None:
    """What retaking a lapsed claim found: the claim back, another run's, or nothing. With
    SQL records, after this run committed, the other run's writes in its run's transaction
    cannot commit (this run's record holds the key's row); its writes outside that
    transaction can. After this run's commit was `refused` (`_log_refused` said so), the
    holder is the run that committed, or one that finds its record: nothing more to say."""
    recorded = records is not None
    if holder == token:
        logger.warning(
            "key %s: the claim lapsed before the response was published; retaken for "
            "the result's TTL",
            names.hash,
        )
    elif holder is not None and refused:
        return
    elif holder is not None and recorded:
        logger.warning(
            "key %s: the claim lapsed before the response was published, and another "
            "run (token %s) holds it now: its commit will find this run's record, so its "
            "writes %s roll back and it answers with this run's response; what it commits "
            "on a connection of its own (a session the app made itself) is not rolled "
            "back: it happens twice",
            names.hash,
            holder.decode("latin-1"),
            _joined(records),
        )
    elif holder is not None:
        logger.error(
            "key %s: the claim lapsed before the response was published, and another "
            "run (token %s) holds it now: the work is running a second time",
            names.hash,
            holder.decode("latin-1"),
        )
    else:
        logger.warning(
            "key %s: the claim lapsed before the response was published and was freed "
            "again each time it was retaken; the next duplicate's claim finds the stored "
            "response and replays it",
            names.hash,
        )


# The Vary fields that a middleware adapting each response to its client adds (GZip or
# Brotli: Accept-Encoding; CORS: Origin and the preflight's; Django's LocaleMiddleware:
# Accept-Language). Placed inside the idempotency middleware, it makes the stored
# response one client's variant; placed outside, each duplicate gets its own: a fix the
# user can make. A Vary the app's own views set (Django REST framework adds Accept to
# every response) is the app's, and no order of middleware changes it: not warned about.
REORDERABLE_VARY = frozenset(
    {
        "accept-encoding",
        "origin",
        "access-control-request-method",
        "access-control-request-headers",
        "accept-language",
    }
)


def _warn_vary(headers: list[tuple[bytes, bytes]], names: KeyNames, config: RunConfig) -> None:
    """Once per middleware: the stored response varies by request headers that the key
    does not cover and that a middleware adapting each response (GZip, CORS) adds, so
    every duplicate gets this variant: that middleware is inside this one."""
    varies = [value for name, value in headers if name == b"vary"]
    if not varies:
        return
    fields = {
        field.strip().lower().decode("latin-1") for value in varies for field in value.split(b",")
    }
    fields &= REORDERABLE_VARY
    fields -= config.fingerprint_headers
    if not fields:
        return
    config.warned.add("vary")
    logger.warning(
        "the response stored for key %s varies by %s (its Vary header) but the key "
        "does not: every duplicate gets this variant, whatever its own %s. If a "
        "middleware such as GZipMiddleware or CORSMiddleware added it, it wraps the "
        "idempotency middleware: add IdempotencyMiddleware before it (docs/integration.md: "
        "Middleware order). Logged once.",
        names.hash,
        ", ".join(sorted(fields)),
        " or ".join(sorted(fields)),
    )


def _replay_headers(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, trailers: bool
) -> list[tuple[bytes, bytes]]:
    """The headers to replay: in order, repeated ones kept, hop-by-hop ones dropped, and a
    Content-Length that matches the body (a streamed response had none). A response with
    trailers keeps its Trailer header and gets no Content-Length: the server must frame
    the replay as it framed the original (HTTP/1.1 sends trailers only after a chunked
    body)."""
    if trailers:
        return [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP_BUT_TRAILER]
    kept = [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP]
    if status >= 200 and status not in (204, 304) and all(n != b"content-length" for n, _ in kept):
        kept.append((b"content-length", str(len(body)).encode()))
    return kept


def _read_file(message: Message, limit: int) -> bytes | None:
    """The bytes a pathsend (`path`) or zerocopysend (`file`, `offset`, `count`) message
    sends, or None if there are more than `limit`. A zerocopysend without `offset` reads
    from the file's position and moves it past what it read, as sendfile would."""
    if message["type"] == "http.response.pathsend":
        with open(message["path"], "rb") as f:
            data = f.read(limit + 1)
        return data if len(data) <= limit else None
    file = message["file"]
    fd = file if isinstance(file, int) else file.fileno()
    offset = message.get("offset")
    start = os.lseek(fd, 0, os.SEEK_CUR) if offset is None else offset
    end = os.fstat(fd).st_size
    count = message.get("count")
    if count is not None:
        end = min(end, start + count)
    if end - start > limit:
        return None
    data = os.pread(fd, max(end - start, 0), start)
    if offset is None:
        os.lseek(fd, start + len(data), os.SEEK_SET)
    return data
