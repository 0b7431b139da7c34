"""Idempotency-Key as the IETF draft defines it: an RFC 8941 String, quoted, with escapes."""

from __future__ import annotations

import json

import httpx
import pytest

from goblin_idem import IdempotencyMiddleware, MemoryStore, Store
from goblin_idem._keys import key_names, names_of, shown, string_key
from tests.support.asgi import Handler, problem, request
from tests.support.procs import start_uvicorn, stop
from tests.support.servers import Server, free_port

INVALID = "urn:goblin-idem:problem:invalid-key"


async def test_quoted_and_bare_forms_are_one_key(store: Store) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store)
    first = await request(mw, key='"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    bare = await request(mw, key="8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert (first.status, bare.status) == (201, 201)
    assert bare.header("idempotent-replayed") == b"true" and bare.body == first.body
    assert handler.runs == 1
    names = key_names(b"idem", b"", b"8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert await store.get(names.result) is not None  # stored under the unquoted key's name


@pytest.mark.parametrize(
    ("quoted", "bare"),
    [
        (r'"say \"hi\""', 'say "hi"'),
        (r'"back\\slash"', "back\\slash"),
        ('"with space"', "with space"),
        ('"abc";v=1', "abc"),  # parameters do not change the key
        ('"abc"; v=1;flag;n=-12.5;t=tok/1:2;s="x";b=:YWJj:;q=?0', "abc"),
        ('"abc"  ', "abc"),  # the spaces a field may end with
    ],
)
async def test_escapes_and_parameters(quoted: str, bare: str) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=MemoryStore())
    await request(mw, key=bare)
    again = await request(mw, key=quoted)
    assert again.header("idempotent-replayed") == b"true" and handler.runs == 1


async def test_the_length_limit_counts_the_key_not_its_quotes() -> None:
    mw = IdempotencyMiddleware(Handler(), store=MemoryStore())
    assert (await request(mw, key='"' + "k" * 255 + '"')).status == 201
    assert (await request(mw, key="k" * 255)).header("idempotent-replayed") == b"true"
    assert (await request(mw, key='"' + "k" * 256 + '"')).status == 400


@pytest.mark.parametrize(
    "value",
    [
        '"abc',  # unterminated
        '"',
        r'"a\xb"',  # an escape other than \" and \\
        '"tab\there"',  # outside 0x20-0x7E
        '"caf\xe9"',
        '"abc"x',  # text after the closing quote
        '"abc" ;v=1',  # a space before the parameters
        '"abc";V=1',  # a parameter key is lowercase
        '"abc";v=',  # a parameter value is missing
        '"abc";v=1.2345',  # a decimal has at most 3 fraction digits
        '"abc";v="x',
        '"abc","def"',  # a list, not an item
    ],
)
async def test_malformed_quoted_key_is_400_and_runs_nothing(value: str) -> None:
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=(store := MemoryStore()))
    detail = problem(reply := await request(mw, key=value))
    assert (reply.status, detail["type"]) == (400, INVALID)
    assert "RFC 8941 String" in detail["detail"]
    assert (handler.runs, len(store), mw.counters.invalid_key) == (0, 0, 1)


async def test_an_empty_string_is_an_invalid_key() -> None:
    mw = IdempotencyMiddleware(Handler(), store=MemoryStore())
    reply = await request(mw, key='""')
    assert reply.status == 400 and "1 to 255" in json.loads(reply.body)["detail"]


def test_only_a_leading_quote_asks_for_the_parse() -> None:
    """A bare key is taken as sent, quotes inside and all; only the first byte decides."""
    assert string_key(b'"a\\"b"') == b'a"b'
    assert string_key(b'a"b') is None  # never parsed by the middleware: it is a bare key


async def test_quoted_keys_through_uvicorn_on_redis(redis_server: Server) -> None:
    client = redis_server.client()
    await client.flushall()
    port = free_port()
    worker = start_uvicorn(port, {"REDIS_URL": redis_server.url})
    url = f"http://127.0.0.1:{port}/task/quoted"
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            first = await http.post(url, headers={"Idempotency-Key": '"order-7"'})
            bare = await http.post(url, headers={"Idempotency-Key": "order-7"})
            params = await http.post(url, headers={"Idempotency-Key": '"order-7";v=2'})
            bad = await http.post(url, headers={"Idempotency-Key": '"order-7'})
        assert first.status_code == 201 and first.json()["run"] == 1
        for replay in (bare, params):
            assert replay.content == first.content  # the one run's nonce, byte for byte
            assert replay.headers["idempotent-replayed"] == "true"
        assert bad.status_code == 400 and bad.json()["type"] == INVALID
        assert await client.get("runs:quoted") == b"1"
    finally:
        stop(worker)
        await client.aclose()


def test_a_log_line_shows_a_name_by_its_key_hash_and_inspect_finds_it_back() -> None:
    plain = key_names(b"idem", b"", b"order-1")
    assert shown(plain.claim) == shown(plain.result) == plain.hash
    braced = next(
        n
        for n in (key_names(b"idem", b"", f"k{i}".encode()) for i in range(10_000))
        if b"}" in bytes.fromhex(n.hash)
    )
    assert shown(braced.claim) != braced.hash  # the } byte shows as 7e, as the name holds it
    found = names_of(b"idem", shown(braced.claim))
    assert (found.claim, found.result) == (braced.claim, braced.result)
    assert shown(b"lock:\nreport") == "lock:\\nreport"  # any other name: escaped, one line
