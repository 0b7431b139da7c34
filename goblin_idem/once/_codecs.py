"""How a `once` function's return value is stored: codecs, and one versioned framing.

Layout of a stored value::

    b"GO" 0x01 payload                          in the clear
    b"GO" 0x02 Sealer.seal(payload)             sealed (``encryption_keys``), bound to its key
    b"GO" 0x03 fingerprint:16 payload           in the clear, with the call's fingerprint
    b"GO" 0x04 fingerprint:16 Sealer.seal(payload)      sealed, with the fingerprint

where the payload is the codec's bytes and the fingerprint that of the arguments of the
call that stored it (`_arguments`; versions 1 and 2, as 0.2.0 wrote them, have none, and
are still read). A sealed value's associated data is its head bytes (the fingerprint
included) and the name of the result key it is stored under, so a value copied under
another key, or altered, does not open (as the middleware's records). A reader refuses any
other version (RecordError) rather than guess, so the format can evolve; a value in the
clear is read whatever the keys, so encryption can be turned on without a flag day (and
refused with ``require_sealed``, once no value in the clear is left). A value
starts with b"GO" and a version byte, so it can never be the wire reply ``CLAIMED``.

`to_stored` and `from_stored` are the one place a return value becomes stored bytes and
back: a transformation of every stored value (sealing, compression) goes there, once.

Codecs: JSON by default; a dataclass or a pydantic model when the function's return
annotation names one (so the replay is an instance of it again, equal to the first); any
object with ``encode(value) -> bytes`` and ``decode(data) -> value`` otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..exceptions import RecordError, SealError
from ..records._format import Format
from ..records._sealing import Sealer, sealed_key_id

__all__ = ["Codec", "DataclassCodec", "JsonCodec", "PydanticCodec", "codec_for"]

MAGIC = b"GO"
VERSION = 1
SEALED = 2
FINGERPRINTED = 3
SEALED_FINGERPRINTED = 4
_HEAD = MAGIC + bytes([VERSION])
_SEALED_HEAD = MAGIC + bytes([SEALED])
_FP_HEAD = MAGIC + bytes([FINGERPRINTED])
_SEALED_FP_HEAD = MAGIC + bytes([SEALED_FINGERPRINTED])
_FP_BYTES = 16


@runtime_checkable
class Codec(Protocol):
    """Turns a return value into bytes and back; `encode` raises TypeError for a value it
    cannot represent (nothing is stored then, and the claim is released)."""

    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


def to_stored(
    codec: Codec,
    value: Any,
    sealer: Sealer | None = None,
    name: bytes = b"",
    fingerprint: bytes | None = None,
) -> bytes:
    """The bytes stored for `value` under the result key `name`, sealed if a sealer is
    given, with the call's `fingerprint` if there is one (16 bytes)."""
    payload = codec.encode(value)
    if fingerprint is None:
        if sealer is None:
            return _HEAD + payload
        return _SEALED_HEAD + sealer.seal(payload, _SEALED_HEAD + name)
    if len(fingerprint) != _FP_BYTES:
        raise ValueError(f"a fingerprint is {_FP_BYTES} bytes")
    if sealer is None:
        return _FP_HEAD + fingerprint + payload
    head = _SEALED_FP_HEAD + fingerprint
    return head + sealer.seal(payload, head + name)


def from_stored(
    codec: Codec,
    data: bytes,
    sealer: Sealer | None = None,
    name: bytes = b"",
    *,
    require_sealed: bool = False,
) -> Any:
    """The value stored as `data` under `name`; RecordError if it is not a value this
    version can read, a sealed one that the configured keys do not open, or with
    `require_sealed` one in the clear (which anyone who can write to the store can write)."""
    fmt = stored_format(data)
    start = _head_size(fmt.version)
    if not fmt.sealed:
        if require_sealed:
            raise RecordError(
                "the stored value is in the clear, and require_sealed=True refuses values "
                "that are not sealed"
            )
        payload = data[start:]
    elif sealer is None:
        raise RecordError("the stored value is sealed, and no encryption_keys are configured")
    else:
        try:
            payload = sealer.open(data[start:], data[:start] + name)
        except SealError as exc:
            raise RecordError(f"the stored value does not open: {exc}") from None
    try:
        return codec.decode(payload)
    except (ValueError, TypeError, KeyError) as exc:
        raise RecordError(
            f"the stored value cannot be decoded: {type(exc).__name__}: {exc}"
        ) from exc


def stored_format(data: bytes) -> Format:
    """What a stored value's clear bytes say (its version, and a sealed one's key id),
    without opening it; RecordError if they are not a stored value's."""
    head = data[:3]
    if head == _HEAD or head == _FP_HEAD:
        return Format(head[2])
    if head == _SEALED_HEAD or head == _SEALED_FP_HEAD:
        return Format(head[2], True, sealed_key_id(data[_head_size(head[2]) :]))
    raise RecordError(
        f"not a goblin-idem stored value of a version this reader knows ({VERSION} to "
        f"{SEALED_FINGERPRINTED})"
    )


def stored_fingerprint(data: bytes) -> bytes | None:
    """The fingerprint of the call that stored `data`; None for a value stored without one
    (by 0.2.0, or with ``fingerprint=False``)."""
    if data[:3] == _FP_HEAD or data[:3] == _SEALED_FP_HEAD:
        return bytes(data[3 : 3 + _FP_BYTES])
    return None


def _head_size(version: int) -> int:
    return 3 + _FP_BYTES if version >= FINGERPRINTED else 3


class JsonCodec:
    """JSON: dicts, lists, strings, numbers, booleans and None (a tuple comes back a list).
    NaN and infinities are refused, as JSON has no spelling for them."""

    def encode(self, value: Any) -> bytes:
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"cannot encode as JSON: {exc}") from None
        return text.encode()

    def decode(self, data: bytes) -> Any:
        return json.loads(data)


class _ClassCodec:
    """A codec for instances of one class, the one the return annotation names."""

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls

    def _check(self, value: Any) -> None:
        if not isinstance(value, self.cls):
            raise TypeError(
                f"expected a {self.cls.__qualname__} (the return annotation), "
                f"got {type(value).__name__}"
            )


class DataclassCodec(_ClassCodec):
    """A dataclass as a JSON object of its fields; fields that are dataclasses themselves
    (or None) are rebuilt too, others come back as JSON gives them."""

    def encode(self, value: Any) -> bytes:
        self._check(value)
        return JsonCodec().encode(dataclasses.asdict(value))

    def decode(self, data: bytes) -> Any:
        return _build(self.cls, json.loads(data))


class PydanticCodec(_ClassCodec):
    """A pydantic model, by its own JSON (`model_dump_json` / `model_validate_json`)."""

    def encode(self, value: Any) -> bytes:
        self._check(value)
        data: str = value.model_dump_json()
        return data.encode()

    def decode(self, data: bytes) -> Any:
        return self.cls.model_validate_json(data)


def codec_for(func: Callable[..., Any]) -> Codec:
    """The codec the return annotation of `func` calls for (JSON if it names no dataclass or
    pydantic model, or cannot be resolved)."""
    try:
        returns = typing.get_type_hints(func).get("return")
    except Exception:  # an annotation naming what the module cannot resolve
        returns = None
    if isinstance(returns, type):
        if dataclasses.is_dataclass(returns):
            return DataclassCodec(returns)
        if hasattr(returns, "model_validate_json") and hasattr(returns, "model_dump_json"):
            return PydanticCodec(returns)
    return JsonCodec()


def _build(cls: type[Any], data: Any) -> Any:
    if not isinstance(data, dict):
        raise TypeError(f"a {cls.__qualname__} is stored as a JSON object")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in data:
            continue
        value = data[f.name]
        inner = _dataclass_in(hints.get(f.name))
        kwargs[f.name] = _build(inner, value) if inner is not None and value is not None else value
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type[Any] | None:
    """The dataclass `hint` names, alone or with None (``X | None``), if any."""
    options = [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(options) == 1 and isinstance(options[0], type) and dataclasses.is_dataclass(options[0]):
        return options[0]
    return None
