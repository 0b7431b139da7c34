"""ReplayCache: completed results kept in memory, valid while the server says nothing.

A stored result never changes: publish writes it with SET NX, so its bytes stand until the key
is gone (expired, evicted, deleted, flushed). A duplicate of a key whose result this process
has read can then be answered from memory, provided the process learns at once that the key
is gone. The server tells it: the shared connection (`AutoPipeline`) speaks RESP3 with
``CLIENT TRACKING ON OPTIN``, and every result kept here was read by a tracked command on
that same connection, so the server pushes an invalidation for it down the same socket when
another client changes the key, or the server expires, evicts or flushes it (NOLOOP: this
connection's own changes are not echoed; `RedisStore` drops the keys it changes itself,
before and after). One cache belongs to one connection and dies with it: a lost, retired or
inherited (fork) connection drops everything, since its tracking is gone too.

Only a key that had a duplicate is kept: the first duplicate, which reads the result from
the store (`RedisStore.claim_unless_done`), starts a fill, and later duplicates are answered
from memory. A publish tracks nothing, so a first run sends the same commands with the
cache as without it (most keys never see a duplicate), and the server's tracking table
holds only the keys that had one (their result and claim keys; bench/README.md has the bytes each
takes).

The fill is race-free because the tracked read and the value read are one step: the value
and the PTTLs of the result and its claim are read inside one MULTI/EXEC preceded by
``CLIENT CACHING YES`` (which covers the whole transaction). Any change after that step is
pushed after its reply, on the same socket, so it is read after the entry is made and
removes it. A fill is registered before it is sent (`start`), and an invalidation or
`clear` meanwhile spoils it: whatever its reply says, it is then not kept (this covers a
push read before the reply, and `RedisStore.forget_cached` called while a fill is on the
wire).

The claim is tracked too: the store's CLAIM returns the result and changes nothing only
while the claim is held (a lost claim is retaken by the next CLAIM), so an entry ends when
either key changes, and at their own expiry (the shorter PTTL read with them, counted from
when the fill was sent, so never later than the server's); also when the budget needs room
(oldest fill first), and on `discard`. `get` reads without the lock (one dict lookup); every
change takes it, so that `RedisStore.forget_cached` may run in any thread.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Final

__all__ = ["DEFAULT_REPLAY_CACHE_BYTES", "ENTRY_OVERHEAD", "ReplayCache"]

#: `RedisStore`'s budget for each shared connection's cache unless given another (0: off):
#: a few thousand typical responses, for a small service's duplicates.
DEFAULT_REPLAY_CACHE_BYTES: Final = 1024 * 1024
#: What an entry costs beside its key and value (the dict slot, the tuple, two objects).
ENTRY_OVERHEAD: Final = 160


class ReplayCache:
    """Results by result key, within `budget` bytes (keys, values and `ENTRY_OVERHEAD`).

    Each entry also names its claim key, read and tracked with it: a duplicate's CLAIM
    changes nothing only while the claim is held, so the entry ends when either key
    changes (a lost claim is then retaken by the next CLAIM, as without the cache)."""

    __slots__ = ("_lock", "budget", "claims", "entries", "pending", "size")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        # result key -> (value, loop time at which it expires, claim key), oldest fill first
        # (an OrderedDict: a dict's first item is found by skipping the slots of the items
        # removed before it, which the budget's steady evictions would make long)
        self.entries: collections.OrderedDict[bytes, tuple[bytes, float, bytes]] = (
            collections.OrderedDict()
        )
        # result key -> spoiled: a fill sent and not yet answered
        self.pending: dict[bytes, bool] = {}
        # claim key -> result key, for every entry and fill
        self.claims: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: bytes, now: float) -> bytes | None:
        """The stored result of `key`, if kept and not yet expired at `now`."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        if now < entry[1]:
            return entry[0]
        self.discard(key)
        return None

    def start(self, key: bytes, claim: bytes) -> bool:
        """Register a fill of `key` (guarded by `claim`) about to be sent; False if `key` is
        kept or a fill of it is already under way (nothing to send then)."""
        with self._lock:
            if key in self.entries or key in self.pending or claim in self.claims:
                return False
            self.pending[key] = False
            self.claims[claim] = key
            return True

    def finish(
        self, key: bytes, claim: bytes, value: bytes | None, ttl_ms: int, sent: float
    ) -> None:
        """A fill's reply: keep `value` for `ttl_ms` (the shorter of the two keys' PTTLs)
        from `sent`, unless an invalidation or a clear came since `start`, a key is gone,
        or the value would take over a quarter of the budget."""
        with self._lock:
            spoiled = self.pending.pop(key, True)
            cost = len(key) + len(claim) + (0 if value is None else len(value)) + ENTRY_OVERHEAD
            if spoiled or value is None or ttl_ms <= 0 or cost * 4 > self.budget:
                if self.claims.get(claim) == key:
                    del self.claims[claim]
                return
            entries = self.entries
            while self.size + cost > self.budget:
                self._dropped(*entries.popitem(last=False))
            entries[key] = (value, sent + ttl_ms / 1000, claim)
            self.size += cost

    def cancel(self, key: bytes, claim: bytes) -> None:
        """A fill that will not finish (its send failed or its reply is not a result)."""
        with self._lock:
            if self.pending.pop(key, None) is not None and self.claims.get(claim) == key:
                del self.claims[claim]

    def filled(
        self, key: bytes, claim: bytes, sent: float, future: asyncio.Future[list[Any]]
    ) -> None:
        """The reply of `AutoPipeline.fill`'s MULTI/EXEC (GET, PTTL, PTTL), as a done
        callback."""
        if future.cancelled() or future.exception() is not None:
            self.cancel(key, claim)
            return
        caching, *_, reply = future.result()
        if isinstance(caching, Exception):  # refused (an ACL changed): the read was untracked
            self.cancel(key, claim)
        elif type(reply) is list and len(reply) == 3 and type(reply[1]) is type(reply[2]) is int:
            value = reply[0]
            ttl = min(reply[1], reply[2])
            self.finish(key, claim, value if type(value) is bytes else None, ttl, sent)
        else:
            self.cancel(key, claim)

    def discard(self, key: bytes) -> None:
        """Forget `key` (a result key, or the claim key of one): the server's invalidation,
        or this process changing or forgetting it. A fill of it under way is spoiled.

        A key with no entry, no fill and no claim returns at once, without the lock: each
        membership test is atomic, every change is made under the lock, and a fill that
        starts after the tests is the caller's own race, as it is after the lock's release
        (a first run's publish asks here for keys that are almost never kept)."""
        if key not in self.entries and key not in self.pending and key not in self.claims:
            return
        with self._lock:
            for result in (key, self.claims.get(key)):
                if result is not None:
                    if result in self.pending:
                        self.pending[result] = True
                    self._pop(result)

    def clear(self) -> None:
        """Forget everything (FLUSHALL, a lost connection); every fill under way is spoiled."""
        with self._lock:
            self.entries.clear()
            self.size = 0
            self.claims = {c: r for c, r in self.claims.items() if r in self.pending}
            for key in self.pending:
                self.pending[key] = True

    def _pop(self, key: bytes) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._dropped(key, entry)

    def _dropped(self, key: bytes, entry: tuple[bytes, float, bytes]) -> None:
        value, _, claim = entry
        self.size -= len(key) + len(claim) + len(value) + ENTRY_OVERHEAD
        if self.claims.get(claim) == key:
            del self.claims[claim]
