"""Checks of configuration values, made once at construction.

A value that cannot work fails here, with an error that names the option, says what is
allowed and what to pass instead, rather than on every request later (or never, and then
quietly wrong). ``bool`` is refused where a number is meant: ``True`` is an ``int`` to
Python, and ``lease_seconds=True`` is a mistake, not a one-second lease.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from ._durations import kind as _kind
from ._durations import renamed_ms, seconds
from ._recording import Records
from .records import _compression
from .records._sealing import ENV_VAR, Sealer, keys_from_env
from .store import MemoryStore, Store

__all__ = [
    "callable_or_none",
    "compressor",
    "flag",
    "header_names",
    "http_tokens",
    "key_pattern",
    "methods",
    "namespace",
    "patterns",
    "polling",
    "renamed_ms",
    "require_sealed",
    "sealer",
    "seconds",
    "store",
    "whole_number",
]

# RFC 9110 token: the characters a header name or a method may consist of.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def whole_number(name: str, value: object, *, minimum: int) -> int:
    """An ``int`` (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number (int) >= {minimum}, not {_kind(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {_kind(value)}")
    return value


def callable_or_none(name: str, value: object, what: str) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be None or {what}, not {_kind(value)}")
    return value


def _strings(name: str, value: object, what: str) -> list[object]:
    """The items of a list option; a bare string is refused, since iterating it would give
    one item per character."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be a list of {what}s, like [{value!r}], not {_kind(value)}"
            if isinstance(value, str)
            else f"{name} must be a list of {what}s (str), not {_kind(value)}"
        )
    return list(value)


def patterns(name: str, value: object) -> tuple[str, ...]:
    """A list of fnmatch path patterns."""
    found = []
    for item in _strings(name, value, "path pattern"):
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold path patterns (str), not {_kind(item)}")
        found.append(item)
    return tuple(found)


def http_tokens(name: str, value: object, what: str, *, allow_empty: bool = True) -> list[str]:
    """A list of header names or methods: each an RFC 9110 token (no spaces, colons or
    control characters), as a server would accept it on the wire."""
    items = _strings(name, value, what)
    if not items and not allow_empty:
        raise ValueError(f"{name} must name at least one {what}")
    tokens = []
    for item in items:
        if not isinstance(item, str) or _TOKEN.fullmatch(item) is None:
            raise ValueError(
                f"{name}: {item!r} is not a valid {what}; use letters, digits and "
                "!#$%&'*+-.^_`|~ only (no spaces, colons or control characters)"
            )
        tokens.append(item)
    return tokens


def header_names(name: str, value: object) -> tuple[bytes, ...]:
    """Header names as ASGI carries them: lowercase latin-1 bytes."""
    return tuple(h.lower().encode("latin-1") for h in http_tokens(name, value, "header name"))


def methods(value: object) -> frozenset[str]:
    return frozenset(m.upper() for m in http_tokens("methods", value, "method", allow_empty=False))


def polling(wait: object, interval: object) -> tuple[float, float]:
    """How long a duplicate waits for the first request, and the pause between two polls
    of the claim (seconds)."""
    waited = seconds("wait_seconds", wait, minimum=0)
    pause = seconds("poll_interval_seconds", interval, minimum=0)
    if waited and pause < 0.001:
        raise ValueError(
            "poll_interval_seconds must be >= 0.001 when wait_seconds > 0: it is the pause "
            "between two claim polls, and 0 would poll the store in a busy loop (0.05 is the "
            "default)"
        )
    return waited, pause


def store(value: object) -> Store:
    """The store; a URL string (the usual mistake) gets a message that never repeats it,
    since a URL may carry a password."""
    if value is None:
        return MemoryStore()
    if isinstance(value, type):  # the class has the Store methods, unbound
        raise TypeError(
            f"store must be a Store instance, not the class {value.__name__}: "
            "pass store=RedisStore.from_url(url) (or MemoryStore())"
        )
    if isinstance(value, Store):
        return value
    if isinstance(value, (str, bytes)):
        raise TypeError(
            "store must be a Store, not a URL string: pass store=RedisStore.from_url(url) "
            "(or MemoryStore() for one process)"
        )
    if hasattr(value, "execute_command"):
        raise TypeError(
            f"store must be a Store, not {_kind(value)} client: wrap it, "
            "store=RedisStore(client), or build one with RedisStore.from_url(url)"
        )
    raise TypeError(
        "store must be a Store (RedisStore.from_url(url), RedisStore(client) or MemoryStore()), "
        f"not {_kind(value)}"
    )


def records(value: object) -> Records | None:
    """Where records are committed (``goblin_idem.sql.SqlRecords``), or None: TypeError,
    saying what to pass, for records whose transaction is in the request's thread
    (``SyncSqlRecords``, Django's)."""
    if value is None:
        return None
    if callable(getattr(value, "work", None)) and not callable(getattr(value, "transaction", None)):
        raise TypeError(
            f"records: {value!r} keeps its transaction in the request's thread (sync "
            "SQLAlchemy, Django's ORM): it serves the WSGI, Flask and Django (under WSGI) "
            "middlewares; here, pass goblin_idem.sql.SqlRecords(engine) with an AsyncEngine"
        )
    if all(callable(getattr(value, m, None)) for m in ("transaction", "lookup", "check")):
        return value  # type: ignore[return-value]
    raise TypeError(
        "records must be SqlRecords(engine) from goblin_idem.sql (or an object with its "
        f"transaction, lookup and check methods), not {_kind(value)}"
    )


def key_pattern(value: object) -> re.Pattern[bytes] | Callable[[bytes], bool]:
    if isinstance(value, re.Pattern):
        if not isinstance(value.pattern, bytes):
            raise TypeError(
                "key_pattern must match bytes: compile it from a bytes pattern, "
                f"re.compile(rb{value.pattern!r})"
            )
        return value
    if isinstance(value, str) or not callable(value):
        raise TypeError(
            "key_pattern must be a compiled bytes pattern, re.compile(rb'...'), or a function "
            f"of the key bytes returning True for a valid key, not {_kind(value)}"
        )
    return value


def namespace(value: object) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"namespace must be a str, not {_kind(value)}")
    if not value:
        raise ValueError(
            "namespace must not be empty: it prefixes every store key (default 'idem')"
        )
    if "{" in value or "}" in value:
        raise ValueError(
            f"namespace {value!r} must not contain {{ or }}: the key names carry a Redis "
            "Cluster hash tag in braces, which a brace in the prefix would displace"
        )
    return value.encode()


def sealer(value: object) -> Sealer | None:
    """`encryption_keys`: a Sealer, a list of 32-byte keys (current first), or None for
    the keys in $GOBLIN_IDEM_ENCRYPTION_KEYS (no encryption if it is unset); [] turns
    encryption off whatever the environment says."""
    if isinstance(value, Sealer):
        return value
    if value is None:
        value = keys_from_env()
        if value is None:
            return None
        where = f" (from ${ENV_VAR})"
    else:
        where = ""
    if isinstance(value, (list, tuple)) and not value:
        return None
    try:
        return Sealer(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"encryption_keys{where}: {exc}") from None


def require_sealed(value: object, sealer: Sealer | None) -> bool:
    """`require_sealed`: stored values in the clear are refused. Without keys nothing is
    sealed, so every stored value would be refused: a configuration error."""
    required = flag("require_sealed", value)
    if required and sealer is None:
        raise ValueError(
            "require_sealed=True refuses every stored value that is not sealed, and no "
            f"encryption keys are configured: pass encryption_keys=[key, ...] or set "
            f"${ENV_VAR}, or turn require_sealed off"
        )
    return required


def compressor(value: object) -> _compression.Compressor | None:
    """`compression`: 'zlib', 'zstd' or None (bodies stored as sent)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"compression must be 'zlib', 'zstd' or None, not {_kind(value)}")
    return _compression.compressor(value)
