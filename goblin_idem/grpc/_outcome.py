"""An RPC's outcome as stored: its status, details, trailing metadata and exact response bytes.

Layout of the codec's payload (inside `once`'s framing, which adds the request's
fingerprint and seals it when configured)::

    0x01 flags:1 code:1
    len:4 details (UTF-8)
    count:4 (len:4 name, flag:1, len:4 value)*   trailing metadata, in order
    count:4 (len:4 message)*                     the serialized responses, in order

with big-endian lengths. ``flags`` bit 0 set: the response was too large to keep
(`max_response_bytes`), and only the status is stored; a metadata entry's flag is 1 for a
``-bin`` value (bytes), 0 for text. A reader refuses any other version byte (ValueError,
which `once` reports as RecordError) rather than guess.

The responses are the bytes the first call sent, serialized once by the method's own
serializer: a replay sends those bytes, never a re-serialization (protobuf's map order is
not the same in two processes).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc

__all__ = ["DEFINITIVE", "Outcome", "OutcomeCodec", "kept_codes"]

Metadata = tuple[tuple[str, str | bytes], ...]

#: The statuses that say what the call did, kept and replayed by default (AIP-155's "the
#: response of the previous successful request", and the errors a retry would repeat).
#: The others say the call may not have run, or may run if sent again: the key is released.
DEFINITIVE = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
_VERSION = 1
_TOO_LARGE = 1
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_U32 = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one call answered. `finished` is False for a call whose client went away
    before the handler returned (sync servers, which cannot stop the handler): never kept."""

    code: grpc.StatusCode
    details: str = ""
    trailing: Metadata = ()
    messages: tuple[bytes, ...] = ()
    replayable: bool = True
    finished: bool = True


def kept_codes(value: object) -> frozenset[grpc.StatusCode]:
    """The statuses an `outcome=` option keeps: None for `DEFINITIVE`; a predicate on a
    `grpc.StatusCode`, asked here for each of them once; or a collection of them."""
    if value is None:
        return DEFINITIVE
    if callable(value):
        predicate: Callable[[grpc.StatusCode], object] = value
        return frozenset(code for code in grpc.StatusCode if predicate(code))
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise TypeError(
            "outcome must be a function of a grpc.StatusCode returning whether a call that "
            "ends with it is kept, or a collection of grpc.StatusCode, not "
            f"{type(value).__name__}"
        )
    bad = [repr(v) for v in value if not isinstance(v, grpc.StatusCode)]
    if bad:
        raise TypeError(
            f"outcome must name grpc.StatusCode members (grpc.StatusCode.OK, ...), not "
            f"{', '.join(bad)}"
        )
    return frozenset(value)


class OutcomeCodec:
    """`once`'s codec for an `Outcome` (the layout in the module docstring)."""

    def encode(self, value: Outcome) -> bytes:
        if not isinstance(value, Outcome):  # pragma: no cover - the door's own values only
            raise TypeError(f"an RPC outcome is an Outcome, not {type(value).__name__}")
        parts = [bytes((_VERSION, 0 if value.replayable else _TOO_LARGE, value.code.value[0]))]
        _field(parts, value.details.encode())
        parts.append(_U32.pack(len(value.trailing)))
        for name, item in value.trailing:
            _field(parts, name.encode("ascii"))
            if isinstance(item, bytes):
                parts.append(b"\x01")
                _field(parts, item)
            else:
                parts.append(b"\x00")
                _field(parts, item.encode("ascii"))
        parts.append(_U32.pack(len(value.messages)))
        for message in value.messages:
            _field(parts, message)
        return b"".join(parts)

    def decode(self, data: bytes) -> Outcome:
        view = memoryview(data)
        if len(view) < 3 or view[0] != _VERSION or view[2] not in _CODES:
            raise ValueError("not an RPC outcome of a version this reader knows (1)")
        at = 3
        details, at = _read(view, at)
        count, at = _count(view, at)
        trailing: list[tuple[str, str | bytes]] = []
        for _ in range(count):
            name, at = _read(view, at)
            binary, at = _read_byte(view, at)
            value, at = _read(view, at)
            trailing.append((name.decode("ascii"), value if binary else value.decode("ascii")))
        count, at = _count(view, at)
        messages = []
        for _ in range(count):
            message, at = _read(view, at)
            messages.append(message)
        if at != len(view):
            raise ValueError("an RPC outcome with bytes after its end")
        return Outcome(
            _CODES[view[2]],
            details.decode(),
            tuple(trailing),
            tuple(messages),
            replayable=not view[1] & _TOO_LARGE,
        )


def _field(parts: list[bytes], value: bytes) -> None:
    parts.append(_U32.pack(len(value)))
    parts.append(value)


def _count(view: memoryview, at: int) -> tuple[int, int]:
    if at + 4 > len(view):
        raise ValueError("a truncated RPC outcome")
    return _U32.unpack_from(view, at)[0], at + 4


def _read_byte(view: memoryview, at: int) -> tuple[int, int]:
    if at >= len(view):
        raise ValueError("a truncated RPC outcome")
    return view[at], at + 1


def _read(view: memoryview, at: int) -> tuple[bytes, int]:
    size, at = _count(view, at)
    if at + size > len(view):
        raise ValueError("a truncated RPC outcome")
    return bytes(view[at : at + size]), at + size
