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
import contextvars
from collections.abc import Awaitable, Callable
from typing import Protocol

from .errors import ClaimLostError
from .lease import Lease
from .store import ClaimReply, Store

__all__ = ["Claim", "ClaimHolder", "current_claim", "poll_claim"]


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
