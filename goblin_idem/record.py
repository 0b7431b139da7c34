"""The stored response: a compact, versioned, binary-safe record, and the request fingerprint.

Layout (big-endian)::

    b"GI" version:u8 flags:u8 status:u16 fingerprint:16 bytes header_count:u16
    header_count x (name_len:u16 name value_len:u32 value)
    body (the rest)

It starts with b"GI" and a version byte of 1, so it can never be mistaken for the wire
reply ``CLAIMED`` of a won claim.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Record", "RecordError", "decode", "encode", "fingerprint"]

MAGIC = b"GI"
VERSION = 1
FLAG_NOT_REPLAYABLE = 0x01
_HEAD = struct.Struct(">2sBBH16sH")
_NAME = struct.Struct(">H")
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
    parts = [
        _HEAD.pack(MAGIC, VERSION, flags, record.status, record.fingerprint, len(record.headers))
    ]
    for name, value in record.headers:
        parts += (_NAME.pack(len(name)), name, _VALUE.pack(len(value)), value)
    parts.append(record.body)
    return b"".join(parts)


def decode(data: bytes) -> Record:
    try:
        magic, version, flags, status, fp, count = _HEAD.unpack_from(data, 0)
        if magic != MAGIC or version != VERSION:
            raise RecordError(f"not a version {VERSION} goblin-idem record")
        pos = _HEAD.size
        headers = []
        for _ in range(count):
            (n,) = _NAME.unpack_from(data, pos)
            name = data[pos + 2 : pos + 2 + n]
            pos += 2 + n
            (v,) = _VALUE.unpack_from(data, pos)
            value = data[pos + 4 : pos + 4 + v]
            pos += 4 + v
            if len(name) != n or len(value) != v:
                raise RecordError("truncated record")
            headers.append((name, value))
    except struct.error as exc:
        raise RecordError(f"truncated record: {exc}") from None
    return Record(status, headers, data[pos:], fp, not flags & FLAG_NOT_REPLAYABLE)
