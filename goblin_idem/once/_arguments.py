"""The fingerprint of a `once` call's arguments: what a key is reused with, told apart.

A key stands for one piece of work; a call with the same key and other arguments (amount 999
where the first call had 500) is another request under a reused key, as an HTTP request
with another body is. The arguments are bound to the function's signature, its defaults
applied (so ``f(1)``, ``f(1, b=2)`` with ``b=2`` the default and ``f(a=1, b=2)`` are the
same call), and hashed by value, in a form a JSON round trip keeps (a message broker's): a
tuple as a list, a dict whatever its order, a whole number of any type as the int.

Everything with a value is hashed by it (`_feed`; each kind is listed in
docs/beyond-http.md, "Arguments"). An argument none of them can compare (a lock, a socket,
an object that refers to itself) raises TypeError at the call, before anything is claimed,
naming ``fingerprint=``: hashing it by its type alone would call two different pieces of
work the same.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import inspect
import ipaddress
import numbers
import operator
import pathlib
import sys
import types
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["Fingerprint", "fingerprint_option"]

# Values whose text is their value, each under its kind (an interface before the address
# it subclasses, so the two kinds never share text).
_BY_TEXT: tuple[tuple[type, bytes], ...] = (
    (uuid.UUID, b"uuid"),
    (datetime.date, b"date"),
    (datetime.time, b"time"),
    (datetime.timedelta, b"timedelta"),
    (pathlib.PurePosixPath, b"posix-path"),
    (pathlib.PureWindowsPath, b"windows-path"),
    (ipaddress.IPv4Interface, b"ip-interface"),
    (ipaddress.IPv6Interface, b"ip-interface"),
    (ipaddress.IPv4Address, b"ip-address"),
    (ipaddress.IPv6Address, b"ip-address"),
    (ipaddress.IPv4Network, b"ip-network"),
    (ipaddress.IPv6Network, b"ip-network"),
)
_TEXT_TYPES = tuple(t for t, _ in _BY_TEXT)
_NAMED = (type, types.BuiltinFunctionType, types.FunctionType)  # by the name they import by


def fingerprint_option(value: object) -> bool | Callable[..., Any]:
    """`once`'s ``fingerprint=``, checked: True, False, or a function of the arguments."""
    if isinstance(value, bool) or (callable(value) and not isinstance(value, type)):
        return value
    raise TypeError(
        "fingerprint must be True, False, or a function of the decorated function's "
        f"arguments that returns what identifies the work, not {type(value).__name__}"
    )


class Fingerprint:
    """16 bytes for the arguments of one function's call, by value (see the module)."""

    __slots__ = ("select", "signature")

    def __init__(self, func: Callable[..., Any], select: bool | Callable[..., Any] = True) -> None:
        # `select`: a function of the arguments whose result is hashed instead of them.
        self.select = None if isinstance(select, bool) else select
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):  # a builtin without one: the arguments as given
            self.signature = None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        """The fingerprint; TypeError naming the argument when one cannot be compared."""
        h = hashlib.blake2b(digest_size=16)
        if self.select is not None:
            if self.signature is not None:
                self.signature.bind(*args, **kwargs)  # arguments refused as the call would be
            _hash(h, {"": self.select(*args, **kwargs)}, "the value fingerprint= returned")
        elif self.signature is None:
            _hash(h, {"args": list(args), "kwargs": kwargs}, "the call's {}")
        else:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            _hash(h, bound.arguments, "argument {}")
        return h.digest()


class _Uncomparable(Exception):
    """An argument part the fingerprint cannot compare; `path` grows on the way out."""

    def __init__(self, value: object, why: str) -> None:
        self.value = value
        self.why = why
        self.path: list[str] = []


def _hash(h: Any, named: Mapping[str, Any], what: str) -> None:
    """`named` (argument name to value) into `h`, or TypeError naming the argument (`what`,
    formatted with its name)."""
    try:
        _feed(h, named, set())
    except _Uncomparable as exc:
        name, *rest = reversed(exc.path)  # "['session']", then the steps inside it
        kind = f"{type(exc.value).__module__}.{type(exc.value).__qualname__}"
        part = f" (at {''.join(rest)}, {kind})" if rest else f" ({kind})"
        raise TypeError(
            f"once cannot compare {what.format(name[1:-1])}{part} by value: {exc.why}, so a "
            "reused key could not be told from other work. Pass fingerprint=<a function of "
            "the arguments that returns what identifies the work> (say, fingerprint=lambda "
            "order, session: order), or fingerprint=False"
        ) from None


def _feed(h: Any, value: Any, path: set[int]) -> None:
    """`value` into the hash, each part tagged and length-prefixed: no two values that
    differ can feed the same bytes. `path`: the ids of the containers being fed, so a
    value that contains itself is refused instead of recursing without end."""
    kind = type(value)
    if value is None or kind is bool:
        _part(h, b"c", repr(value).encode())
    elif kind is str:
        _part(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif kind is int:
        _part(h, b"n", str(value).encode())
    elif isinstance(value, enum.Enum):
        _feed(h, value.value, path)
    elif isinstance(value, str):
        _part(h, b"s", str(value).encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _part(h, b"b", bytes(value))
    elif isinstance(value, _TEXT_TYPES):
        kind_name = next(k for t, k in _BY_TEXT if isinstance(value, t))
        _part(h, b"t", kind_name + b":" + str(value).encode())
    elif (numpy := sys.modules.get("numpy")) is not None and isinstance(
        value, (numpy.ndarray, numpy.generic)
    ):
        _array(h, numpy, value, path)
    elif _is_number(value):
        _number(h, value)
    else:
        _within(h, value, path)


def _within(h: Any, value: Any, path: set[int]) -> None:
    """A container or an object: its parts, with `value` on the path while they are fed."""
    if id(value) in path:
        raise _Uncomparable(value, "it contains itself")
    path.add(id(value))
    try:
        for step, part in _parts(h, value):
            try:
                _feed(h, part, path)
            except _Uncomparable as exc:
                exc.path.append(step)
                raise
    finally:
        path.discard(id(value))


def _parts(h: Any, value: Any) -> Iterator[tuple[str, Any]]:
    """Tags `value`'s kind into `h` and yields its parts, each with its place for an error."""
    if isinstance(value, Mapping):
        _part(h, b"m", str(len(value)).encode())
        for key, item in sorted(value.items(), key=lambda pair: _digest(pair[0])):
            yield f"[{key!r}]", key
            yield f"[{key!r}]", item
    elif isinstance(value, (list, tuple)):
        _part(h, b"l", str(len(value)).encode())
        for i, item in enumerate(value):
            yield f"[{i}]", item
    elif isinstance(value, (set, frozenset)):
        _part(h, b"l", str(len(value)).encode())
        for digest in sorted(_digest(item) for item in value):
            _part(h, b"d", digest)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        yield from _parts(h, fields)
    elif (attributes := getattr(type(value), "__attrs_attrs__", None)) is not None:
        yield from _parts(h, {a.name: getattr(value, a.name) for a in attributes})
    elif hasattr(type(value), "model_dump") and hasattr(type(value), "model_fields"):
        yield "", value.model_dump(mode="json")  # a pydantic model (its class says so)
    elif isinstance(value, _NAMED):
        _named(h, value)
    else:
        yield from _state(h, value)


def _named(h: Any, value: Any) -> None:
    """A class or function, by the name it is imported by (the same in every process)."""
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", "")
    if (
        "<" in name
        or not module
        or getattr(value, "__self__", None) not in (None, sys.modules.get(module))
    ):
        raise _Uncomparable(value, "it has no name it can be imported by")
    _part(h, b"y", f"{module}.{name}".encode())


def _state(h: Any, value: Any) -> Iterator[tuple[str, Any]]:
    """An object by what pickle would save of it: how it is rebuilt, and its state."""
    try:
        reduced = value.__reduce_ex__(4)
    except Exception as exc:  # pickle's own refusal: "cannot pickle 'socket' object"
        raise _Uncomparable(value, str(exc) or type(exc).__name__) from None
    if isinstance(reduced, str):  # a module-level singleton, by its name
        _part(h, b"y", f"{type(value).__module__}.{reduced}".encode())
        return
    rebuild, args, state, items, pairs = (*reduced, None, None, None)[:5]
    _part(h, b"r", str(len(reduced)).encode())
    _named(h, rebuild)
    yield "", args
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
        state = state[1]  # __slots__ only
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**state[1], **state[0]}  # (__dict__, __slots__)
    if isinstance(state, dict) and all(isinstance(name, str) for name in state):
        _part(h, b"m", str(len(state)).encode())
        for name in sorted(state):  # attributes by name, whatever order they were set in
            yield f".{name}", name
            yield f".{name}", state[name]
    else:
        yield "", state  # what the class's own __getstate__ returns
    yield "", list(items) if items is not None else None
    yield "", list(pairs) if pairs is not None else None


def _array(h: Any, numpy: Any, value: Any, path: set[int]) -> None:
    """A numpy array by dtype, shape and bytes; a numpy scalar as the number it is."""
    if isinstance(value, numpy.bool_):
        _feed(h, bool(value), path)
    elif isinstance(value, numpy.generic) and _is_number(value):
        _number(h, value)
    elif value.dtype.hasobject:  # the bytes are pointers: compare the objects
        _part(h, b"a", f"{value.dtype.str}{value.shape}".encode())
        _within(h, numpy.asarray(value).ravel().tolist(), path)
    else:
        _part(h, b"a", f"{value.dtype.str}{value.shape}".encode())
        _part(h, b"b", numpy.ascontiguousarray(value).tobytes())


def _is_number(value: Any) -> bool:
    kind = type(value)
    return (
        isinstance(value, numbers.Number)
        or hasattr(kind, "__index__")
        or (hasattr(kind, "__float__") and not isinstance(value, (str, bytes)))
    )


def _number(h: Any, value: Any) -> None:
    """A number by its exact value: an int as itself, another real as its lowest terms
    (``0.5`` and ``Fraction(1, 2)`` alike, ``500.0`` as ``500``), a complex by both parts
    (a real one as its real part, as ``==`` has it)."""
    if not isinstance(value, numbers.Real) and isinstance(value, numbers.Complex):
        number = complex(value)
        if number.imag:
            _part(h, b"z", _real(number.real) + b"," + _real(number.imag))
            return
        value = number.real
    _part(h, b"n", _real(value))


def _real(value: Any) -> bytes:
    if hasattr(type(value), "__index__"):
        return str(operator.index(value)).encode()
    if isinstance(value, numbers.Rational):
        n, d = int(value.numerator), int(value.denominator)
    else:
        ratio = getattr(value, "as_integer_ratio", None)
        try:
            n, d = ratio() if ratio is not None else float(value).as_integer_ratio()
        except (ValueError, OverflowError):  # NaN and the infinities: no ratio
            return _unbounded(value)
    return str(n).encode() if d == 1 else f"{n}/{d}".encode()


def _unbounded(value: Any) -> bytes:
    """NaN and the infinities, as float spells them (a Decimal's too, as ``==`` has it)."""
    try:
        return repr(float(value)).encode()
    except ValueError:  # a signalling NaN, which float() refuses
        return str(value).encode()


def _part(h: Any, tag: bytes, data: bytes) -> None:
    h.update(tag)
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)


def _digest(value: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value, set())
    return h.digest()
