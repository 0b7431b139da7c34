"""Redirects a key's runs answered, so that a client that repeats a request and follows the
same redirect ends at the replay.

A 307 or 308 asks the client to send the same request, method and body unchanged, to
another URL (FastAPI's answer to a route hit without its trailing slash, Flask's with one, a
moved route). It is not the request's outcome (`_outcome`): the key is released, so the
request that follows it, with the same key, runs there, and its response is the key's
record, with that request's fingerprint (another path: another request). A client that then
repeats the whole call would meet that record at the first URL, with the first request's
fingerprint, and get 422 although it sent the same request twice.

So the redirect is remembered, under the key's hop key (`_keys.hop_key`, in the claim's
slot), as the response it was and the fingerprint of the request it answered: written while
the claim is still held (before it is released, so a hop is always there before the record
that follows it), and read only by a duplicate whose fingerprint does not match the record.
A duplicate of the first request gets the redirect again (replayed); following it, it gets
the record's replay. This is safe because a redirect ran nothing: replaying it gives no
access to a record, since the request it leads to is checked against the record's own
fingerprint (a key reused for another request still gets 422 there). A key keeps up to
`MAX_HOPS` redirects (a chain of them, each a hop), for the key's TTL.

The hops live in the store only: with SQL records, a store that lost them answers the
repeated first request 422 again, and nothing runs. Writing a hop costs a redirected run
two round trips (read, then write) before its release; the key's duplicates pay one more
only where they would otherwise get 422.
"""

from __future__ import annotations

import logging
import struct

from .._keys import KeyNames, hop_key
from .._log import describe
from ..store import Store

__all__ = ["MAX_HOPS", "REPEAT_ELSEWHERE", "find", "remember"]

logger = logging.getLogger("goblin_idem.middleware")

#: The statuses that ask the client to repeat the request, unchanged, at another URL.
REPEAT_ELSEWHERE = frozenset({307, 308})
MAX_HOPS = 8

# The hop key's value: hops, each fingerprint:16 length:u32 record (records/_format.py,
# sealed for the hop key's name when encryption is on).
_ENTRY = struct.Struct(">16sI")


def _entries(value: bytes | None) -> list[tuple[bytes, bytes]]:
    """The (fingerprint, record) hops of a hop key's value; a damaged tail is dropped."""
    found = []
    pos = 0
    while value is not None and pos + _ENTRY.size <= len(value):
        fp, size = _ENTRY.unpack_from(value, pos)
        record = value[pos + _ENTRY.size : pos + _ENTRY.size + size]
        if len(record) != size:
            break
        found.append((fp, record))
        pos += _ENTRY.size + size
    return found


async def remember(store: Store, names: KeyNames, fp: bytes, record: bytes, ttl_ms: int) -> None:
    """Add the redirect `record` answered to the request of fingerprint `fp` (replacing an
    earlier one for the same request), for `ttl_ms`. Safe to repeat. A store error is
    logged: the repeated request then gets 422, and nothing runs twice either way."""
    key = hop_key(names)
    try:
        hops = [hop for hop in _entries(await store.get(key)) if hop[0] != fp]
        hops = [*hops[-(MAX_HOPS - 1) :], (fp, record)]
        value = b"".join(_ENTRY.pack(f, len(r)) + r for f, r in hops)
        await store.set(key, value, px=ttl_ms)
    except Exception as exc:
        logger.warning(
            "key %s: could not remember its redirect (a client that repeats the request and "
            "follows it again gets 422): %s",
            names.hash,
            describe(exc),
        )


async def find(store: Store, names: KeyNames, fp: bytes) -> bytes | None:
    """The record of the redirect that answered the request of fingerprint `fp`, if any."""
    for hop_fp, record in _entries(await store.get(hop_key(names))):
        if hop_fp == fp:
            return record
    return None
