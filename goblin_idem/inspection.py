"""What the store holds for one Idempotency-Key (`python -m goblin_idem inspect`, cli.py).

The middleware never writes the raw key to the store: it names the claim and result keys
by a hash of (scope, key) (see `goblin_idem.keys`). This command derives the same names,
reads both keys and their TTLs, and says which state the key is in:

- free: no claim; the next request with this key runs the handler.
- in flight: a claim with no result yet; duplicates get 409 with Retry-After until the
  owner publishes, releases, or its lease runs out.
- completed: a stored response that duplicates get replayed (status, headers, body size).
- completed, not replayable: the run finished but its response was too large to store;
  duplicates get 409 ``not-replayable``.
- completed, unreadable: the result key holds bytes that are not a record this version
  reads, a sealed record that the configured keys do not open, or (``--require-sealed``)
  a record in the clear; the middleware answers such a key with 503 and never runs it again.

What it shows of a `once` function's value and of a sealed record: docs/operating/inspect.md.

The reads are four plain GET/PTTL commands, not one atomic snapshot: a key that changes
state while it is being inspected can show a mix of both states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from ._keys import KeyNames, key_names, names_of
from .exceptions import RecordError
from .once import _codecs as codecs
from .records._format import Format, Record, decode, format_of
from .records._sealing import Sealer
from .store import KeyT, Store, as_bytes

__all__ = [
    "COMPLETED",
    "FREE",
    "IN_FLIGHT",
    "NOT_REPLAYABLE",
    "SCOPE_ENV",
    "SCOPE_HINT",
    "UNREADABLE",
    "KeyState",
    "format_state",
    "inspect_key",
    "names_for_hash",
    "names_given",
]

FREE: Final = "free"
IN_FLIGHT: Final = "in flight"
COMPLETED: Final = "completed"
NOT_REPLAYABLE: Final = "completed, not replayable"
UNREADABLE: Final = "completed, unreadable"

_HASH = re.compile(r"[0-9a-f]{32}")
#: Where the command line reads a scope from when --scope is not given.
SCOPE_ENV: Final = "GOBLIN_SCOPE"
SCOPE_HINT: Final = (
    "nothing is stored for this key in the empty scope (callers without an Authorization "
    "header). A request sent with one was keyed by that header's value (or by what the "
    "middleware's scope= returned): inspect it in that scope (python -m goblin_idem inspect "
    f"reads it from ${SCOPE_ENV}, or from stdin with --scope -), or by the key hash a log "
    "line shows (--hash)"
)


@dataclass(frozen=True, slots=True)
class KeyState:
    """One key's state. TTLs are PTTL replies in ms (-1: no TTL); None when the key is absent."""

    names: KeyNames
    state: str
    token: bytes | None = None  # the claim's value: the owner's token
    claim_ttl_ms: int | None = None
    result_ttl_ms: int | None = None
    result_bytes: int | None = None  # size of the stored record
    record: Record | None = None
    value_bytes: int | None = None  # a `once` function's value: its size, opened
    error: str | None = None  # why the result could not be read
    note: str | None = None
    format: Format | None = None  # the record's clear bytes: version, sealed, key id
    revealed: bool = True  # the record's headers may be shown

    @property
    def opens(self) -> bool | None:
        """Whether the configured keys open a sealed record (None: not sealed)."""
        if self.format is None or not self.format.sealed:
            return None
        return self.record is not None or self.value_bytes is not None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (bytes as latin-1 text, so nothing is lost)."""
        rec, fmt = self.record, self.format
        return {
            "hash": self.names.hash,
            "claim_key": self.names.claim.decode("latin-1"),
            "result_key": self.names.result.decode("latin-1"),
            "state": self.state,
            "token": None if self.token is None else self.token.decode("latin-1"),
            "claim_ttl_ms": self.claim_ttl_ms,
            "result_ttl_ms": self.result_ttl_ms,
            "result_bytes": self.result_bytes,
            "status": None if rec is None else rec.status,
            "headers": None
            if rec is None or not self.revealed
            else [[n.decode("latin-1"), v.decode("latin-1")] for n, v in rec.headers],
            "body_bytes": None if rec is None else len(rec.body),
            "value_bytes": self.value_bytes,
            "error": self.error,
            "note": self.note,
            "format": None if fmt is None else fmt.version,
            "sealed": None if fmt is None else fmt.sealed,
            "key_id": None if fmt is None or fmt.key_id is None else fmt.key_id.hex(),
            "opens": self.opens,
        }


def names_for_hash(key_hash: str, *, namespace: KeyT = b"idem") -> KeyNames:
    """The claim and result keys of a key hash as logs print it (32 hex digits)."""
    if not _HASH.fullmatch(key_hash):
        raise ValueError("a key hash is 32 lowercase hex digits, as the middleware logs it")
    return names_of(as_bytes(namespace), key_hash)


def names_given(key: KeyT | None, scope: KeyT, namespace: KeyT, names: KeyNames | None) -> KeyNames:
    """The store names of `key` in `scope` and `namespace` (as the middleware names them),
    or `names` as given (a key hash's, `names_for_hash`)."""
    if names is not None:
        return names
    if key is None:
        raise ValueError("give a key or names")
    return key_names(as_bytes(namespace), as_bytes(scope), as_bytes(key))


async def _ttl(store: Store, key: bytes) -> int | None:
    ms = await store.pttl(key)
    return None if ms == -2 else ms


async def inspect_key(
    store: Store,
    key: KeyT | None = None,
    *,
    scope: KeyT = b"",
    namespace: KeyT = b"idem",
    names: KeyNames | None = None,
    sealer: Sealer | None = None,
    reveal: bool = False,
    require_sealed: bool = False,
) -> KeyState:
    """Read the state of `key` as the middleware sees it for callers in `scope` (by default
    the request's Authorization header value, empty for anonymous callers)."""
    names = names_given(key, scope, namespace, names)
    token = await store.get(names.claim)
    claim_ttl = await _ttl(store, names.claim) if token is not None else None
    data = await store.get(names.result)
    result_ttl = await _ttl(store, names.result) if data is not None else None
    if token is None:
        return _free(names, data, result_ttl, hint=key is not None and not scope)
    if data is None:
        note = None
        if claim_ttl == -1:
            note = "the claim has no TTL: nothing will ever free it (delete it by hand)"
        return KeyState(names, IN_FLIGHT, token, claim_ttl, note=note)
    return _completed(names, token, claim_ttl, data, result_ttl, sealer, reveal, require_sealed)


def _free(names: KeyNames, data: bytes | None, result_ttl: int | None, *, hint: bool) -> KeyState:
    """No claim: a result left without one, or nothing (in the empty scope: `hint`)."""
    note = None
    if data is not None:
        note = (
            "a result is stored but its claim is gone: the next request with this key "
            "is answered from the result, and takes the claim back"
        )
    elif hint:
        note = SCOPE_HINT
    return KeyState(
        names,
        FREE,
        claim_ttl_ms=None,
        result_ttl_ms=result_ttl,
        result_bytes=None if data is None else len(data),
        note=note,
    )


# A value stored by `once`'s codecs: `once` itself, a gRPC interceptor, a broker consumer.
_ONCE_VALUE = (
    "a value stored by once, a gRPC interceptor or a broker consumer: calls and deliveries "
    "with this key get it without running"
)
_ONCE_UNREADABLE = (
    "once raises goblin_idem.exceptions.RecordError for this key (gRPC: INTERNAL); nothing "
    "with it runs"
)


def _completed(
    names: KeyNames,
    token: bytes,
    claim_ttl: int | None,
    data: bytes,
    result_ttl: int | None,
    sealer: Sealer | None,
    reveal: bool,
    require_sealed: bool,
) -> KeyState:
    """A claim and a result: the record read, or a `once` function's value (a format of
    its own, shown by its size), or why it cannot be read."""
    once_value = data[: len(codecs.MAGIC)] == codecs.MAGIC
    fmt: Format | None = None

    def state(kind: str, **found: Any) -> KeyState:
        return KeyState(names, kind, token, claim_ttl, result_ttl, len(data), format=fmt, **found)

    try:
        if once_value:
            fmt = codecs.stored_format(data)
            value = codecs.from_stored(
                _Payload(), data, sealer, names.result, require_sealed=require_sealed
            )
            return state(COMPLETED, value_bytes=len(value), note=_ONCE_VALUE)
        fmt = _format_or_none(data)
        record = decode(data, sealer=sealer, name=names.result, require_sealed=require_sealed)
    except RecordError as exc:
        if once_value:
            note = _ONCE_UNREADABLE
        else:
            note = "the middleware answers requests with this key with 503 and never runs them"
        if fmt is not None and fmt.sealed and sealer is None:
            note += "; set $GOBLIN_IDEM_ENCRYPTION_KEYS to check whether your keys open it"
        return state(UNREADABLE, error=str(exc), note=note)
    return state(
        COMPLETED if record.replayable else NOT_REPLAYABLE,
        record=record,
        revealed=reveal or not (fmt is not None and fmt.sealed),
    )


class _Payload:
    """The codec that leaves a stored value's payload as bytes (its size is what is shown)."""

    def encode(self, value: bytes) -> bytes:
        return value

    def decode(self, data: bytes) -> bytes:
        return data


def _format_or_none(data: bytes) -> Format | None:
    try:
        return format_of(data)
    except RecordError:
        return None


def _ttl_text(ms: int | None) -> str:
    if ms is None:
        return "absent"
    if ms == -1:
        return "no TTL"
    if ms >= 10_000:
        return f"{ms} ms left ({ms / 1000:.0f} s)"
    return f"{ms} ms left"


def _text(value: bytes) -> str:
    """Header bytes as text; anything but printable ASCII is escaped."""
    text = value.decode("latin-1")
    if text.isascii() and text.isprintable():
        return text
    return repr(value)[2:-1]


def format_state(state: KeyState) -> str:
    """A few aligned lines for a terminal."""
    names = state.names
    lines = [
        ("key hash", names.hash),
        ("claim key", _text(names.claim)),
        ("result key", _text(names.result)),
        ("state", state.state),
    ]
    if state.token is not None:
        label = "lease" if state.state == IN_FLIGHT else "claim"
        lines.append((label, _ttl_text(state.claim_ttl_ms)))
        lines.append(("owner token", _text(state.token)))
    if state.state != IN_FLIGHT and state.result_bytes is not None:
        lines.append(("result", f"{_ttl_text(state.result_ttl_ms)}, {state.result_bytes} bytes"))
    fmt = state.format
    if fmt is not None:
        lines.append(("format", f"version {fmt.version}" + (", sealed" if fmt.sealed else "")))
        if fmt.key_id is not None:
            lines.append(("key id", fmt.key_id.hex()))
            lines.append(("opens", "yes" if state.opens else "no, with the configured keys"))
    if state.value_bytes is not None:
        lines.append(("value", f"{state.value_bytes} bytes"))
    rec = state.record
    if rec is not None:
        lines.append(("status", str(rec.status)))
        if rec.replayable and not state.revealed:
            lines.append(("headers", f"{len(rec.headers)} (sealed: --reveal shows them)"))
            lines.append(("body", f"{len(rec.body)} bytes"))
        elif rec.replayable:
            for i, (name, value) in enumerate(rec.headers):
                lines.append(("headers" if i == 0 else "", f"{_text(name)}: {_text(value)}"))
            if not rec.headers:
                lines.append(("headers", "(none)"))
            lines.append(("body", f"{len(rec.body)} bytes"))
        else:
            lines.append(
                (
                    "replay",
                    "none: the response was larger than max_response_bytes; "
                    "duplicates get 409 not-replayable",
                )
            )
    if state.error is not None:
        lines.append(("error", state.error))
    if state.note is not None:
        lines.append(("note", state.note))
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label:<{width}}  {value}".rstrip() for label, value in lines)
