"""Commands in RESP: any command (`pack`), and a first run's two store steps, made once,
in one join.

`RedisStore.claim_unless_done` (CLAIM, PTTL) and `RedisStore.publish` (MULTI, SET,
CAEXPIRE, EXEC) are every new key's two round trips. hiredis's `pack_command` formats each
argument's length with sprintf, and took about a sixth of the instructions of the two
calls; here each step's constant parts (the command names, a script's SHA, the framed
lease and TTL a store sends again and again) are bytes made once, and a length is a table
read. On the shared connection a step goes out as its bytes alone (`Wire`); a cluster's
redirect, a resend after NOSCRIPT or the redis-py paths use its commands (`claim_step`,
`publish_step`: `Packed`, the commands with the same bytes), encoded their own way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

from redis.exceptions import DataError

from . import _scripts as scripts

try:
    import hiredis
except ImportError:  # pragma: no cover - the "fast" extra installs it
    hiredis = None  # type: ignore[assignment]

__all__ = ["Packed", "Wire", "claim_step", "claim_wire", "pack", "publish_step", "publish_wire"]

#: Bulk string headers by length, each with the CRLF that ends the argument before it.
_CACHED: Final = 512
_HEADS: Final = [b"\r\n$%d\r\n" % n for n in range(_CACHED)]


class Packed(list[tuple[Any, ...]]):
    """Commands, and `wire`: the same commands in RESP, ready to write."""

    __slots__ = ("wire",)

    wire: bytes


def pack(commands: Sequence[Sequence[Any]]) -> bytes:
    """Commands in RESP, ready to write: arrays of bulk strings (bytes, str, int or float
    arguments, a float written as redis-py writes it); a step's own bytes as they are."""
    if type(commands) is Packed:
        return commands.wire
    return _packed(commands)


def _packed(commands: Sequence[Sequence[Any]]) -> bytes:
    try:
        if len(commands) == 1:
            return _pack_command(tuple(commands[0]))
        return b"".join([_pack_command(tuple(command)) for command in commands])
    except TypeError as exc:  # a bool, None, or another type no server command takes
        raise DataError(f"invalid argument: {exc}") from None


def _pack_in_python(command: tuple[Any, ...]) -> bytes:
    """One command in RESP (hiredis's pack_command does the same in C)."""
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, bytes | memoryview):
            data = bytes(arg)
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"{type(arg).__name__} is not str, int, float or bytes")
        out += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(out)


_pack_command: Callable[[tuple[Any, ...]], bytes] = (
    _pack_in_python if hiredis is None else hiredis.pack_command
)


def _prefix(*args: bytes | str, count: int) -> bytes:
    """A command's array header and its constant first arguments, as `_HEADS` frames them."""
    parts = [b"*%d" % count]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        parts += (_HEADS[len(data)], data)
    return b"".join(parts)


_SHA: Final = {s.command: s.sha for s in scripts.GOBLIN}
# By native (True) or script (False): the claim's and the renewal's first arguments.
_CLAIM: Final = {
    True: _prefix(scripts.CLAIM.command, count=5),
    False: _prefix("EVALSHA", _SHA["goblin.claim"], b"2", count=7),
}
_CAEXPIRE: Final = {
    True: _prefix(scripts.CAEXPIRE.command, count=4),
    False: _prefix("EVALSHA", _SHA["goblin.caexpire"], b"1", count=6),
}
_PTTL: Final = b"\r\n" + _prefix("PTTL", count=2)
_MULTI_SET: Final = _prefix("MULTI", count=1) + b"\r\n" + _prefix("SET", count=6)
_PX: Final = _HEADS[2] + b"PX"
_NX: Final = _HEADS[2] + b"NX\r\n"
_EXEC: Final = b"\r\n" + _prefix("EXEC", count=1) + b"\r\n"


#: A step as the shared connection writes it: its RESP bytes, and how many commands (so
#: replies) they hold. A plain tuple: no list of commands is built for a step that goes out
#: as it is (`AutoPipeline.execute`); `claim_step` and `publish_step` build them for the
#: other ways.
Wire: TypeAlias = tuple[bytes, int]

# A number's argument, framed, by value: a claim's lease, then PTTL's array header
# (`_claim_tail`); a publish's TTL, as SET's argument, then up to CAEXPIRE's key, in script
# (0) and native (1) mode, and as CAEXPIRE's argument, then EXEC (`_publish_parts`). A
# store sends a few values (its settings'), so each is formatted once, not per call.
_LEASES: dict[int, bytes] = {}
_TTLS: dict[int, tuple[bytes, bytes, bytes]] = {}
_KEPT: Final = 64  # values kept at most; more clears the table (it refills as used)


def _framed(n: int) -> bytes:
    digits = b"%d" % n
    return _HEADS[len(digits)] + digits


def _claim_tail(lease: int) -> bytes:
    if len(_LEASES) >= _KEPT:
        _LEASES.clear()
    tail = _LEASES[lease] = _framed(lease) + _PTTL
    return tail


def _publish_parts(ttl: int) -> tuple[bytes, bytes, bytes]:
    if len(_TTLS) >= _KEPT:
        _TTLS.clear()
    ms = _framed(ttl)
    middle = _PX + ms + _NX
    parts = _TTLS[ttl] = (middle + _CAEXPIRE[False], middle + _CAEXPIRE[True], ms + _EXEC)
    return parts


def claim_wire(native: bool, ck: bytes, rk: bytes, token: bytes, lease: int) -> Wire:
    """CLAIM, then PTTL of the result (`RedisStore.claim_unless_done`), as written."""
    heads = _HEADS
    try:
        head = heads[len(rk)]
        wire = b"".join(
            (
                _CLAIM[native],
                heads[len(ck)],
                ck,
                head,
                rk,
                heads[len(token)],
                token,
                _LEASES.get(lease) or _claim_tail(lease),
                head,
                rk,
                b"\r\n",
            )
        )
    except IndexError:  # a key or token longer than the table: the general way
        wire = _packed(_claim_commands(native, ck, rk, token, lease))
    return wire, 2


def publish_wire(native: bool, rk: bytes, value: bytes, ttl: int, ck: bytes, token: bytes) -> Wire:
    """MULTI, SET result value PX ttl NX, CAEXPIRE claim token ttl, EXEC (`RedisStore.publish`),
    as written."""
    heads = _HEADS
    n = len(value)
    parts = _TTLS.get(ttl) or _publish_parts(ttl)
    try:
        wire = b"".join(
            (
                _MULTI_SET,
                heads[len(rk)],
                rk,
                heads[n] if n < _CACHED else b"\r\n$%d\r\n" % n,
                value,
                parts[native],
                heads[len(ck)],
                ck,
                heads[len(token)],
                token,
                parts[2],
            )
        )
    except IndexError:  # a key or token longer than the table: the general way
        wire = _packed(_publish_commands(native, rk, value, ttl, ck, token))
    return wire, 4


def _claim_commands(
    native: bool, ck: bytes, rk: bytes, token: bytes, lease: int
) -> list[tuple[Any, ...]]:
    return [scripts.CLAIM.call(native, (ck, rk), (token, lease)), ("PTTL", rk)]


def _publish_commands(
    native: bool, rk: bytes, value: bytes, ttl: int, ck: bytes, token: bytes
) -> list[tuple[Any, ...]]:
    renew = scripts.CAEXPIRE.call(native, (ck,), (token, ttl))
    return [("MULTI",), ("SET", rk, value, "PX", ttl, "NX"), renew, ("EXEC",)]


def claim_step(native: bool, ck: bytes, rk: bytes, token: bytes, lease: int) -> Packed:
    """`claim_wire`'s commands, for the ways that send commands (and its bytes with them)."""
    step = Packed(_claim_commands(native, ck, rk, token, lease))
    step.wire = claim_wire(native, ck, rk, token, lease)[0]
    return step


def publish_step(
    native: bool, rk: bytes, value: bytes, ttl: int, ck: bytes, token: bytes
) -> Packed:
    """`publish_wire`'s commands, for the ways that send commands (and its bytes with them)."""
    step = Packed(_publish_commands(native, rk, value, ttl, ck, token))
    step.wire = publish_wire(native, rk, value, ttl, ck, token)[0]
    return step
