"""The responses the middleware writes itself, worded once for its options.

Every one is a problem document of problems.py with the detail this middleware's options
call for, or the replay of a stored response; each reports its event where it is sent.
Built from plain values (Starlette's responder pattern): no reference to the middleware.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from starlette.types import Message, Send

from .. import _problems as problems
from .._events import Events
from .._keys import KeyNames, hop_key
from .._log import describe
from ..exceptions import RecordError, WebhookRefusedError
from ..records._format import Decoded, Record, decode
from ..records._sealing import Sealer
from ..store import Store
from . import _hops

__all__ = ["REPLAYED", "Answers", "replay_start"]

logger = logging.getLogger("goblin_idem.middleware")

REPLAYED = (b"idempotent-replayed", b"true")


@dataclass(frozen=True, slots=True)
class Answers:
    """The middleware's own answers: refusals of a request, and answers of a duplicate."""

    report: Events
    header_name: str
    any_key: bool  # the default key pattern: any printable ASCII, 1 to 255 characters
    max_body_bytes: int
    retry_after: bytes
    sealer: Sealer | None
    require_sealed: bool  # a record in the clear is answered as unreadable
    store: Store | None = None  # for the redirects a key answered (_hops)
    # The records of a store with a replay cache, decoded once per bytes object it hands
    # back (`Decoded`, within the cache's own budget); None: decoded at each replay.
    decoded: Decoded | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        budget = getattr(self.store, "replay_cache_bytes", 0)
        if type(budget) is int and budget > 0:
            decoded = Decoded(budget, self.sealer, self.require_sealed)
            object.__setattr__(self, "decoded", decoded)

    # -- a request refused: nothing claimed, nothing run --

    async def missing_key(self, send: Send, method: str, path: str) -> None:
        self.report("missing_key")
        await problems.send_problem(
            send,
            problems.MISSING_KEY.for_header(self.header_name),
            f"{self.header_name} is required for {method} {path}.",
        )

    async def invalid_key(self, send: Send, *, malformed: bool) -> None:
        self.report("invalid_key")
        if malformed:
            detail = (
                f"A quoted {self.header_name} must be an RFC 8941 String: printable ASCII "
                'between double quotes, with \\" and \\\\ as the only escapes.'
            )
        else:
            detail = f"Send exactly one {self.header_name} header, " + (
                "of 1 to 255 printable ASCII characters."
                if self.any_key
                else "in the form this service accepts."
            )
        await problems.send_problem(send, problems.INVALID_KEY.for_header(self.header_name), detail)

    async def body_too_large(self, send: Send) -> None:
        self.report("too_large")
        await problems.send_problem(
            send,
            problems.BODY_TOO_LARGE,
            f"An idempotent request body may be at most {self.max_body_bytes} bytes.",
        )

    async def webhook_refused(
        self, send: Send, provider: str, path: str, refusal: WebhookRefusedError
    ) -> None:
        """401 (not verified) or 400 (malformed), logged with the provider's reason: a
        fixed text that names no secret, signature or body."""
        self.report("webhook_refused")
        logger.warning("webhook delivery to %s (%s) refused: %s", path, provider, refusal)
        problem = problems.WEBHOOK_MALFORMED if refusal.malformed else problems.WEBHOOK_UNVERIFIED
        await problems.send_problem(send, problem, str(refusal))

    async def store_unavailable(self, send: Send) -> None:
        """503, not counted here: the store error that caused it is (`store_errors`)."""
        await problems.send_problem(
            send,
            problems.STORE_UNAVAILABLE,
            "The request was not run. Retry it with the same key.",
            [(b"retry-after", self.retry_after)],
        )

    async def database_unavailable(self, send: Send, names: KeyNames, exc: BaseException) -> None:
        """503: the records' database could not serve this run (counted and logged here,
        once per request, as a database error: the store is not at fault)."""
        self.report("database_errors", names.hash)
        logger.error("key %s: %s; answering 503, nothing ran", names.hash, exc)
        await problems.send_problem(
            send,
            problems.DATABASE_UNAVAILABLE,
            "The request was not run: the database its effects commit in is unavailable. "
            "Retry it with the same key.",
            [(b"retry-after", self.retry_after)],
        )

    # -- a duplicate: answered from the claim step's reply --

    async def in_flight(self, send: Send, names: KeyNames) -> None:
        self.report("in_flight", names.hash)
        await problems.send_problem(
            send,
            problems.IN_FLIGHT.for_header(self.header_name),
            "A request with this key is in progress; retry after the Retry-After delay.",
            [(b"retry-after", self.retry_after)],
        )

    def replay(self, data: bytes, fp: bytes, names: KeyNames) -> Record | None:
        """The record a duplicate is answered with as it stands: readable here, of this
        very request (its fingerprint), replayable. None for any other, which `stored`
        answers; the sync adapters' replays from memory (goblin_idem.wsgi._memory) then
        take the ASGI middleware's path."""
        try:
            record = self._decode(data, names)
        except RecordError:
            return None
        return record if record.fingerprint == fp and record.replayable else None

    def _decode(self, data: bytes, names: KeyNames) -> Record:
        if self.decoded is not None:
            return self.decoded(data, names.result)
        return decode(
            data, sealer=self.sealer, name=names.result, require_sealed=self.require_sealed
        )

    async def stored(self, data: bytes, fp: bytes, send: Send, names: KeyNames) -> None:
        """The stored response replayed, byte for byte; or why it is not (422 for another
        request under the same key, 409 for a response too large to have been stored,
        503 for a record this process cannot read). A request that the key's runs once
        redirected gets that redirect replayed instead of 422 (`_hops`)."""
        record = self.replay(data, fp, names)
        if record is not None:
            self.report("replayed", names.hash)
            await _send_record(send, record)
            return
        try:  # the rarer answers: the record read again, to say why it is not replayed
            record = self._decode(data, names)
        except RecordError as exc:
            await self._unreadable(exc, send, names)
            return
        if record.fingerprint != fp:
            if self.store is not None and await self._redirected(fp, send, names):
                return
            self.report("mismatch", names.hash)
            await problems.send_problem(
                send,
                problems.KEY_REUSED.for_header(self.header_name),
                "The key was first used with another method, path, query or body. "
                "Use a new key for a new request.",
            )
            return
        if not record.replayable:
            self.report("not_replayable", names.hash)
            await problems.send_problem(
                send,
                problems.NOT_REPLAYABLE.for_header(self.header_name),
                f"The first request completed with status {record.status}. "
                "Do not retry it with this key.",
            )

    async def _redirected(self, fp: bytes, send: Send, names: KeyNames) -> bool:
        """Whether a redirect that answered this very request was found, and replayed (or,
        if it could not be read, answered 503: the store's error, or an unreadable record)."""
        assert self.store is not None
        try:
            data = await _hops.find(self.store, names, fp)
        except Exception as exc:
            logger.warning("key %s: could not read its redirects: %s", names.hash, describe(exc))
            await self.store_unavailable(send)
            return True
        if data is None:
            return False
        try:
            record = decode(
                data, sealer=self.sealer, name=hop_key(names), require_sealed=self.require_sealed
            )
        except RecordError as exc:
            await self._unreadable(exc, send, names)
            return True
        self.report("replayed", names.hash)
        await _send_record(send, record)
        return True

    async def _unreadable(self, exc: RecordError, send: Send, names: KeyNames) -> None:
        """A stored record this process cannot read: a newer release's format, a sealed
        record no configured key opens, damaged bytes, or with `require_sealed` a record in
        the clear (forged by someone who can write to the store, or written by a process
        still without keys: not replayed either way). The work may have happened, so it is
        never run again (whatever fail_open says); the key stays answered 503 until a
        process that reads it answers, or the result expires."""
        self.report("unreadable", names.hash)
        logger.error(
            "key %s: the stored response cannot be read, answering 503: %s", names.hash, exc
        )
        await problems.send_problem(
            send,
            problems.RECORD_UNREADABLE.for_header(self.header_name),
            "The request with this key was run, but its stored response cannot be read here. "
            "It is not run again; retry later with the same key.",
            [(b"retry-after", self.retry_after)],
        )


def replay_start(record: Record) -> Message:
    """The start of a replay of `record`: its status and headers, and the replay's mark.
    Fresh messages and lists each time: a record may be kept decoded (`Decoded`), and a
    layer outside may change the messages it is sent."""
    start: Message = {
        "type": "http.response.start",
        "status": record.status,
        "headers": [*record.headers, REPLAYED],
    }
    if record.trailers is not None:
        start["trailers"] = True
    return start


async def _send_record(send: Send, record: Record) -> None:
    """The stored response, as the app sent it: with trailers if it declared them (the
    server then frames and delivers them as it did the first time)."""
    await send(replay_start(record))
    await send({"type": "http.response.body", "body": record.body, "more_body": False})
    if record.trailers is not None:
        await send(
            {
                "type": "http.response.trailers",
                "headers": list(record.trailers),
                "more_trailers": False,
            }
        )
