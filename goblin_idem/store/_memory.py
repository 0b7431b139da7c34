"""MemoryStore: the GOBLIN commands in-process, the embedded default store."""

from __future__ import annotations

import heapq
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Protocol, TypeAlias

from redis.exceptions import ResponseError

from ._arguments import (
    DEFAULT_MAX_VALUE_BYTES,
    WRITTEN,
    as_bytes,
    caexpire_ms,
    check_size,
    claim_reply,
    claim_seconds,
    publish_ttl,
    set_ttl_ms,
)
from ._protocol import CLAIMED, ClaimReply, KeyT, Published
from ._server_errors import WRONGTYPE

__all__ = ["MemoryStore"]

# Expired entries reclaimed per write at most, so one write never pays for a whole backlog.
_EVICT_PER_WRITE = 64

# What the store holds is laid out so that the garbage collector has nothing to walk, however
# many keys it holds: a full collection visits every object it tracks, and every reference
# held by a tracked container, so per-entry objects (or a list of a million deadlines) would
# lengthen every full collection of the process by tens of milliseconds per million keys.
# A dict whose keys and values are all bytes, floats or None is not tracked. So a string is
# `value` (bytes) in its shard of `_data`; its deadline, if it has a TTL, `seconds`
# (time.monotonic()) in the same shard of `_deadlines`; and expiry goes by buckets, the keys
# due by a bucket's end, `_buckets[end] = {key: None, ...}` (untracked), with the ends in a
# small heap of floats.
# A bucket's width is a power of two seconds, 1/64 to 1/128 of the TTL it was written with
# (1/64 s to 64 s), so a key is reclaimed at most that long after its deadline, and a
# day-long TTL adds one bucket per minute, not one entry per key.
# The width by the bit length of int(ttl * 128): a TTL in [2**(n-8), 2**(n-7)) seconds has
# n bits, and a bucket 2**(n-14) seconds wide, within 2**-6 and 2**6 (from 4096 s on).
_WIDTHS = tuple(2.0 ** min(6, max(-6, n - 14)) for n in range(21))
_WIDEST_FROM = 4096.0

# No single write may do work in proportion to the keyspace. A dict that outgrows its table
# copies every entry into a new one in the write that grows it (and, as expired keys are
# deleted and new ones written, again every so often at the same size): with a million keys
# in one dict that one write took a hundred milliseconds or more, during which every request
# of the process waited. So the keys are spread over `_SHARDS` dicts by their hash, and a bucket
# holds at most `_BUCKET_KEYS` keys (a full one is continued under the next float above its
# end, `_open` holds the one being filled): a write copies at most a shard or one bucket.
_SHARDS = 256
_BUCKET_KEYS = 4096


class _OtherType(Protocol):
    """A value of another type (a hash, a set): no command here makes one, and every one
    reads it as WRONGTYPE, as a server does."""


_Entry: TypeAlias = "bytes | _OtherType"


class _Keyspace:
    """String keys with deadlines, laid out as the comments above say: a key past its
    deadline reads as absent (`_live`), and `_evict` reclaims a few at a time."""

    def __init__(self) -> None:
        self._data: tuple[dict[bytes, _Entry], ...] = tuple({} for _ in range(_SHARDS))
        self._deadlines: tuple[dict[bytes, float], ...] = tuple({} for _ in range(_SHARDS))
        self._buckets: dict[float, dict[bytes, None]] = {}
        self._open: dict[float, dict[bytes, None]] = {}  # an end -> its bucket being filled
        self._ends: list[float] = []  # a heap of the buckets' ends (or continuations)

    def __len__(self) -> int:
        """Entries held, including expired ones not reclaimed yet."""
        return sum(map(len, self._data))

    def _clear(self) -> None:
        for values, deadlines in zip(self._data, self._deadlines, strict=True):
            values.clear()
            deadlines.clear()
        self._buckets.clear()
        self._open.clear()
        self._ends.clear()

    def _deadline(self, key: bytes) -> float | None:
        return self._deadlines[hash(key) % _SHARDS].get(key)

    def _live(self, key: bytes) -> _Entry | None:
        shard = hash(key) % _SHARDS
        entry = self._data[shard].get(key)
        if entry is not None:
            deadline = self._deadlines[shard].get(key)
            if deadline is not None and deadline <= time.monotonic():
                self._drop(key)
                return None
        return entry

    def _live_string(self, key: bytes) -> bytes | None:
        entry = self._live(key)
        if entry is not None and type(entry) is not bytes:
            raise ResponseError(WRONGTYPE)
        return entry

    def _drop(self, key: bytes) -> None:
        """Forget a key (a bucket may still name it: the sweep skips it then)."""
        shard = hash(key) % _SHARDS
        del self._data[shard][key]
        self._deadlines[shard].pop(key, None)

    def _replace(self, key: bytes, entry: _Entry) -> None:
        """A new value under `key`, its deadline (its TTL) kept."""
        self._data[hash(key) % _SHARDS][key] = entry

    def _store(self, key: bytes, value: bytes, deadline: float | None) -> None:
        shard = hash(key) % _SHARDS
        self._data[shard][key] = value
        if deadline is None:
            self._deadlines[shard].pop(key, None)
            return
        # Set the key's deadline, and file it in the bucket that ends just after it.
        self._deadlines[shard][key] = deadline
        ttl = deadline - time.monotonic()
        if ttl >= _WIDEST_FROM:
            width = _WIDTHS[-1]
        else:
            width = _WIDTHS[int(ttl * 128).bit_length()] if ttl > 0 else _WIDTHS[0]
        end = (deadline // width + 1) * width
        bucket = self._open.get(end)
        if bucket is not None and len(bucket) < _BUCKET_KEYS:
            bucket[key] = None
        else:
            self._open_bucket(key, end)

    def _open_bucket(self, key: bytes, end: float) -> None:
        """A new bucket for the keys due by `end`, `key` first: at `end`, or past a full one
        at the first float above it that no bucket has (a continuation, later than `end`,
        so never before the key's deadline)."""
        at = end
        while at in self._buckets:
            at = math.nextafter(at, math.inf)
        self._buckets[at] = self._open[end] = {key: None}
        heapq.heappush(self._ends, at)

    def _evict(self) -> None:
        """Drop up to a few entries whose deadline passed, from the buckets that ended (a
        key a bucket names may have been renewed, rewritten or deleted since, which its
        own deadline tells)."""
        ends = self._ends
        if not ends:
            return
        now = time.monotonic()
        budget = _EVICT_PER_WRITE
        while ends and ends[0] <= now:
            bucket = self._buckets[ends[0]]
            while bucket:
                if not budget:
                    return
                budget -= 1
                key = bucket.popitem()[0]
                deadline = self._deadlines[hash(key) % _SHARDS].get(key)
                if deadline is not None and deadline <= now:
                    self._drop(key)
            end = heapq.heappop(ends)
            del self._buckets[end]
            self._open.pop(end, None)


class MemoryStore(_Keyspace):
    """The four GOBLIN commands and plain GET/SET/PTTL/DEL on a dict, in this process.

    Same replies and error texts as RedisStore. Every method runs without awaiting
    anything, so under asyncio each call is atomic with respect to every other, and holds
    the store's lock throughout, so it is atomic across threads too (a store shared by
    threads each running an event loop). Expiry is
    lazy (a key past its deadline reads as absent) on the monotonic clock, and each write
    also reclaims a few expired entries, so memory tracks the live keys. Nothing it holds
    is tracked by the garbage collector, so its keys add nothing to a collection's pause.

    It is per-process: two workers (uvicorn ``--workers 2``, gunicorn) each have their own
    and do not see each other's claims. Use RedisStore as soon as more than one process
    serves the same keys.
    """

    def __init__(self, *, max_value_bytes: int | None = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__()
        self.max_value_bytes = max_value_bytes
        self._lock = threading.Lock()
        _stores.add(self)

    def forget_cached(self, result_key: KeyT) -> None:
        """Nothing: a MemoryStore keeps no copy of a result beside the result itself
        (`RedisStore.forget_cached`, for the same call on either store)."""

    async def aclose(self) -> None:
        with self._lock:
            self._clear()

    def _put(self, key: bytes, value: bytes, deadline: float | None) -> None:
        self._evict()
        self._store(key, check_size(value, self.max_value_bytes), deadline)

    # -- the four GOBLIN commands --

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """SET claim_key token NX EX seconds, else GET result_key, as one step."""
        with self._lock:
            return self._claim(claim_key, result_key, token, seconds)

    # The steps themselves are plain methods, so that a compound step (claim_unless_done,
    # publish) is one coroutine, not one per command it is made of.

    def _claim(self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int) -> ClaimReply:
        ck, rk = as_bytes(claim_key), as_bytes(result_key)
        tok = as_bytes(token, "token")
        lease = claim_seconds(seconds)
        if self._live(ck) is None:
            self._put(ck, tok, time.monotonic() + lease)
            return CLAIMED
        # Same reply mapping as the wire: a stored b"CLAIMED" reads as the sentinel.
        return claim_reply(self._live_string(rk))

    async def claim_unless_done(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIM where a stored result wins over a free claim, as one step (see Store)."""
        with self._lock:
            reply = self._claim(claim_key, result_key, token, seconds)
            if reply is not CLAIMED:
                return reply
            ck, rk = as_bytes(claim_key), as_bytes(result_key)
            result = self._live(rk)
            if result is None:
                return CLAIMED
            value = self._live_string(rk)  # WRONGTYPE for a non-string, as GET on a server
            lease_end = time.monotonic() + claim_seconds(seconds)
            kept = self._deadline(rk)
            keep = lease_end if kept is None else max(kept, lease_end)
            self._store(ck, as_bytes(token, "token"), keep)
            return value

    async def caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        with self._lock:
            return self._caexpire(key, expected, ms)

    def _caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        k, e = as_bytes(key), as_bytes(expected, "expected")
        ttl = caexpire_ms(ms)
        if self._live_string(k) != e:
            return 0
        if ttl <= 0:
            self._drop(k)
        else:
            self._store(k, e, time.monotonic() + ttl / 1000)
        return 1

    async def cas(self, key: KeyT, expected: KeyT, new: KeyT) -> bool:
        with self._lock:
            k, e = as_bytes(key), as_bytes(expected, "expected")
            n = check_size(as_bytes(new, "new"), self.max_value_bytes)
            if self._live_string(k) != e:
                return False
            self._replace(k, n)  # the deadline, its TTL, stays as it was
            return True

    async def cad(self, key: KeyT, expected: KeyT) -> int:
        with self._lock:
            k, e = as_bytes(key), as_bytes(expected, "expected")
            if self._live_string(k) != e:
                return 0
            self._drop(k)
            return 1

    # -- compound steps --

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> Published:
        """SET result PX ttl NX + CAEXPIRE claim, as one step (see `Store.publish`)."""
        with self._lock:
            rk = as_bytes(result_key)
            v = check_size(as_bytes(value, "value"), self.max_value_bytes)
            ttl = publish_ttl(ttl_ms)
            written = self._live(rk) is None
            if written:  # SET result value PX ttl NX
                self._put(rk, v, time.monotonic() + ttl / 1000)
            renewed = self._caexpire(claim_key, token, ttl)
            if written or self._live_string(rk) == v:
                return WRITTEN[renewed]
            deadline = self._deadline(rk)
            if renewed and deadline is not None:  # the claim lasts no longer than the result
                self._store(as_bytes(claim_key), as_bytes(token, "token"), deadline)
            return Published.SUPERSEDED

    async def forget(
        self, claim_key: KeyT, result_key: KeyT, *others: KeyT, expected: KeyT | None = None
    ) -> int:
        """The claim, the result and `others` together, unless a run holds the claim, as
        one step under the lock (see `Store.forget`)."""
        with self._lock:
            ck, rk = as_bytes(claim_key), as_bytes(result_key)
            held = self._live(ck) is not None
            done = self._live(rk) is not None
            if held and not done and self._live_string(ck) != _expected(expected):
                return -1
            removed = 0
            for k in (rk, *(as_bytes(o) for o in others), ck):
                if self._live(k) is not None:
                    self._drop(k)
                    removed += 1
            return removed

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        replies: list[int | Exception] = []
        for key, expected, ms in renewals:
            try:
                replies.append(await self.caexpire(key, expected, ms))
            except ResponseError as exc:
                replies.append(exc)
        return replies

    # -- plain commands --

    async def get(self, key: KeyT) -> bytes | None:
        with self._lock:
            return self._live_string(as_bytes(key))

    async def set(
        self,
        key: KeyT,
        value: KeyT,
        *,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
    ) -> bool:
        """SET with Redis' meaning: a plain SET drops any TTL the key had."""
        with self._lock:
            k, v = as_bytes(key), as_bytes(value, "value")
            ttl_ms = set_ttl_ms(ex, px)
            if nx and self._live(k) is not None:
                return False
            self._put(k, v, None if ttl_ms is None else time.monotonic() + ttl_ms / 1000)
            return True

    async def pttl(self, key: KeyT) -> int:
        """Milliseconds left; -1 for a key without TTL, -2 for a missing key."""
        with self._lock:
            entry = self._live(as_bytes(key))
            if entry is None:
                return -2
            deadline = self._deadline(as_bytes(key))
            if deadline is None:
                return -1
            return max(0, round((deadline - time.monotonic()) * 1000))

    async def delete(self, *keys: KeyT) -> int:
        with self._lock:
            removed = 0
            for key in keys:
                k = as_bytes(key)
                if self._live(k) is not None:
                    self._drop(k)
                    removed += 1
            return removed


def _expected(expected: KeyT | None) -> bytes | None:
    return None if expected is None else as_bytes(expected, "expected")


# Every MemoryStore of the process: a fork's child gives each a new lock, since a thread
# of the parent may have held it at the fork (and the child has no such thread).
_stores: weakref.WeakSet[MemoryStore] = weakref.WeakSet()


def _after_fork() -> None:
    for store in list(_stores):
        store._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
