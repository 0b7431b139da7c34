"""The stored response: a compact, versioned, binary-safe record, and the request fingerprint.

Layout (big-endian)::

    version 1 and 2:
    b"GI" version:u8 flags:u8 status:u16 fingerprint:16 bytes header_count:u16
    header_count x (name_len:u16 name value_len:u32 value)
    version 2 only: trailer_count:u16, trailer_count x (name_len:u16 name value_len:u32 value)
    body (the rest)

    version 3:
    b"GI" 3:u8 envelope:u8 (0: payload in the clear, 1: payload sealed)
    envelope 0: payload
    envelope 1: a `goblin_idem.sealing` value (key_id:4 salt:16 sealed payload tag:16),
                sealed with the 4 bytes above and the result key's name as associated data
    payload: flags:u8 status:u16 fingerprint:16 codec:u8 header_count:u16 headers
             [trailer_count:u16 trailers, if flags & TRAILERS]
             [body_len:u32, if codec is not identity] body (the rest; compressed by codec)

Version 1 is written for a response in the clear with no trailers, and version 2 for one
that declared HTTP trailers (``trailers: True`` in its ASGI response start), exactly as
earlier releases wrote them, so that they read what this one writes while both share a
store; version 3 only when the record is sealed or its body compressed. A reader meets a
version it does not know (or a sealed record it cannot open, or with `require_sealed` one
in the clear) with an error, and the middleware answers that key 503 and never runs it
again. Every record starts with b"GI" and a version byte, so it can never be mistaken for
the wire reply ``CLAIMED`` of a won claim.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ..exceptions import RecordError, SealError
from . import _compression as compression
from ._sealing import Sealer, sealed_key_id

__all__ = [
    "Decoded",
    "Format",
    "Record",
    "RecordError",
    "decode",
    "encode",
    "fingerprint",
    "format_of",
]

MAGIC = b"GI"
VERSION = 1
VERSION_TRAILERS = 2
VERSION_ENVELOPE = 3
VERSIONS = (VERSION, VERSION_TRAILERS, VERSION_ENVELOPE)
FLAG_NOT_REPLAYABLE = 0x01
FLAG_TRAILERS = 0x02  # version 3 payload only
ENVELOPE_CLEAR = 0
ENVELOPE_SEALED = 1
_V1_V2 = frozenset({MAGIC + bytes([VERSION]), MAGIC + bytes([VERSION_TRAILERS])})
_HEAD = struct.Struct(">2sBBH16sH")
_ENVELOPE = struct.Struct(">2sBB")
_PAYLOAD = struct.Struct(">BH16sBH")
_NAME = struct.Struct(">H")
_COUNT = struct.Struct(">H")
_VALUE = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class Record:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    fingerprint: bytes
    replayable: bool = True
    trailers: list[tuple[bytes, bytes]] | None = None  # None: the response declared none


@dataclass(frozen=True, slots=True)
class Format:
    """What a record's clear bytes say about it, without opening it."""

    version: int
    sealed: bool = False
    key_id: bytes | None = None


def fingerprint(
    method: str, path: str, query: bytes, body: bytes, headers: Iterable[bytes] = ()
) -> bytes:
    """16 bytes that differ when any part of the request that the key vouches for differs:
    the hash of each part but the body, length-prefixed, then the body. The head is hashed
    in one piece (the same bytes, so the same digest as part by part, one call instead of
    two a part: this runs for every keyed request)."""
    m, p = method.encode(), path.encode("utf-8", "surrogateescape")
    head = [_VALUE.pack(len(m)), m, _VALUE.pack(len(p)), p, _VALUE.pack(len(query)), query]
    for part in headers:
        head += (_VALUE.pack(len(part)), part)
    h = hashlib.blake2b(b"".join(head), digest_size=16)
    h.update(body)
    return h.digest()


def encode(
    record: Record,
    *,
    sealer: Sealer | None = None,
    name: bytes = b"",
    codec: compression.Compressor | None = None,
    compress_above: int = 1024,
) -> bytes:
    """The record's bytes. With `sealer`, sealed for the store key `name`; with `codec`, a
    body longer than `compress_above` bytes is stored compressed if that makes it smaller."""
    body, codec_id = record.body, compression.IDENTITY
    if codec is not None and len(body) > compress_above:
        packed = codec.compress(body)
        if len(packed) + _VALUE.size < len(body):
            body, codec_id = packed, codec.id
    if sealer is None and codec_id == compression.IDENTITY:
        return _encode_v1_v2(record)
    flags = (0 if record.replayable else FLAG_NOT_REPLAYABLE) | (
        0 if record.trailers is None else FLAG_TRAILERS
    )
    parts = [_PAYLOAD.pack(flags, record.status, record.fingerprint, codec_id, len(record.headers))]
    _encode_fields(parts, record.headers)
    if record.trailers is not None:
        parts.append(_COUNT.pack(len(record.trailers)))
        _encode_fields(parts, record.trailers)
    if codec_id != compression.IDENTITY:
        parts.append(_VALUE.pack(len(record.body)))
    parts.append(body)
    payload = b"".join(parts)
    if sealer is None:
        return _ENVELOPE.pack(MAGIC, VERSION_ENVELOPE, ENVELOPE_CLEAR) + payload
    head = _ENVELOPE.pack(MAGIC, VERSION_ENVELOPE, ENVELOPE_SEALED)
    return head + sealer.seal(payload, head + name)


def _encode_v1_v2(record: Record) -> bytes:
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


def format_of(data: bytes) -> Format:
    """The version, and for a sealed record the key id, read from the clear bytes."""
    if len(data) < _ENVELOPE.size or data[:2] != MAGIC or data[2] not in VERSIONS:
        version = data[2] if len(data) > 2 and data[:2] == MAGIC else 0
        raise RecordError(
            f"not a goblin-idem record of a version this reader knows "
            f"({', '.join(map(str, VERSIONS))})"
            + (f": version {version}, written by a newer release" if version else "")
        )
    if data[2] != VERSION_ENVELOPE or data[3] == ENVELOPE_CLEAR:
        return Format(data[2])
    if data[3] != ENVELOPE_SEALED:
        raise RecordError(f"version 3 record with an unknown envelope {data[3]}")
    return Format(data[2], True, sealed_key_id(data[_ENVELOPE.size :]))


def decode(
    data: bytes, *, sealer: Sealer | None = None, name: bytes = b"", require_sealed: bool = False
) -> Record:
    """The record in `data`, opened with `sealer` for the store key `name` if sealed. With
    `require_sealed`, a record in the clear is refused: anyone who can write to the store
    can write one, and only a sealed record proves it was written by a key holder."""
    try:
        if data[:3] in _V1_V2 and not require_sealed:  # the replay path of most records
            _, version, flags, status, fp, count = _HEAD.unpack_from(data, 0)
            headers, pos = _decode_fields(data, _HEAD.size, count)
            trailers = None
            if version == VERSION_TRAILERS:
                (count,) = _COUNT.unpack_from(data, pos)
                trailers, pos = _decode_fields(data, pos + _COUNT.size, count)
            return Record(
                status, headers, data[pos:], fp, not flags & FLAG_NOT_REPLAYABLE, trailers
            )
        fmt = format_of(data)
        if not fmt.sealed:
            if require_sealed:
                raise RecordError(
                    f"written in the clear (format version {fmt.version}), and "
                    "require_sealed=True refuses records that are not sealed"
                )
            return _decode_payload(data[_ENVELOPE.size :])
        if sealer is None:
            raise RecordError(
                f"sealed with key id {fmt.key_id.hex() if fmt.key_id else '?'}, and no "
                "encryption keys are configured"
            )
        head = bytes(data[: _ENVELOPE.size])
        try:
            payload = sealer.open(data[_ENVELOPE.size :], head + name)
        except SealError as exc:
            raise RecordError(f"sealed record {exc}") from None
        return _decode_payload(payload)
    except struct.error as exc:
        raise RecordError(f"truncated record: {exc}") from None


class Decoded:
    """`decode`, kept for bytes it has seen, by their identity: a store's replay cache hands
    back the very bytes object it holds for every replay of a key, so each is decoded once
    per fill instead of once per replay. `decode` is a function of the bytes, the key name
    and the reader's fixed options (sealer, require_sealed), so the record kept is the one
    a fresh decode would give; whether the bytes may be answered at all is the store's
    decision, made before. Keyed by `id`, not by content, so that a lookup hashes nothing;
    each entry holds its bytes, so their id is not reused while it stands. Holds at most
    `budget` bytes of records (their decoded parts are about as much again), oldest out
    first; an unreadable record is not kept (its error is raised each time)."""

    __slots__ = ("_lock", "budget", "entries", "require_sealed", "sealer", "size")

    def __init__(self, budget: int, sealer: Sealer | None, require_sealed: bool) -> None:
        self.budget = budget
        self.sealer = sealer
        self.require_sealed = require_sealed
        self.size = 0
        self.entries: collections.OrderedDict[int, tuple[bytes, bytes, Record]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # each change; a lookup is one dict read

    def __call__(self, data: bytes, name: bytes) -> Record:
        entry = self.entries.get(id(data))
        if entry is not None and entry[0] is data and entry[1] == name:
            return entry[2]
        record = decode(data, sealer=self.sealer, name=name, require_sealed=self.require_sealed)
        cost = len(data)
        if cost * 4 <= self.budget:
            with self._lock:
                entries = self.entries
                old = entries.pop(id(data), None)
                if old is not None:
                    self.size -= len(old[0])
                while entries and self.size + cost > self.budget:
                    self.size -= len(entries.popitem(last=False)[1][0])
                entries[id(data)] = (data, name, record)
                self.size += cost
        return record


def _decode_payload(data: bytes) -> Record:
    flags, status, fp, codec_id, count = _PAYLOAD.unpack_from(data, 0)
    headers, pos = _decode_fields(data, _PAYLOAD.size, count)
    trailers = None
    if flags & FLAG_TRAILERS:
        (count,) = _COUNT.unpack_from(data, pos)
        trailers, pos = _decode_fields(data, pos + _COUNT.size, count)
    if codec_id == compression.IDENTITY:
        body = data[pos:]
    else:
        (size,) = _VALUE.unpack_from(data, pos)
        try:
            body = compression.decompress(codec_id, data[pos + _VALUE.size :], size)
        except ValueError as exc:
            raise RecordError(f"body does not decompress: {exc}") from None
    return Record(status, headers, body, fp, not flags & FLAG_NOT_REPLAYABLE, trailers)


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
