"""The fingerprint of a `once` call's arguments: what a key is reused with, told apart.

A key stands for one piece of work; a call with the same key and other arguments (amount 999
where the first call had 500) is another request under a reused key, as an HTTP request
with another body is. The arguments are bound to the function's signature (so ``f(1, b=2)``
and ``f(a=1, b=2)``, or a default left out and given, are the same call) and hashed by
value, in a form a JSON round trip keeps (a message broker's): a tuple as a list, a dict
whatever its order, a whole float as the int. Data is hashed by value: None, bool, numbers,
str, bytes, lists, tuples, dicts, sets, dataclasses, pydantic models, enums, UUID, Decimal
and dates. Any other object (a client, a session, a connection) is context, not the
request, and is hashed by its type alone, so a call with another such object still matches.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import hashlib
import inspect
import uuid
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Fingerprint"]

_BY_TEXT = (uuid.UUID, decimal.Decimal, datetime.date, datetime.time, datetime.timedelta)


class Fingerprint:
    """16 bytes for the arguments of one function's call, by value (see the module)."""

    __slots__ = ("signature",)

    def __init__(self, func: Callable[..., Any]) -> None:
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):  # a builtin without one: the arguments as given
            self.signature = None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        if self.signature is None:
            _feed(h, [list(args), kwargs])
        else:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            _feed(h, bound.arguments)
        return h.digest()


def _feed(h: Any, value: Any) -> None:
    """`value` into the hash, each part tagged and length-prefixed: no two values that
    differ can feed the same bytes."""
    if value is None or isinstance(value, bool):
        _part(h, b"c", repr(value).encode())
    elif isinstance(value, enum.Enum):
        _feed(h, value.value)
    elif isinstance(value, (int, float)):
        number = int(value) if isinstance(value, float) and value.is_integer() else value
        _part(h, b"n", repr(number).encode())
    elif isinstance(value, str):
        _part(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _part(h, b"b", bytes(value))
    elif isinstance(value, Mapping):
        _part(h, b"m", str(len(value)).encode())
        for key, item in sorted(value.items(), key=lambda pair: _digest(pair[0])):
            _feed(h, key)
            _feed(h, item)
    elif isinstance(value, (list, tuple)):
        _part(h, b"l", str(len(value)).encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, (set, frozenset)):
        _part(h, b"l", str(len(value)).encode())
        for digest in sorted(_digest(item) for item in value):
            _part(h, b"d", digest)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _feed(h, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    elif callable(getattr(value, "model_dump", None)) and not isinstance(value, type):
        _feed(h, value.model_dump(mode="json"))  # a pydantic model
    elif isinstance(value, _BY_TEXT):
        _part(h, b"t", str(value).encode())
    else:  # context, not data (see the module docstring)
        _part(h, b"o", f"{type(value).__module__}.{type(value).__qualname__}".encode())


def _part(h: Any, tag: bytes, data: bytes) -> None:
    h.update(tag)
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)


def _digest(value: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value)
    return h.digest()
