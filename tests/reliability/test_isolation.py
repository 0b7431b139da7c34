"""Isolation: two callers who send the same key each get their own run and their own answer,
and no byte trick lets one caller's key reach another caller's record.

The tricks: shifting the credential/key boundary (``ab`` + ``c`` vs ``a`` + ``bc``), hash-tag
braces in either part, NUL bytes, and a namespace shared by two apps. Deterministic cases run
on MemoryStore and a real Redis; a hypothesis property splits one byte string at two points.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, Store
from goblin_idem._keys import key_names
from tests.reliability.report import pick, record
from tests.support.asgi import request
from tests.support.backends import Backend

ISOLATION_SEEN: Counter[str] = Counter()


class WhoApp:
    """Answers with who called (its tenant header), the key, and a nonce; counts runs."""

    def __init__(self) -> None:
        self.runs: Counter[tuple[bytes, bytes]] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        hs = dict(scope["headers"])
        who = (hs.get(b"x-tenant", hs.get(b"authorization", b"")), hs.get(b"idempotency-key", b""))
        self.runs[who] += 1
        body = json.dumps(
            {"who": who[0].hex(), "key": who[1].hex(), "nonce": secrets.token_hex(8)}
        ).encode()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body})


def tenant_scope(scope: Scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"x-tenant":
            return bytes(value)
    return b""


async def caller(mw: IdempotencyMiddleware, who_header: str, who: bytes, key: bytes) -> bytes:
    """Send as `who` with `key` (raw bytes, as an ASGI server would pass them)."""
    headers = [(who_header, who.decode("latin-1")), ("Idempotency-Key", key.decode("latin-1"))]
    reply = await request(mw, "POST", "/pay", headers=headers, body=b"{}")
    assert reply.status == 201, (reply.status, reply.body)
    return reply.body


async def assert_isolated(
    store: Store, pairs: Sequence[tuple[bytes, bytes]], *, who_header: str = "X-Tenant"
) -> None:
    """Every (caller, key) pair runs once, gets its own answer, and replays only that."""
    app = WhoApp()
    mw = IdempotencyMiddleware(
        app,
        store=store,
        key_pattern=lambda k: True,
        scope=tenant_scope if who_header == "X-Tenant" else None,
        namespace=f"iso-{secrets.token_hex(4)}",
    )
    firsts = [await caller(mw, who_header, who, key) for who, key in pairs]
    again = [await caller(mw, who_header, who, key) for who, key in pairs]
    assert again == firsts  # each replays its own
    assert len(set(firsts)) == len(pairs)  # nobody got another's answer
    for (who, key), body in zip(pairs, firsts, strict=True):
        data = json.loads(body)
        assert (bytes.fromhex(data["who"]), bytes.fromhex(data["key"])) == (who, key)
        assert app.runs[(who, key)] == 1
    names = {key_names(mw.namespace, who, key).claim for who, key in pairs}
    assert len(names) == len(pairs)
    ISOLATION_SEEN["pairs"] += len(pairs)
    ISOLATION_SEEN["requests"] += 2 * len(pairs)


TRICKS: dict[str, list[tuple[bytes, bytes]]] = {
    "same key, two credentials": [(b"Bearer sk_alice", b"order-1"), (b"Bearer sk_bob", b"order-1")],
    "boundary shift": [(b"ab", b"c"), (b"a", b"bc"), (b"", b"abc"), (b"abc", b"x")],
    "hash-tag braces": [(b"t{1}", b"k"), (b"t", b"{1}k"), (b"t{", b"1}k"), (b"t", b"{t}")],
    "NUL bytes": [(b"a\x00b", b"k"), (b"a", b"\x00bk"), (b"a\x00", b"bk"), (b"a", b"k\x00")],
    "length prefix forgery": [
        (b"", (1).to_bytes(4, "big") + b"xk"),
        (b"x", b"k"),
        ((4).to_bytes(4, "big"), b"k"),
    ],
    "anonymous vs empty credential": [(b"", b"k1"), (b" ", b"k1")],
}


@pytest.mark.parametrize("trick", list(TRICKS))
async def test_tricks_never_cross_tenants(backend: Backend, trick: str) -> None:
    await assert_isolated(backend.store, TRICKS[trick])


async def test_default_scope_is_the_authorization_header(backend: Backend) -> None:
    await assert_isolated(
        backend.store,
        [(b"Bearer a", b"bc"), (b"Bearer ab", b"c"), (b"Bearer a{", b"}c")],
        who_header="Authorization",
    )


async def test_two_namespaces_on_one_store_do_not_share() -> None:
    store = MemoryStore()
    apps = [WhoApp(), WhoApp()]
    mws = [
        IdempotencyMiddleware(a, store=store, namespace=ns)
        for a, ns in zip(apps, "xy", strict=True)
    ]
    bodies = [await caller(mw, "Authorization", b"Bearer t", b"k") for mw in mws]
    assert bodies[0] != bodies[1] and all(a.runs[(b"Bearer t", b"k")] == 1 for a in apps)


# A key part that starts with a double quote is read as an RFC 8941 String, whose content
# is the key (test_keys.py): the raw byte split would no longer be what the test compares.
splits = st.binary(min_size=2, max_size=40).flatmap(
    lambda s: st.tuples(st.just(s), st.integers(0, len(s) - 1), st.integers(0, len(s) - 1)).filter(
        lambda t: t[1] != t[2] and s[t[1] : t[1] + 1] != b'"' and s[t[2] : t[2] + 1] != b'"'
    )
)


SPLIT_EXAMPLES = pick(150, 2000)


def test_one_byte_string_split_two_ways_is_two_identities() -> None:
    """A hypothesis property: a byte string split at two points is two (caller, key) pairs,
    isolated from each other. It runs last in this file and reports the figures of every
    isolation case of the session."""
    examples = 0

    @settings(
        max_examples=SPLIT_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=None,
    )
    @given(split=splits)
    def split_twice(split: tuple[bytes, int, int]) -> None:
        nonlocal examples
        s, i, j = split
        asyncio.run(assert_isolated(MemoryStore(), [(s[:i], s[i:]), (s[:j], s[j:])]))
        examples += 1

    split_twice()
    record(
        "isolation",
        "Isolation: same key, different callers; byte tricks",
        {"tricks": len(TRICKS), "split_examples": examples, **dict(ISOLATION_SEEN)},
        checks=[
            "each (caller, key) pair ran exactly once and replays only its own answer",
            "credential/key boundary shifts, braces, NUL bytes, a forged length prefix, and "
            "two namespaces on one store never share a record",
        ],
        notes=[
            "pairs and requests count every isolation case of the session: the byte tricks "
            "on every store, then the split property on MemoryStore",
        ],
    )
    assert examples >= SPLIT_EXAMPLES * 0.9, f"only {examples} examples ran"
