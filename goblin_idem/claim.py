"""The claim of the running work, as the work itself sees it: `current_claim()`.

A `once` function and a handler run by the middleware hold a claim that a watchdog renews;
before committing a side effect, the work can ask whether it still holds it
(`ensure_owned`). A run that has lost its claim (the lease lapsed while the store was
unreachable, or an operator deleted the key) may be racing a second run of the same work.

The holder sets a context variable around the run, so `current_claim()` costs the work
nothing until it asks; tasks the work starts inherit it, as context variables go.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import itertools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    DataError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from .errors import ClaimLostError, describe
from .keys import KeyNames
from .lease import Lease
from .store import ClaimReply, Published, Store

__all__ = [
    "Claim",
    "ClaimHolder",
    "current_claim",
    "free_claim",
    "new_token",
    "poll_claim",
    "publish_deadline",
    "publish_retried",
    "run_to_end",
]

logger = logging.getLogger("goblin_idem.claim")

ClosingStep = Callable[[], Coroutine[Any, Any, None]]

#: Refusals a server gives only for now: a slot migrating, the cluster down, a primary
#: demoted to a replica by a failover.
TRANSIENT_REFUSALS = (TryAgainError, ClusterDownError, ReadOnlyError)

# A publish that failed is sent again after a pause that starts here and doubles up to
# the cap (the middleware's and once's), until `publish_deadline`.
PUBLISH_FIRST_PAUSE = 0.05
PUBLISH_MAX_PAUSE = 0.2


class _ClaimTokens:
    """Claim tokens of 12 characters (base64url of 72 bits), a different one for every
    claim of the process: a random start plus a counter, instead of reading the system's
    randomness on every request. A forked child takes a new start. Twelve, not the
    ``<pid>:<16 hex digits>`` of earlier releases: a claim's value lives as long as its
    result, and Redis 7 keeps a value of up to 12 bytes in a 32-byte allocation, one of 22
    in a 48-byte one (16 bytes a completed key)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = secrets.randbits(72)
        self.count = itertools.count()

    def __call__(self) -> bytes:
        n = (self.start + next(self.count)) & 0xFF_FFFF_FFFF_FFFF_FFFF
        return base64.urlsafe_b64encode(n.to_bytes(9, "big"))


new_token = _ClaimTokens()
"""A fresh claim token: every claim of this process, the middleware's and `once`'s, has its own."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=new_token.reset)


class Claim:
    """One run's claim: its key hash (what logs show), token, and whether it is still held."""

    __slots__ = ("_lease", "_store")

    def __init__(self, store: Store, lease: Lease) -> None:
        self._store = store
        self._lease = lease

    @property
    def key_hash(self) -> str:
        return self._lease.label

    @property
    def token(self) -> bytes:
        return self._lease.token

    @property
    def lost(self) -> bool:
        """True once a watchdog renewal found the claim no longer this run's (no round trip)."""
        return self._lease.lost

    async def ensure_owned(self) -> None:
        """Raise ClaimLostError unless the store holds this run's token under the claim key.

        One round trip (a GET of the claim key), none if the watchdog already saw the claim
        lost. It reads and never writes, so asking after the result was stored is harmless.
        What it proves holds when the store answered; the watchdog keeps renewing the claim
        after it, and no check closes the gap between itself and the commit that follows.
        """
        lease = self._lease
        if not lease.lost and await self._store.get(lease.key) == lease.token:
            return
        raise ClaimLostError(
            f"the claim of key {lease.label} is no longer held by this run: its lease lapsed "
            "or the key was taken or deleted, so another run may be doing the same work",
            key_hash=lease.label,
        )

    def claim(self) -> Claim:
        return self

    def __repr__(self) -> str:
        state = "lost" if self.lost else "held"
        return f"Claim(key_hash={self.key_hash!r}, {state})"


class ClaimHolder(Protocol):
    """What runs the work and holds its claim: a Claim itself, or the middleware's
    responder, which builds one only when the handler asks (nothing per request else)."""

    def claim(self) -> Claim: ...


# Set by the holder around the run (`.set` before, `.reset` after): two calls per run.
current: contextvars.ContextVar[ClaimHolder | None] = contextvars.ContextVar(
    "goblin_idem_claim", default=None
)


def current_claim() -> Claim | None:
    """The claim of the run this code is part of (a `once` function, or a handler run by
    IdempotencyMiddleware for a request with a key); None outside such a run."""
    holder = current.get()
    return None if holder is None else holder.claim()


async def poll_claim(
    step: Callable[[], Awaitable[ClaimReply]], wait_seconds: float, poll_seconds: float
) -> ClaimReply:
    """Poll with the claim step itself while the key is in flight, for up to `wait_seconds`:
    it returns the result once the first run published it, and wins the claim (CLAIMED)
    if the first run died and its lease ran out meanwhile. None if still in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    reply: ClaimReply = None
    while reply is None and loop.time() < deadline:
        await asyncio.sleep(poll_seconds)
        reply = await step()
    return reply


# -- the closing steps of a claimed run, shared by the middleware and once --


def publish_deadline(lease: Lease) -> float:
    """When a publish stops being retried (time.monotonic()): a third of the lease before
    the claim would expire, counted from its last successful renewal (or from when it was
    held).

    Until then the claim keeps duplicates out, so a publish that lands after a store
    restart, a failover or a slot's migration still makes them replay; the third left
    covers the last attempt (up to a socket timeout if the store does not answer) and the
    claim's own round trip. The watchdog renews at a third of the lease, so a publish is
    retried for a third to two thirds of it (less if renewals were failing): for the
    default 30 s lease 10 to 20 s, and a client waits for the end of its response at most
    20 s plus one socket timeout (5 s by `from_url`'s default)."""
    return lease.renewed_at + lease.ms * 2 / 3000


async def publish_retried(
    store: Store, names: KeyNames, data: bytes, ttl_ms: int, lease: Lease
) -> Published:
    """`store.publish` (the result and the claim's new TTL in one MULTI/EXEC), sent again
    after an error a retry can fix (`_worth_retrying`), after pauses of 50 ms doubling up to
    200 ms, while the next attempt would start before `publish_deadline`; the last error
    propagates. Every attempt is bounded by the store's socket timeout, and a repeat is
    safe: SET NX writes nothing over an earlier attempt that landed, which the store tells
    apart from another run's result."""
    deadline = publish_deadline(lease)
    pause = PUBLISH_FIRST_PAUSE
    while True:
        try:
            return await store.publish(names.result, data, ttl_ms, names.claim, lease.token)
        except Exception as exc:
            if not _worth_retrying(exc) or time.monotonic() + pause >= deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(2 * pause, PUBLISH_MAX_PAUSE)


def _worth_retrying(exc: Exception) -> bool:
    """Whether a store call that failed with `exc` may succeed if sent again soon: not when
    the server refused the command itself (a ResponseError: a permission, a wrong type, a
    value too large, memory) or the credentials, or the arguments were wrong, unless the
    refusal is for now only (TRYAGAIN while a slot migrates, CLUSTERDOWN, READONLY after a
    failover). A lost connection, a timeout, a server still loading its data, or too few
    replicas acknowledging (NotReplicatedError) are worth another try."""
    if isinstance(exc, TRANSIENT_REFUSALS):
        return True
    permanent = (ResponseError, AuthenticationError, DataError, TypeError, ValueError)
    return not isinstance(exc, permanent)


async def free_claim(store: Store, names: KeyNames, token: bytes) -> None:
    """Free the claim if it still holds `token` (its lease's TTL frees it if this fails)."""
    try:
        await store.cad(names.claim, token)
    except Exception as exc:
        logger.warning(
            "could not release key %s (its lease will expire): %s", names.hash, describe(exc)
        )


async def run_to_end(step: ClosingStep, background: set[asyncio.Task[Any]]) -> None:
    """Run a closing store step (publish, release) so that cancelling the caller cannot cut
    it short, without a task per run.

    The step runs inline. If the caller is cancelled while the step waits, the step starts
    again from the beginning in a task of its own (kept in `background` until it ends) and
    the cancellation goes on; whatever the first attempt had sent may still run, so every
    step must be safe to repeat (SET and CAEXPIRE with the same value and token, CAD with the
    same token) and count nothing that a repeat would count twice. A task per first run (to
    shield it) cost about 8 us and half the garbage collections of a Redis-backed first run.
    """
    try:
        await step()
    except asyncio.CancelledError:
        task = asyncio.ensure_future(step())
        background.add(task)
        task.add_done_callback(background.discard)
        raise
