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
import binascii
import contextvars
import itertools
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Protocol

from ._derived import call_key, label_key, secret_bytes
from ._lease import Lease
from .exceptions import ClaimLostError
from .store import ClaimReply, Store

__all__ = [
    "Claim",
    "ClaimHolder",
    "current_claim",
    "for_sync_code",
    "new_token",
    "poll_claim",
]

logger = logging.getLogger("goblin_idem.claim")
_URLSAFE = bytes.maketrans(b"+/", b"-_")


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
        # base64.urlsafe_b64encode's two steps, without its two Python calls around them
        return binascii.b2a_base64(n.to_bytes(9, "big"), newline=False).translate(_URLSAFE)


new_token = _ClaimTokens()
"""A fresh claim token: every claim of this process, the middleware's and `once`'s, has its own."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=new_token.reset)


# How sync code runs a coroutine to its end: the door that builds a claim hands it over
# (`_loop.in_loop_thread`, the process's loop thread).
SyncRunner = Callable[[Coroutine[Any, Any, None]], None]


class Claim:
    """One run's claim: its key hash (what logs show), token, and whether it is still held."""

    __slots__ = ("_lease", "_run_sync", "_store", "_sync")

    def __init__(
        self, store: Store, lease: Lease, run_sync: SyncRunner, *, sync: bool = False
    ) -> None:
        self._store = store
        self._lease = lease
        self._run_sync = run_sync
        self._sync = sync  # seen by sync code: ensure_owned() checks at once

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

    def ensure_owned(self) -> Awaitable[None]:
        """Raise ClaimLostError unless the store holds this run's token under the claim key.

        In async code, await it. In sync code (a thread that runs no event loop: a WSGI or
        Django view, a sync `once` function, a FastAPI ``def`` endpoint), call it: it checks
        at once, through the sync runner its door handed it (the process's loop thread), and
        raises there.

        One round trip (a GET of the claim key), none if the watchdog already saw the claim
        lost. It reads and never writes, so asking after the result was stored is harmless.
        What it proves holds when the store answered; the watchdog keeps renewing the claim
        after it, and no check closes the gap between itself and the commit that follows.
        """
        if self._sync or not _in_event_loop():
            self._run_sync(self._check())
            return _CHECKED
        return self._check()

    async def _check(self) -> None:
        lease = self._lease
        if not lease.lost and await self._store.get(lease.key) == lease.token:
            return
        raise ClaimLostError(
            f"the claim of key {lease.label} is no longer held by this run: its lease lapsed "
            "or the key was taken or deleted, so another run may be doing the same work",
            key_hash=lease.label,
        )

    def derive_key(self, label: str, *, secret: bytes | str | None = None) -> str:
        """A key for a call this run makes to another API, named by `label` ("charge",
        "fulfil"): the same in every process and on every re-run of this run's key, a
        different one for another label or another key, and never this run's own key.
        Pass it to a client that takes an idempotency key (a payment SDK, a producer's
        dedupe id), so a second run of this work sends the same key and the next service
        does the work once. `secret`: an app's own HMAC key, mixed in (`_derived`)."""
        return label_key(self._lease.key, secret_bytes(secret), label)

    def _key_for_call(self, method: str, url: str, label: str, secret: bytes) -> str:
        """The httpx transports' key for an outgoing call of this run (`_derived.call_key`)."""
        return call_key(self._lease.key, secret, method, url, label)

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


class _InSyncCode:
    """A run's claim holder, as the sync code the run calls in a thread of its own sees it
    (that thread may run an event loop of its own, blocked while it waits for the run)."""

    __slots__ = ("holder",)

    def __init__(self, holder: ClaimHolder) -> None:
        self.holder = holder

    def claim(self) -> Claim:
        claim = self.holder.claim()
        return Claim(claim._store, claim._lease, claim._run_sync, sync=True)


def for_sync_code(holder: ClaimHolder | None) -> ClaimHolder | None:
    """`holder` (the running coroutine's), for the sync code it calls in another thread."""
    return None if holder is None else _InSyncCode(holder)


class _Checked:
    """What `ensure_owned` returns once it has checked: awaiting it does nothing more."""

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()


_CHECKED = _Checked()


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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
