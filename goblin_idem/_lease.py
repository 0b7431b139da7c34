"""Leases kept alive by one shared watchdog.

A claim or lock is written with a short lease so that a dead holder frees it. A live holder
keeps it by renewing with CAEXPIRE at a third of the lease: the renewal succeeds only
while the key still holds the holder's token, so it can never extend someone else's lease.
One watchdog task per store (and event loop) renews every due lease in a single pipelined
round trip, instead of one timer task per request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from ._log import describe
from .store import KeyT, Store, as_bytes

__all__ = ["Lease", "Watchdog"]

logger = logging.getLogger("goblin_idem.lease")


@dataclass(eq=False)
class Lease:
    """One held key: renewed by the watchdog until released, or until a renewal replies 0."""

    key: bytes
    token: bytes
    ms: int
    label: str = ""  # what the log names instead of the key (a hash for idempotency keys)
    on_lost: Callable[[Lease], None] | None = None
    due: float = field(default=0.0)
    lost: bool = False
    # When the lease was taken (held) or its last successful renewal was sent, on the
    # time.monotonic() clock: the key keeps the token until `ms` after it, unless it is
    # taken or deleted. (Held is just after the claim's reply, later than its sending by
    # a round trip.)
    renewed_at: float = 0.0
    renewals: _Renewals | None = field(default=None, repr=False)  # where it is held

    def schedule(self, now: float) -> None:
        self.due = now + self.ms / 3000

    def lose(self) -> bool:
        """Mark the lease lost (a renewal, or a write with its token, found the key no
        longer held by it): True, and `on_lost` told, the first time only."""
        if self.lost:
            return False
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(self)
        return True


class Watchdog:
    """Renews every held lease of one store at lease/3, all due renewals in one pipeline.

    A lease is renewed in the event loop that holds it: each loop has its own task, its
    leases and its own store calls (`_Renewals`), and a loop that has closed is dropped
    at the next loop's first lease. The loop task exists only while leases are held.
    A renewal that errs (store down) is retried on the next tick, a third of a lease
    later at most; one that replies 0 marks the lease lost and stops renewing it.
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Store, Watchdog]] = weakref.WeakKeyDictionary()

    def __init__(self, store: Store, *, retry_seconds: float = 0.5) -> None:
        self.store = store
        self.retry_seconds = retry_seconds
        self.renewals = 0
        self.lost = 0
        # Each event loop's renewals, replaced whole (never changed in place) under `_lock`
        # (which guards the counters too), so that a lookup needs no lock.
        self._loops: dict[asyncio.AbstractEventLoop, _Renewals] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_store(cls, store: Store) -> Watchdog:
        """The watchdog shared by everything (middleware, Locks) that holds leases on `store`."""
        dog = cls._shared.get(store)
        if dog is None:
            dog = cls._shared[store] = cls(store)
        return dog

    def __len__(self) -> int:
        return sum(len(renewals.leases) for renewals in self._loops.values())

    def hold(
        self,
        key: KeyT,
        token: KeyT,
        ms: int,
        *,
        label: str = "",
        on_lost: Callable[[Lease], None] | None = None,
    ) -> Lease:
        renewals = self._here()
        lease = Lease(as_bytes(key), as_bytes(token), ms, label, on_lost, renewals=renewals)
        lease.renewed_at = time.monotonic()
        lease.schedule(lease.renewed_at)
        renewals.leases.add(lease)
        task = renewals.task
        if task is None or task.done():
            renewals.task = renewals.loop.create_task(renewals.run())
        elif lease.due < renewals.sleep_until:  # O(1): leases mostly share one length
            renewals.wake.set()
        return lease

    async def release(self, lease: Lease) -> None:
        """Stop renewing `lease`, and return only once no renewal of it is in flight.

        A caller about to give the key a longer TTL (publishing a result) must not have a
        late lease-length renewal land after it and cut that TTL short again.
        """
        if self.stop(lease):
            renewals = lease.renewals or self._here()
            while lease in renewals.renewing and renewals.batch_done is not None:
                await renewals.batch_done.wait()

    def stop(self, lease: Lease) -> bool:
        """Stop renewing `lease`: whether a renewal of it is still in flight, which `release`
        waits for (no coroutine when none is, the common case)."""
        renewals = lease.renewals or self._here()
        renewals.leases.discard(lease)
        return lease in renewals.renewing and renewals.batch_done is not None

    def _here(self) -> _Renewals:
        """The running loop's renewals; a loop's first lease drops those of closed loops."""
        loop = asyncio.get_running_loop()
        try:
            return self._loops[loop]
        except KeyError:
            with self._lock:
                loops = {other: r for other, r in self._loops.items() if not other.is_closed()}
                renewals = loops[loop] = _Renewals(self, loop)
                self._loops = loops
            return renewals

    def _count(self, renewed: int, lost: int) -> None:
        """Add one batch's outcome to the counters every loop shares."""
        with self._lock:
            self.renewals += renewed
            self.lost += lost


class _Renewals:
    """One event loop's part of a Watchdog: the leases it holds, the ones being renewed
    (until `batch_done` is set), and the task that renews them (`run`, in that loop)."""

    def __init__(self, watchdog: Watchdog, loop: asyncio.AbstractEventLoop) -> None:
        self.watchdog = watchdog
        self.loop = loop
        self.leases: set[Lease] = set()
        self.renewing: set[Lease] = set()
        self.batch_done: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.sleep_until = 0.0  # when the task wakes next, unless woken

    def _next_due(self) -> float:
        return min((lease.due for lease in self.leases), default=float("inf"))

    async def run(self) -> None:
        while self.leases:
            self.sleep_until = self._next_due()
            delay = self.sleep_until - time.monotonic()
            if delay > 0:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            await self._renew_due()
        self.task = None

    async def _renew_due(self) -> None:
        now = time.monotonic()
        due = [lease for lease in self.leases if lease.due <= now]
        self.renewing.update(due)
        self.batch_done = done = asyncio.Event()
        try:
            replies = await self.watchdog.store.caexpire_many([(x.key, x.token, x.ms) for x in due])
        except Exception as exc:  # the store is down: keep the leases and try again soon
            logger.warning("lease renewal failed for %d lease(s): %s", len(due), describe(exc))
            replies = [exc] * len(due)
        finally:
            self.renewing.clear()
            done.set()
        sent, now = now, time.monotonic()
        renewed = lost = 0
        for lease, reply in zip(due, replies, strict=True):
            if lease not in self.leases:  # released while the renewal was in flight
                continue
            if isinstance(reply, Exception):
                lease.due = now + min(self.watchdog.retry_seconds, lease.ms / 3000)
            elif reply == 1:
                renewed += 1
                lease.renewed_at = sent
                lease.schedule(now)
            else:
                lost += self._lose(lease)
        self.watchdog._count(renewed, lost)

    def _lose(self, lease: Lease) -> bool:
        self.leases.discard(lease)
        if not lease.lose():
            return False
        logger.warning("lease lost: %s is no longer held by this token", lease.label or "a key")
        return True
