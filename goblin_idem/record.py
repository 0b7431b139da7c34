"""The stored response: a compact, versioned, binary-safe record, and the request fingerprint.

Layout (big-endian)::

    b"GI" version:u8 flags:u8 status:u16 fingerprint:16 bytes header_count:u16
    header_count x (name_len:u16 name value_len:u32 value)
    version 2 only: trailer_count:u16, trailer_count x (name_len:u16 name value_len:u32 value)
    body (the rest)

Version 2 is written only for a response that declared HTTP trailers (``trailers: True`` in
its ASGI response start), so every other record stays version 1, as earlier releases wrote
and read it; an earlier release that meets a version 2 record cannot decode it (503) rather
than replay it without its trailers. It starts with b"GI" and a version byte, so it can
never be mistaken for the wire reply ``CLAIMED`` of a won claim.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Record", "RecordError", "decode", "encode", "fingerprint"]

MAGIC = b"GI"
VERSION = 1
VERSION_TRAILERS = 2
FLAG_NOT_REPLAYABLE = 0x01
_HEAD = struct.Struct(">2sBBH16sH")
_NAME = struct.Struct(">H")
_COUNT = struct.Struct(">H")
_VALUE = struct.Struct(">I")


class RecordError(ValueError):
    """The stored bytes are not a record this version can read."""


@dataclass(frozen=True, slots=True)
class Record:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    fingerprint: bytes
    replayable: bool = True
    trailers: list[tuple[bytes, bytes]] | None = None  # None: the response declared none


def fingerprint(
    method: str, path: str, query: bytes, body: bytes, headers: Iterable[bytes] = ()
) -> bytes:
    """16 bytes that differ when any part of the request that the key vouches for differs."""
    h = hashlib.blake2b(digest_size=16)
    for part in (method.encode(), path.encode("utf-8", "surrogateescape"), query, *headers):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(body)
    return h.digest()


def encode(record: Record) -> bytes:
    flags = 0 if record.replayable else FLAG_NOT_REPLAYABLE
    version = VERSION if record.trailers is None else VERSION_TRAILERS
    parts = [
        _HEAD.pack(MAGIC, version, flags, record.status, record.fingerprint, len(record.headers))
    ]
    _encode_fields(parts, record.headers)
    if record.trailers is not None:
        parts.append(_COUNT.pack(len(record.trailers)))
        _encode_fields(parts, record.trailers)
    parts.append(record.body)
    return b"".join(parts)


def _encode_fields(parts: list[bytes], fields: list[tuple[bytes, bytes]]) -> None:
    for name, value in fields:
        parts += (_NAME.pack(len(name)), name, _VALUE.pack(len(value)), value)


def decode(data: bytes) -> Record:
    try:
        magic, version, flags, status, fp, count = _HEAD.unpack_from(data, 0)
        if magic != MAGIC or version not in (VERSION, VERSION_TRAILERS):
            raise RecordError(f"not a version {VERSION} or {VERSION_TRAILERS} goblin-idem record")
        headers, pos = _decode_fields(data, _HEAD.size, count)
        trailers = None
        if version == VERSION_TRAILERS:
            (count,) = _COUNT.unpack_from(data, pos)
            trailers, pos = _decode_fields(data, pos + _COUNT.size, count)
    except struct.error as exc:
        raise RecordError(f"truncated record: {exc}") from None
    return Record(status, headers, data[pos:], fp, not flags & FLAG_NOT_REPLAYABLE, trailers)


def _decode_fields(data: bytes, pos: int, count: int) -> tuple[list[tuple[bytes, bytes]], int]:
    fields = []
    for _ in range(count):
        (n,) = _NAME.unpack_from(data, pos)
        name = data[pos + 2 : pos + 2 + n]
        pos += 2 + n
        (v,) = _VALUE.unpack_from(data, pos)
        value = data[pos + 4 : pos + 4 + v]
        pos += 4 + v
        if len(name) != n or len(value) != v:
            raise RecordError("truncated record")
        fields.append((name, value))
    return fields, pos
