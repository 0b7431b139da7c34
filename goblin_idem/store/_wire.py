"""Commands in RESP: any command (`pack`), and a first run's two store steps, made once,
in one join.

`RedisStore.claim_unless_done` (CLAIM, PTTL) and `RedisStore.publish` (MULTI, SET,
CAEXPIRE, EXEC) are every new key's two round trips. hiredis's `pack_command` formats each
argument's length with sprintf, and took about a sixth of the instructions of the two
calls; here each step's constant parts (the command names, a script's SHA) are bytes made
at import, and a length is a table read. What the step sends is also kept as commands
(`Packed`): the shared connection writes the bytes as they are, while a cluster's redirect,
a resend after NOSCRIPT or the redis-py paths use the commands, encoded their own way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from redis.exceptions import DataError

from . import _scripts as scripts

try:
    import hiredis
except ImportError:  # pragma: no cover - the "fast" extra installs it
    hiredis = None  # type: ignore[assignment]

__all__ = ["Packed", "claim_step", "pack", "publish_step"]

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


def claim_step(native: bool, ck: bytes, rk: bytes, token: bytes, lease: int) -> Packed:
    """CLAIM, then PTTL of the result (`RedisStore.claim_unless_done`)."""
    step = Packed((scripts.CLAIM.call(native, (ck, rk), (token, lease)), ("PTTL", rk)))
    seconds = b"%d" % lease
    heads = _HEADS
    try:
        step.wire = b"".join(
            (
                _CLAIM[native],
                heads[len(ck)],
                ck,
                heads[len(rk)],
                rk,
                heads[len(token)],
                token,
                heads[len(seconds)],
                seconds,
                _PTTL,
                heads[len(rk)],
                rk,
                b"\r\n",
            )
        )
    except IndexError:  # a key or token longer than the table: the general way
        step.wire = _packed(step)
    return step


def publish_step(
    native: bool, rk: bytes, value: bytes, ttl: int, ck: bytes, token: bytes
) -> Packed:
    """MULTI, SET result value PX ttl NX, CAEXPIRE claim token ttl, EXEC (`RedisStore.publish`)."""
    renew = scripts.CAEXPIRE.call(native, (ck,), (token, ttl))
    step = Packed((("MULTI",), ("SET", rk, value, "PX", ttl, "NX"), renew, ("EXEC",)))
    ms = b"%d" % ttl
    heads = _HEADS
    n = len(value)
    try:
        step.wire = b"".join(
            (
                _MULTI_SET,
                heads[len(rk)],
                rk,
                heads[n] if n < _CACHED else b"\r\n$%d\r\n" % n,
                value,
                _PX,
                heads[len(ms)],
                ms,
                _NX,
                _CAEXPIRE[native],
                heads[len(ck)],
                ck,
                heads[len(token)],
                token,
                heads[len(ms)],
                ms,
                _EXEC,
            )
        )
    except IndexError:  # a key or token longer than the table: the general way
        step.wire = _packed(step)
    return step
