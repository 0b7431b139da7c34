"""Fuzz: methods, header sets, key bytes, bodies and chunking thrown at the middleware (ASGI,
in process) on MemoryStore and on a real Redis.

Whatever comes in, the middleware never answers 500 itself and never raises; every answer of
its own is a well-formed problem+json; a client that leaves mid-body gets nothing and runs
nothing; a duplicate is a byte-identical replay or a problem; and nothing it stores contains
the raw key (each fuzzed key is wrapped in a random marker, and no stored key name or value
may contain the marker).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message, Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore, Store
from goblin_idem._keys import DEFAULT_KEY_PATTERN
from tests.reliability.report import pick, record
from tests.support.backends import stored_items
from tests.support.responses import problem_slug
from tests.support.servers import Server

EXAMPLES = pick(200, 2000)
PROBLEM_STATUSES = {400, 409, 413, 422, 503}

pieces = st.sampled_from(
    [b"\r\n", b"\n", b"{", b"}", b"{}", b"\x00", b" ", b":", b"\xff", "é€".encode(), b"%00"]
)
printable = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40
).map(str.encode)
key_core = st.one_of(
    printable,
    printable,
    st.lists(st.one_of(pieces, st.binary(max_size=12)), max_size=8).map(b"".join),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"k" * 10240, b"{" * 300, b"\x00" * 64, b"a" * 255, b"a" * 256]),
)
header_value = st.one_of(
    st.binary(max_size=30),
    st.sampled_from([b"", b"-1", b"abc", b"99999999999999999999", b"12", b"0", b"1e3"]),
)
header_name = st.sampled_from(
    [
        b"content-length",
        b"content-type",
        b"authorization",
        b"x-api-version",
        b"transfer-encoding",
        b"idempotency-key",
        b"Idempotency-Key",
        b"cookie",
    ]
)


@dataclass
class Case:
    method: str
    core: bytes | None
    marked: bool
    key_headers: int
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes]
    leave_mid_body: bool
    permissive: bool
    max_body: int
    scope_fn: bool
    fingerprint: bool
    status: int
    response_chunks: list[bytes]
    twice: bool
    second_differs: bool
    concurrent: bool
    mark: bytes = field(default_factory=lambda: b"MK" + secrets.token_hex(6).encode())

    @property
    def key(self) -> bytes | None:
        if self.core is None:
            return None
        return self.mark + self.core + self.mark if self.marked else self.core


random_cases = st.builds(
    Case,
    method=st.sampled_from(["POST", "PATCH", "PUT", "GET", "post", "OPTIONS"]),
    core=st.one_of(st.none(), key_core),
    marked=st.booleans(),
    key_headers=st.sampled_from([1, 1, 1, 2]),
    headers=st.lists(st.tuples(header_name, header_value), max_size=5),
    chunks=st.lists(st.binary(max_size=700), min_size=1, max_size=5),
    leave_mid_body=st.booleans(),
    permissive=st.booleans(),
    max_body=st.sampled_from([64, 1024, 1 << 20]),
    scope_fn=st.booleans(),
    fingerprint=st.booleans(),
    status=st.sampled_from([200, 201, 204, 404, 500]),
    response_chunks=st.lists(st.binary(max_size=200), min_size=1, max_size=3),
    twice=st.booleans(),
    second_differs=st.booleans(),
    concurrent=st.booleans(),
)
# Requests the middleware takes on (a valid key on a covered method), sent twice: replays,
# 422 for a changed body, 409 for a concurrent duplicate, 413 for a large body.
covered_cases = st.builds(
    Case,
    method=st.sampled_from(["POST", "PATCH"]),
    core=st.one_of(printable, key_core),
    marked=st.booleans(),
    key_headers=st.just(1),
    headers=st.lists(
        st.tuples(header_name.filter(lambda n: n.lower() != b"idempotency-key"), header_value),
        max_size=3,
    ),
    chunks=st.lists(st.binary(max_size=300), min_size=1, max_size=4),
    leave_mid_body=st.sampled_from([False, False, False, True]),
    permissive=st.just(True),
    max_body=st.sampled_from([256, 1 << 20, 1 << 20]),
    scope_fn=st.booleans(),
    fingerprint=st.booleans(),
    status=st.sampled_from([200, 201, 204, 404, 500]),
    response_chunks=st.lists(st.binary(max_size=200), min_size=1, max_size=3),
    twice=st.just(True),
    second_differs=st.sampled_from([False, False, True]),
    concurrent=st.sampled_from([False, False, True]),
)
cases = st.one_of(random_cases, covered_cases, covered_cases)


@dataclass
class Outcome:
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


class FuzzApp:
    def __init__(self, case: Case) -> None:
        self.case = case
        self.runs = 0
        self.gate = asyncio.Event()
        if not case.concurrent:
            self.gate.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs += 1
        first = self.runs == 1
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        if first:  # only the first run waits, so a concurrent duplicate can see it in flight
            await self.gate.wait()
        headers = [(b"content-type", b"application/octet-stream"), (b"x-handler", b"1")]
        await send({"type": "http.response.start", "status": self.case.status, "headers": headers})
        chunks = self.case.response_chunks
        for i, chunk in enumerate(chunks):
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1}
            )


async def drive(
    mw: IdempotencyMiddleware, case: Case, *, leave: bool, extra: bytes = b""
) -> Outcome:
    headers = list(case.headers)
    key = case.key
    if key is not None:
        headers += [(b"idempotency-key", key)] * case.key_headers
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": case.method,
        "scheme": "http",
        "path": "/fuzz",
        "raw_path": b"/fuzz",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    pending: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(case.chunks) - 1}
        for i, c in enumerate([*case.chunks[:-1], case.chunks[-1] + extra])
    ]
    if leave:
        pending = [*pending[:-1], {"type": "http.disconnect"}]
    out = Outcome()

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            assert out.status is None, "two response starts"
            out.status = message["status"]
            out.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            out.body += message.get("body", b"")

    await mw(scope, receive, send)
    return out


def check(
    case: Case, out: Outcome, app: FuzzApp, runs_before: int | None, seen: Counter[str]
) -> None:
    """`runs_before`: the handler's runs before this request (None: others ran meanwhile)."""
    if out.status is None:  # only a client that left mid-body goes unanswered
        assert case.leave_mid_body, case
        assert runs_before is None or app.runs == runs_before
        seen["no_answer_client_left"] += 1
        return
    if (b"x-handler", b"1") in out.headers:
        assert out.status == case.status
        assert out.body == b"".join(case.response_chunks)
        seen["replayed" if (b"idempotent-replayed", b"true") in out.headers else "handler"] += 1
        return
    assert out.status != 500, out
    assert out.status in PROBLEM_STATUSES, out
    slug = problem_slug(out.status, out.headers, out.body)
    seen[f"{out.status} {slug}"] += 1


async def fuzz_one(store: Store, case: Case, seen: Counter[str]) -> None:
    namespace = b"fz" + secrets.token_hex(4).encode()
    app = FuzzApp(case)
    mw = IdempotencyMiddleware(
        app,
        store=store,
        namespace=namespace.decode(),
        key_pattern=(lambda k: True) if case.permissive else DEFAULT_KEY_PATTERN,
        max_body_bytes=case.max_body,
        scope=(lambda s: b"tenant\x00{" + case.mark + b"}") if case.scope_fn else None,
        fingerprint_headers=("x-api-version",) if case.fingerprint else (),
    )
    extra = b"!" if case.second_differs else b""
    try:
        if case.concurrent:  # the duplicate arrives while the first run waits
            task = asyncio.ensure_future(drive(mw, case, leave=case.leave_mid_body))
            for _ in range(2000):
                if app.runs or task.done():
                    break
                await asyncio.sleep(0.001)
            if not app.runs:  # the first never reached the handler: nothing to hold
                app.gate.set()
            during = await drive(mw, case, leave=False, extra=extra)
            app.gate.set()
            first = await task
            check(case, during, app, None, seen)
            check(case, first, app, None, seen)
        else:
            first = await drive(mw, case, leave=case.leave_mid_body)
            check(case, first, app, 0, seen)
        if case.twice and first.status is not None:
            runs = app.runs
            second = await drive(mw, case, leave=False, extra=extra)
            check(case, second, app, runs if not extra else None, seen)
            stored = (b"x-handler", b"1") in first.headers and first.status < 500
            if stored and app.runs == runs and not extra:
                assert (second.status, second.body) == (first.status, first.body)
                assert (b"idempotent-replayed", b"true") in second.headers
    except AssertionError:
        raise
    except Exception as exc:  # pragma: no cover - the assertion explains
        raise AssertionError(f"the middleware raised {exc!r} for {case}") from exc
    key = case.key
    for name, value in await stored_items(store, namespace + b":*"):
        assert case.mark not in name and case.mark not in value, (name, value)
        # The key itself may also be what a body happens to hold; the marker never is.
        if key is not None and len(key) >= 12 and len(set(key)) > 3:
            assert key not in name, name
    seen["examples"] += 1


def _report(name: str, seen: Counter[str]) -> None:
    record(
        f"fuzz-{name}",
        f"Fuzz (hypothesis, ASGI in process) on {name}",
        {"examples": seen.pop("examples", 0), **dict(sorted(seen.items()))},
        checks=[
            "no exception out of the middleware; never a 500 of its own",
            "every answer of its own is problem+json with matching status and length",
            "a client that leaves mid-body is not answered and runs nothing",
            "a duplicate of a stored response replays it byte for byte",
            "no stored key name or value contains the raw key (or its random marker)",
        ],
    )


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def test_fuzz_memory_store() -> None:
    seen: Counter[str] = Counter()

    @SETTINGS
    @given(case=cases)
    def run(case: Case) -> None:
        asyncio.run(asyncio.wait_for(fuzz_one(MemoryStore(), case, seen), 30))

    run()
    _report("MemoryStore", seen)


def test_fuzz_redis_store(redis_server: Server) -> None:
    seen: Counter[str] = Counter()

    @SETTINGS
    @given(case=cases)
    def run(case: Case) -> None:
        async def go() -> None:
            store = RedisStore.from_url(redis_server.url, mode="script")
            try:
                await asyncio.wait_for(fuzz_one(store, case, seen), 30)
            finally:
                await store.aclose()

        asyncio.run(go())

    run()
    _report("redis-server (script mode)", seen)


def test_problem_bodies_name_no_key() -> None:
    """The detail texts are fixed sentences: a key never echoes back in a problem body."""
    case = Case(
        "POST", b"\r\n{x}\x00", True, 2, [], [b"x"], False, False, 1 << 20, False, False,
        201, [b"ok"], False, False, False,
    )  # fmt: skip
    out = asyncio.run(drive(IdempotencyMiddleware(FuzzApp(case)), case, leave=False))
    assert out.status == 400 and case.mark not in out.body
    assert json.loads(out.body)["type"].endswith("invalid-key")
