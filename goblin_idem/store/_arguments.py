"""The argument and reply rules every store shares, so that MemoryStore and RedisStore in
either mode accept the same input and reply the same way.

Arguments are checked here, in Python, before anything is sent: a bad one raises the
ResponseError (with the exact text) that the native command would reply, and never reaches
a Lua script, whose own error texts would differ.
"""

from __future__ import annotations

import time
from typing import Final

from redis.exceptions import ResponseError

from ._protocol import CLAIMED, ClaimReply, Published
from ._server_errors import NOT_INTEGER, VALUE_TOO_LARGE, invalid_expire

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "LLONG_MAX",
    "LLONG_MIN",
    "WRITTEN",
    "as_bytes",
    "caexpire_ms",
    "check_size",
    "claim_reply",
    "claim_seconds",
    "parse_int",
    "publish_ttl",
    "set_ttl_ms",
]

#: Redis' own default ceiling for a value (its proto-max-bulk-len): what a store refuses
#: above, unless told a lower limit (a RedisStore reads its server's at detection).
DEFAULT_MAX_VALUE_BYTES: Final = 512 * 1024 * 1024
LLONG_MAX: Final = 2**63 - 1
LLONG_MIN: Final = -(2**63)
_CLAIMED_WIRE: Final = b"CLAIMED"
#: What a publish that wrote its result replies, by its CAEXPIRE's reply (0 or 1): a tuple
#: read, where building the enum member from the int costs a lookup on every first run.
WRITTEN: Final = (Published.LAPSED, Published.STORED)


def as_bytes(value: object, what: str = "key") -> bytes:
    """Keys and values are binary-safe: str is UTF-8 encoded, anything else is a bug."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be str or bytes, not {type(value).__name__}")


def parse_int(value: object) -> int:
    """An int64 the way the server parses one (strict decimal, no spaces, no '+', no floats)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        digits = text[1:] if text.startswith("-") else text
        if (
            not digits
            or not digits.isascii()
            or not digits.isdigit()
            or (digits[0] == "0" and (len(digits) > 1 or text.startswith("-")))
        ):
            raise ResponseError(NOT_INTEGER)
        n = int(text)
    else:
        raise ResponseError(NOT_INTEGER)
    if not LLONG_MIN <= n <= LLONG_MAX:
        raise ResponseError(NOT_INTEGER)
    return n


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# A lease of at most this many seconds fits in an int64 of ms from any time before the
# year 200,000,000: `claim_seconds` takes such an int as it is, without reading the clock.
_LEASE_FITS = 10**15


def claim_seconds(value: object) -> int:
    """GOBLIN.CLAIM's lease: a positive integer whose deadline fits in an int64 of ms."""
    if type(value) is int and 0 < value <= _LEASE_FITS:
        return value
    seconds = parse_int(value)
    if seconds <= 0 or seconds > LLONG_MAX // 1000 or seconds * 1000 > LLONG_MAX - _now_ms():
        raise ResponseError(invalid_expire("goblin.claim"))
    return seconds


def caexpire_ms(value: object) -> int:
    """GOBLIN.CAEXPIRE's ms: any integer (non-positive deletes) whose deadline fits."""
    ms = parse_int(value)
    if ms > 0 and ms > LLONG_MAX - _now_ms():
        raise ResponseError(invalid_expire("goblin.caexpire"))
    return ms


def publish_ttl(value: object) -> int:
    """A publish's TTL: CAEXPIRE's rule, and positive (SET PX refuses anything else). A
    plain int up to a lease's bound in ms (`_LEASE_FITS`) is taken as it is, without
    reading the clock."""
    if type(value) is int and 0 < value <= _LEASE_FITS * 1000:
        return value
    ttl = caexpire_ms(value)
    if ttl <= 0:
        raise ResponseError(invalid_expire("set"))
    return ttl


def set_ttl_ms(ex: int | None, px: int | None) -> int | None:
    """SET's TTL in ms from its EX or PX (None: no TTL), refused as the server refuses it:
    both given, or a TTL that is not positive."""
    if ex is not None and px is not None:
        raise ResponseError("syntax error")
    ttl_ms = ex * 1000 if ex is not None else px
    if ttl_ms is not None and ttl_ms <= 0:
        raise ResponseError(invalid_expire("set"))
    return ttl_ms


def check_size(value: bytes, limit: int | None) -> bytes:
    """A value over the store's `max_value_bytes` is refused as the native command does,
    before anything is sent: a server refuses a larger one by dropping the connection."""
    if limit is not None and len(value) > limit:
        raise ResponseError(VALUE_TOO_LARGE)
    return value


def claim_reply(reply: object) -> ClaimReply:
    """CLAIM's reply as a store returns it: the bulk string ``CLAIMED`` is the sentinel."""
    if reply is None:
        return None
    if reply == _CLAIMED_WIRE:
        return CLAIMED
    return as_bytes(reply, "reply")
