"""A covered request, from its key to its answer, read top to bottom: the key checked (or a
webhook delivery verified), the body read, the key's names and fingerprint, one claim step
(../_claim_step.py), and one dispatch on its reply: the one run of the app (`Run`), or an
answer of `Answers` (the middleware's plain values: no reference back to it).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from .._claim import new_token
from .._claim_step import ClaimStep
from .._events import Events, log_store_error
from .._keys import KeyNames, header_key, valid_key
from .._routes import Settings
from ..exceptions import DatabaseUnavailableError, WebhookRefusedError
from ..store import CLAIMED, Store
from ._request import BodyTooLarge, Identity, ReplayReceive, read_body
from ._responses import Answers
from ._run import Run, RunConfig

if TYPE_CHECKING:
    from ..webhooks import Provider

__all__ = ["Covered"]

logger = logging.getLogger("goblin_idem.middleware")

# What a store that is down or misbehaving raises, logged as one line; anything else out of
# a store call is logged with its traceback. Every one of them is answered as an outage.
LOGGED_WITHOUT_TRACEBACK = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class Covered:
    """The middleware's path for a covered request with a key, or a webhook delivery."""

    key_pattern: re.Pattern[bytes] | Callable[[bytes], bool]
    max_body_bytes: int
    identity: Identity
    answers: Answers
    claim_step: ClaimStep
    events: Events
    runs: RunConfig
    fail_open: bool
    store: Store  # as the application gave it, for the log lines (not the timed one)
    unkeyed: ASGIApp  # what runs unprotected with `fail_open`

    async def request(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        settings: Settings,
        key: bytes | None,
        keys: int,
        content_length: bytes | None,
    ) -> None:
        """A covered request with a key, or a webhook delivery (`settings.webhook`): the key
        checked, the body read (a delivery verified: `_verified`), the key claimed; then the
        one run, or an answer from the claim step's reply. One coroutine, from the key to
        the answer: each layer more is an object every request keeps across its store round
        trips, and a step more each time it resumes."""
        provider = settings.webhook
        checked = None
        if provider is None:
            checked = None if key is None else header_key(key)
            if keys > 1 or checked is None or not valid_key(checked, self.key_pattern):
                await self.answers.invalid_key(send, malformed=keys == 1 and checked is None)
                return
        try:  # the whole body, before anything else reads it (a signature is checked after)
            body = await read_body(receive, content_length, self.max_body_bytes)
        except BodyTooLarge:
            await self.answers.body_too_large(send)
            return
        if body is None:
            return  # the client left: nothing was claimed, nobody to answer
        if provider is None:
            assert checked is not None
            names, fp = self.identity.identify(scope, checked, body)
        else:
            verified = await self._verified(scope, send, provider, body)
            if verified is None:
                return
            names, fp = verified
        token = new_token()
        try:
            reply = await self.claim_step(names, token, settings.claim_seconds)
        except DatabaseUnavailableError as exc:
            # The records' database could not be asked (the claim, if won, was freed): it
            # may hold a committed record, so nothing runs, whatever fail_open says.
            await self.answers.database_unavailable(send, names, exc)
            return
        except Exception as exc:
            # Anything out of the store step, even a client library's own bug, means the
            # claim is in doubt: answer as for a store that is down, never run unprotected
            # by accident (fail_open decides).
            if not isinstance(exc, LOGGED_WITHOUT_TRACEBACK):
                logger.exception("unexpected error from the store for key %s", names.hash)
            await self._store_failed(exc, scope, ReplayReceive(body, receive), send, names)
            return
        if reply is CLAIMED:
            self.events("claimed", names.hash)
            runs = self.runs
            run = Run(runs.core, names, token, settings.ttl_ms, runs, send, fp, settings)
            await run(scope, ReplayReceive(body, receive))
        elif reply is None:
            await self.answers.in_flight(send, names)
        else:
            await self.answers.stored(reply, fp, send, names)

    async def _verified(
        self, scope: Scope, send: Send, provider: Provider, body: bytes
    ) -> tuple[KeyNames, bytes] | None:
        """A webhook delivery's names and fingerprint, once its provider verified it; None
        after answering a refusal. Nothing unverified reaches the store, so a forged
        request naming a genuine id cannot hold, delay or answer the genuine delivery of
        that id."""
        try:
            delivery = provider.verify(self.identity.header_map(scope), body)
        except WebhookRefusedError as exc:
            await self.answers.webhook_refused(send, provider.name, scope["path"], exc)
            return None
        return self.identity.delivery(scope, provider.name, delivery, body)

    async def _store_failed(
        self, exc: BaseException, scope: Scope, receive: Receive, send: Send, names: KeyNames
    ) -> None:
        """The claim is in doubt: 503, or with `fail_open` the app run unprotected."""
        self.events("store_errors", names.hash)
        if self.fail_open:
            level, then = logging.WARNING, "running unprotected"
        else:
            level, then = logging.ERROR, "answering 503"
        log_store_error(self.store, level, exc, f"store error for key %s, {then}", names.hash)
        if not self.fail_open:
            await self.answers.store_unavailable(send)
            return
        self.events("unprotected", names.hash)
        await self.unkeyed(scope, receive, send)
