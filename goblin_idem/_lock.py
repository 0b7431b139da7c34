"""`Lock`: a distributed lock on a store, held by a lease the watchdog renews (the shape of
redis-py's asyncio lock: a public method checks state, then hands off; a release forgets its
token only once the store said yes)."""

from __future__ import annotations

import asyncio
import secrets
import time
from types import TracebackType

from . import _options as options
from ._lease import Lease, Watchdog
from .exceptions import LockError, LockNotOwnedError
from .store import KeyT, Store, as_bytes

__all__ = ["Lock"]


class Lock:
    """A distributed lock: SET NX PX to take it, CAEXPIRE to keep it, CAD to release it.

    Only the holder's token can renew or release it, so a holder that stalled past its
    lease cannot free a lock somebody else has taken since. `lost` turns True when a
    renewal found the lock gone; `check()` raises LockNotOwnedError then, and so does
    `release()`.
    """

    def __init__(
        self,
        store: Store,
        name: KeyT,
        *,
        lease_seconds: float = 30,
        blocking: bool = True,
        timeout: float | None = None,
        retry_interval: float = 0.05,
        watchdog: Watchdog | None = None,
        lease_ms: int | None = None,
    ) -> None:
        lease = options.seconds(
            "lease_seconds",
            options.renamed_ms("lease_ms", lease_ms, "lease_seconds", lease_seconds, 2),
            minimum=0.001,
        )
        self.store = store
        self.name = as_bytes(name)
        self.lease_seconds = lease
        self.lease_ms = round(lease * 1000)  # the store's unit (SET PX, CAEXPIRE)
        self.blocking = blocking
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.token = secrets.token_hex(16).encode()
        self._watchdog = watchdog
        self._lease: Lease | None = None
        self._delete_sent = False  # a release's delete may have run, unanswered

    @property
    def watchdog(self) -> Watchdog:
        if self._watchdog is None:
            self._watchdog = Watchdog.for_store(self.store)
        return self._watchdog

    @property
    def held(self) -> bool:
        """Held by this object as far as it knows (a lost lease is not held)."""
        return self._lease is not None and not self._lease.lost

    @property
    def lost(self) -> bool:
        return self._lease is not None and self._lease.lost

    async def acquire(self, *, blocking: bool | None = None, timeout: float | None = None) -> bool:
        if self._lease is not None:
            raise LockError("this Lock object already holds the lock")
        blocking = self.blocking if blocking is None else blocking
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if await self.store.set(self.name, self.token, px=self.lease_ms, nx=True):
                self._delete_sent = False
                self._lease = self.watchdog.hold(
                    self.name, self.token, self.lease_ms, label=f"lock {self.name!r}"
                )
                return True
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return False
            await asyncio.sleep(self.retry_interval)

    def check(self) -> None:
        """Raise LockNotOwnedError if the lease was lost while held."""
        if self.lost:
            raise LockNotOwnedError(f"lock {self.name!r} was lost: its lease expired or was taken")

    async def owned(self) -> bool:
        """Ask the store whether the lock still holds this object's token."""
        return self._lease is not None and await self.store.get(self.name) == self.token

    async def release(self) -> None:
        """Stop renewing, then delete the lock if it still holds this object's token.

        Repeatable until it completes: the lease is forgotten only once the store answered
        the delete, so a release that was cancelled or failed (store down) can be called
        again, as redis-py's asyncio lock allows. Renewal stops at the first call (no later
        renewal extends a lock being released: if the delete never comes, the lock expires
        a lease later). A repeated delete that finds nothing, after an earlier attempt may
        have deleted the lock, is taken as done unless the lease had been lost.
        """
        lease = self._lease
        if lease is None:
            raise LockError("cannot release a lock that is not held")
        await self.watchdog.release(lease)
        try:
            deleted = await self.store.cad(self.name, self.token)
        except BaseException:  # cancelled or failed: whether the delete ran is unknown
            self._delete_sent = True
            raise
        self._lease = None
        if deleted != 1 and (lease.lost or not self._delete_sent):
            raise LockNotOwnedError(
                f"lock {self.name!r} was not held at release: its lease expired or was taken"
            )

    async def __aenter__(self) -> Lock:
        if not await self.acquire():
            raise LockError(f"could not acquire lock {self.name!r}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()
