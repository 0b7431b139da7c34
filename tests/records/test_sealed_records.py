"""Stored responses sealed at rest, compressed, and read across record versions, on real
redis-server and valkey-server (script and native mode)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import struct
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from goblin_idem.exceptions import RecordError
from goblin_idem.records._compression import compressor as make_codec
from goblin_idem.records._format import Record, decode, encode, fingerprint, format_of
from goblin_idem.sealing import Sealer, SealError, key_id, keys_from_env
from tests.support.asgi import request
from tests.support.backends import server_for

SECRET = b'{"card":"4242424242424242","token":"tok_live_5ecret"}'
COOKIE = b"session=s3cr3t-cookie-value"
K1, K2, K3 = os.urandom(32), os.urandom(32), os.urandom(32)
PROBLEM_TYPE = "urn:goblin-idem:problem:record-unreadable"


@dataclass
class App:
    """Answers 201 with `body` (SECRET by default) and a Set-Cookie; counts its runs."""

    body: bytes = SECRET
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    runs: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        self.runs += 1
        headers = [
            (b"content-type", b"application/json"),
            (b"set-cookie", COOKIE),
            (b"content-length", b"%d" % len(self.body)),
        ]
        await send(
            {"type": "http.response.start", "status": 201, "headers": headers + self.headers}
        )
        await send({"type": "http.response.body", "body": self.body})


@pytest.fixture(params=["redis-script", "redis-native", "valkey-script", "valkey-native"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    server = server_for(request, request.param)
    store = RedisStore.from_url(server.url, mode=request.param.split("-")[1])
    await store.client.flushall()  # type: ignore[union-attr]
    yield store
    await store.aclose()


def client(store: RedisStore) -> redis.asyncio.Redis:
    c = store.client
    assert isinstance(c, redis.asyncio.Redis)
    return c


def sealed(
    app: App, store: RedisStore, keys: list[bytes] | None, **kw: object
) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(app, store=store, encryption_keys=keys, **kw)  # type: ignore[arg-type]


def unreadable(reply_body: bytes) -> bool:
    return bool(json.loads(reply_body)["type"] == PROBLEM_TYPE)


# -- encryption at rest ------------------------------------------------------------------


async def test_stored_bytes_hold_neither_body_nor_headers(store: RedisStore) -> None:
    app = App()
    mw = sealed(app, store, [K1])
    first = await request(mw, key="k-enc")
    again = await request(mw, key="k-enc")
    assert first.status == again.status == 201 and again.body == SECRET and app.runs == 1
    assert again.header("set-cookie") == COOKIE
    raw = [await client(store).get(k) async for k in client(store).scan_iter()]
    assert len(raw) == 2  # the claim and the result
    for value in raw:
        assert value is not None
        for secret in (SECRET, b"4242424242424242", b"tok_live_5ecret", b"s3cr3t-cookie", b"json"):
            assert secret not in value
    result = await client(store).get(key_names(b"idem", b"", b"k-enc").result)
    assert result is not None and format_of(result).key_id == key_id(K1)


async def test_a_record_moved_to_another_key_does_not_replay(
    store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Two keys, the same request: B's result overwritten with A's sealed record (whose
    fingerprint matches B's request) is refused, 503, and B is not run again; a record
    altered by one bit likewise."""
    app = App()
    mw = sealed(app, store, [K1], fail_open=True)
    assert (await request(mw, key="k-a")).status == 201
    assert (await request(mw, key="k-b")).status == 201
    a, b = key_names(b"idem", b"", b"k-a"), key_names(b"idem", b"", b"k-b")
    rec_a = await client(store).get(a.result)
    assert rec_a is not None
    await client(store).set(b.result, rec_a, keepttl=True)
    caplog.set_level(logging.ERROR, "goblin_idem.middleware")
    moved = await request(mw, key="k-b")
    assert moved.status == 503 and unreadable(moved.body)
    assert moved.header("retry-after") == b"1"
    assert app.runs == 2 and mw.counters.unreadable == 1
    assert any(
        b.hash in r.getMessage() and "does not open" in r.getMessage() for r in caplog.records
    )

    flipped = bytearray(rec_a)
    flipped[len(flipped) // 2] ^= 0x01
    await client(store).set(a.result, bytes(flipped), keepttl=True)
    altered = await request(mw, key="k-a")
    assert altered.status == 503 and unreadable(altered.body) and app.runs == 2


async def test_rotation_replays_old_records_and_a_store_without_the_key_answers_503(
    store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    app = App()
    old = sealed(app, store, [K1])
    assert (await request(old, key="k-old")).status == 201
    rotated = sealed(app, store, [K2, K1])
    replay = await request(rotated, key="k-old")
    assert replay.status == 201 and replay.body == SECRET and app.runs == 1
    assert replay.header("idempotent-replayed") == b"true"
    assert (await request(rotated, key="k-new")).status == 201
    new = await client(store).get(key_names(b"idem", b"", b"k-new").result)
    assert new is not None and format_of(new).key_id == key_id(K2)  # the first key seals

    caplog.set_level(logging.ERROR, "goblin_idem.middleware")
    for mw in (sealed(app, store, [K3]), sealed(app, store, [], fail_open=True)):
        refused = await request(mw, key="k-old")
        assert refused.status == 503 and unreadable(refused.body)
        assert SECRET not in refused.body
    assert app.runs == 2  # k-old once, k-new once: nothing ran for the 503s
    names = key_names(b"idem", b"", b"k-old")
    messages = [r.getMessage() for r in caplog.records if names.hash in r.getMessage()]
    assert any(f"key id {key_id(K1).hex()}" in m and "not among" in m for m in messages)
    assert any("no encryption keys are configured" in m for m in messages)


async def test_plain_records_stay_readable_once_encryption_is_on(store: RedisStore) -> None:
    app = App()
    assert (await request(IdempotencyMiddleware(app, store=store), key="k-p")).status == 201
    replay = await request(sealed(app, store, [K1]), key="k-p")
    assert replay.status == 201 and replay.body == SECRET and app.runs == 1


async def test_require_sealed_answers_a_record_in_the_clear_503_and_runs_nothing(
    store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Records in the clear under every format (a process without keys, or anyone who can
    write to the store): replayed with keys alone, 503 with require_sealed, never run."""
    app = App()
    plain = IdempotencyMiddleware(app, store=store)
    assert (await request(plain, key="k-plain", body=FP_BODY)).status == 201
    fp = fingerprint("POST", "/", b"", FP_BODY)
    await put(store, "k-forged-v1", shipped_v1(fp, b'{"paid":true}'))
    await put(store, "k-forged-v2", shipped_v2(fp, b'{"paid":true}'))
    rec = Record(201, [], b'{"paid":true}' * 100, fp)
    await put(store, "k-forged-v3", encode(rec, codec=make_codec("zlib"), compress_above=0))
    assert (await request(sealed(app, store, [K1]), key="k-sealed")).status == 201
    forged = ["k-forged-v1", "k-forged-v2", "k-forged-v3"]
    replays = sealed(app, store, [K1])
    for key in forged:  # what require_sealed is for: these replay as the store says
        assert (await request(replays, key=key, body=FP_BODY)).status in (200, 201)

    caplog.set_level(logging.ERROR, "goblin_idem.middleware")
    mw = sealed(app, store, [K1], require_sealed=True, fail_open=True)
    for key in ["k-plain", *forged]:
        refused = await request(mw, key=key, body=FP_BODY)
        assert refused.status == 503 and unreadable(refused.body), key
        assert refused.header("retry-after") == b"1"
    assert (await request(mw, key="k-sealed")).header("idempotent-replayed") == b"true"
    assert app.runs == 2 and mw.counters.unreadable == 4 and mw.counters.replayed == 1
    assert any(
        key_names(b"idem", b"", b"k-forged-v3").hash in r.getMessage()
        and "written in the clear (format version 3)" in r.getMessage()
        and "require_sealed=True" in r.getMessage()
        for r in caplog.records
    )


def test_require_sealed_without_keys_says_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOBLIN_IDEM_ENCRYPTION_KEYS", raising=False)
    for keys in ([], None):
        with pytest.raises(ValueError, match=r"pass encryption_keys=\[key, \.\.\.\] or set \$GO"):
            IdempotencyMiddleware(App(), encryption_keys=keys, require_sealed=True)
    with pytest.raises(TypeError, match="require_sealed must be True or False"):
        IdempotencyMiddleware(App(), encryption_keys=[K1], require_sealed="yes")  # type: ignore[arg-type]
    assert IdempotencyMiddleware(App(), encryption_keys=[K1], require_sealed=True).require_sealed


def test_sealer_outside_the_middleware() -> None:
    ring = Sealer([K2, K1])
    blob = ring.seal(b"value", b"where")
    assert blob[:4] == key_id(K2) and b"value" not in blob
    assert Sealer([K1, K2]).open(blob, b"where") == b"value"
    assert ring.seal(b"value", b"where") != blob  # a fresh salt each time
    with pytest.raises(SealError, match="does not open"):
        ring.open(blob, b"elsewhere")
    with pytest.raises(SealError, match="not among"):
        Sealer([K3]).open(blob, b"where")
    with pytest.raises(SealError, match="truncated"):
        ring.open(blob[:20], b"where")
    assert K1.hex() not in repr(ring) and key_id(K1).hex() in repr(ring)


def test_key_configuration_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"must be 32 bytes, not 16: make one with os\.urandom"):
        Sealer([os.urandom(16)])
    with pytest.raises(TypeError, match=r"\[current, \*older\]"):
        Sealer(K1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="listed twice"):
        Sealer([K1, K1])
    with pytest.raises(ValueError, match="encryption_keys: encryption key 0 must be 32 bytes"):
        IdempotencyMiddleware(App(), encryption_keys=[b"short"])


def test_keys_from_the_environment() -> None:
    import base64

    good = ",".join(base64.b64encode(k).decode() for k in (K2, K1))
    assert keys_from_env(environ={"GOBLIN_IDEM_ENCRYPTION_KEYS": good}) == [K2, K1]
    urlsafe = base64.urlsafe_b64encode(K1).decode()
    assert keys_from_env(environ={"GOBLIN_IDEM_ENCRYPTION_KEYS": f" {urlsafe} "}) == [K1]
    assert keys_from_env(environ={}) is None
    secret = base64.b64encode(K1[:20]).decode()
    with pytest.raises(ValueError, match="key 1 is 20 bytes, not 32") as info:
        keys_from_env(environ={"GOBLIN_IDEM_ENCRYPTION_KEYS": f"{good.split(',')[0]},{secret}"})
    assert secret not in str(info.value)
    with pytest.raises(ValueError, match="key 0 is not base64"):
        keys_from_env(environ={"GOBLIN_IDEM_ENCRYPTION_KEYS": "not*base64"})


async def test_the_middleware_reads_its_keys_from_the_environment(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64

    monkeypatch.setenv("GOBLIN_IDEM_ENCRYPTION_KEYS", base64.b64encode(K3).decode())
    app = App()
    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k-env")).status == 201
    stored = await client(store).get(key_names(b"idem", b"", b"k-env").result)
    assert stored is not None and format_of(stored).key_id == key_id(K3)
    assert SECRET not in stored


# -- compression ---------------------------------------------------------------------------

SIZES = [0, 1, 1023, 1024, 1025, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024]


@pytest.mark.parametrize("codec", ["zlib", "zstd"])
def test_compression_round_trips_byte_exactly(codec: str) -> None:
    from goblin_idem.records._compression import compressor as make

    rng = random.Random(16)
    c = make(codec)
    for size in SIZES:
        for body in (rng.randbytes(size), (b'{"n":%d}' % size * (size // 8 + 1))[:size]):
            rec = Record(201, [(b"content-encoding", b"gzip")], body, bytes(16))
            for sealer in (None, Sealer([K1])):
                data = encode(rec, sealer=sealer, name=b"n", codec=c, compress_above=1024)
                assert decode(data, sealer=sealer, name=b"n") == rec
                compressible = size > 1024 and body[:1] == b"{"
                assert (len(data) < size // 2) if compressible else len(data) >= size


async def test_replays_are_byte_exact_from_0_bytes_to_8_mib(store: RedisStore) -> None:
    """Through the middleware, sealed and not, zlib and zstd: each size of compressible JSON,
    random bytes and a gzip-encoded body replays exactly, whatever the duplicate's
    Accept-Encoding; a compressible body above 1 KiB is stored in far fewer bytes."""
    rng = random.Random(8)
    for keys, codec in (([], "zlib"), ([K1], "zlib"), ([K1], "zstd")):
        app = App()
        mw = sealed(app, store, keys, max_response_bytes=9 * 1024 * 1024, compression=codec)
        for size in SIZES:
            text = (b'{"id":%d,"status":"paid"},' % size * (size // 24 + 1))[:size]
            gz = zlib.compress(text)
            for label, body, extra in (
                ("json", text, []),
                ("random", rng.randbytes(size), []),
                ("gzip", gz, [(b"content-encoding", b"gzip")]),
            ):
                app.body, app.headers = body, extra
                key = f"k-{len(keys)}-{codec}-{label}-{size}"
                first = await request(mw, key=key)
                dup = await request(mw, key=key, headers=[("Accept-Encoding", "identity")])
                assert first.status == dup.status == 201 and dup.body == first.body == body
                assert dup.without("idempotent-replayed") == first.headers
                stored = await client(store).get(key_names(b"idem", b"", key.encode()).result)
                assert stored is not None
                if label == "json" and size > 1024:
                    assert len(stored) < size // 4
        assert app.runs == 3 * len(SIZES)


# -- versions --------------------------------------------------------------------------------

FP_BODY = b"{}"


def shipped_v1(fp: bytes, body: bytes) -> bytes:
    """A record as release 0.1.0 wrote it (version 1), built from its spec, not its code."""
    headers = [(b"content-type", b"application/json"), (b"x-v", b"1")]
    out = struct.pack(">2sBBH16sH", b"GI", 1, 0, 201, fp, len(headers))
    for n, v in headers:
        out += struct.pack(">H", len(n)) + n + struct.pack(">I", len(v)) + v
    return out + body


def shipped_v2(fp: bytes, body: bytes) -> bytes:
    """Version 2: a response that declared trailers (written since trailers were stored)."""
    out = struct.pack(">2sBBH16sH", b"GI", 2, 0, 200, fp, 1)
    out += struct.pack(">H", 4) + b"x-v2" + struct.pack(">I", 1) + b"2"
    out += struct.pack(">H", 1) + struct.pack(">H", 8) + b"x-digest" + struct.pack(">I", 3) + b"abc"
    return out + body


async def put(store: RedisStore, key: str, data: bytes) -> None:
    names = key_names(b"idem", b"", key.encode())
    await client(store).set(names.claim, b"old-token", px=60_000)
    await client(store).set(names.result, data, px=60_000)


async def test_records_of_every_shipped_format_replay(store: RedisStore) -> None:
    fp = fingerprint("POST", "/", b"", FP_BODY)
    await put(store, "k-v1", shipped_v1(fp, b"body one"))
    await put(store, "k-v2", shipped_v2(fp, b"body two"))
    app = App()
    for keys in ([], [K1]):
        mw = sealed(app, store, keys)
        one = await request(mw, key="k-v1", body=FP_BODY)
        assert one.status == 201 and one.body == b"body one"
        assert one.headers[:2] == [(b"content-type", b"application/json"), (b"x-v", b"1")]
        two = await request(mw, key="k-v2", body=FP_BODY, extensions={"http.response.trailers": {}})
        assert two.status == 200 and two.body == b"body two"
        trailers = [m for m in two.messages if m["type"] == "http.response.trailers"]
        assert trailers[0]["headers"] == [(b"x-digest", b"abc")]
    assert app.runs == 0


def test_plain_records_are_still_written_as_earlier_releases_read_them() -> None:
    fp = bytes(range(16))
    rec = Record(201, [(b"content-type", b"application/json"), (b"x-v", b"1")], b"body", fp)
    assert encode(rec) == shipped_v1(fp, b"body")
    assert encode(rec, codec=None) == shipped_v1(fp, b"body")
    rec2 = Record(200, [(b"x-v2", b"2")], b"b", fp, trailers=[(b"x-digest", b"abc")])
    assert encode(rec2) == shipped_v2(fp, b"b")


@pytest.mark.parametrize(
    "data",
    [
        b"GI\x04\x00" + bytes(60),  # a newer format
        b"GI\x03\x07" + bytes(60),  # an envelope this version does not know
        b"GI\x03\x00" + struct.pack(">BH16sBH", 0, 201, bytes(16), 9, 0) + bytes(8),  # codec
        b"GI\x01",  # truncated
        b"<html>",
    ],
)
async def test_a_future_or_broken_record_is_answered_503_and_never_run(
    store: RedisStore, data: bytes
) -> None:
    with pytest.raises(RecordError):
        decode(data)
    await put(store, "k-future", data)
    app = App()
    mw = sealed(app, store, [K1], fail_open=True)
    reply = await request(mw, key="k-future", body=FP_BODY)
    assert reply.status == 503 and unreadable(reply.body) and app.runs == 0
    assert mw.counters.unreadable == 1 and mw.counters.store_errors == 0


async def test_without_encryption_a_moved_record_would_replay(store: RedisStore) -> None:
    """The control for the test above: what the seal prevents does happen in the clear."""
    app = App()
    mw = IdempotencyMiddleware(app, store=store)
    assert (await request(mw, key="k-c")).status == 201
    c, d = key_names(b"idem", b"", b"k-c"), key_names(b"idem", b"", b"k-d")
    await client(store).set(d.claim, b"x", px=60_000)
    await client(store).set(d.result, await client(store).get(c.result) or b"", px=60_000)
    moved = await request(mw, key="k-d")
    assert moved.status == 201 and moved.body == SECRET and app.runs == 1


# -- inspect and key names -------------------------------------------------------------------


async def test_inspect_shows_format_key_id_and_whether_it_opens(store: RedisStore) -> None:
    from goblin_idem.inspection import COMPLETED, UNREADABLE, format_state, inspect_key

    mw = sealed(App(), store, [K1])
    assert (await request(mw, key="k-i")).status == 201
    shut = await inspect_key(store, "k-i")
    assert shut.state == UNREADABLE and shut.opens is False and shut.record is None
    assert shut.format is not None and shut.format.key_id == key_id(K1)
    assert "$GOBLIN_IDEM_ENCRYPTION_KEYS" in (shut.note or "")
    wrong = await inspect_key(store, "k-i", sealer=Sealer([K2]))
    assert wrong.state == UNREADABLE and wrong.opens is False
    assert re.search(r"\nopens +no, with the configured keys", format_state(wrong))
    opened = await inspect_key(store, "k-i", sealer=Sealer([K2, K1]))
    text = format_state(opened)
    assert opened.state == COMPLETED and opened.opens is True
    assert re.search(r"\nformat +version 3, sealed\n", text)
    assert re.search(rf"\nkey id +{key_id(K1).hex()}\n", text)
    assert "s3cr3t" not in text and opened.as_dict()["headers"] is None
    revealed = await inspect_key(store, "k-i", sealer=Sealer([K1]), reveal=True)
    assert "s3cr3t" in format_state(revealed)


def test_a_hash_starting_with_a_closing_brace_keeps_both_keys_in_one_slot() -> None:
    from redis.crc import key_slot

    key = next(
        k
        for k in (b"k-%d" % i for i in range(100_000))
        if key_names(b"idem", b"", k).hash[:2] == "7d"
    )
    names = key_names(b"idem", b"", key)
    assert b"{~" in names.claim and len(names.claim) == len(b"idem:{}:c") + 16
    assert key_slot(names.claim) == key_slot(names.result)


# -- upgrading from 0.1.0's key names --------------------------------------------------------


async def put_previous(store: RedisStore, key: str, result: bytes | None) -> None:
    """What 0.1.0 left for `key`: its claim, and its result if given, under the hex names."""
    from goblin_idem._keys import previous_names

    old = previous_names(b"idem", key_names(b"idem", b"", key.encode()).hash)
    assert old.claim == b"idem:{%s}:c" % key_names(b"idem", b"", key.encode()).hash.encode()
    await client(store).set(old.claim, b"4242:00112233aabbccdd", px=60_000)
    if result is not None:
        await client(store).set(old.result, result, px=60_000)


async def test_previous_key_names_answers_from_what_0_1_0_stored(store: RedisStore) -> None:
    fp = fingerprint("POST", "/", b"", FP_BODY)
    await put_previous(store, "k-up", shipped_v1(fp, b"paid once"))
    await put_previous(store, "k-busy", None)
    app = App()
    plain = IdempotencyMiddleware(app, store=store)
    mw = IdempotencyMiddleware(app, store=store, previous_key_names=True)

    first = await request(mw, key="k-up", body=FP_BODY)
    assert first.status == 201 and first.body == b"paid once" and app.runs == 0
    new = key_names(b"idem", b"", b"k-up")
    assert await client(store).get(new.result) == shipped_v1(fp, b"paid once")
    assert 50_000 < await client(store).pttl(new.claim) <= 60_000  # kept as the result
    again = await request(plain, key="k-up", body=FP_BODY)  # by the new names alone
    assert again.body == b"paid once" and app.runs == 0

    busy = await request(mw, key="k-busy", body=FP_BODY)
    assert busy.status == 409 and app.runs == 0
    assert await client(store).exists(key_names(b"idem", b"", b"k-busy").claim) == 0

    assert (await request(mw, key="k-fresh", body=FP_BODY)).status == 201 and app.runs == 1


async def test_without_previous_key_names_0_1_0_keys_run_again(store: RedisStore) -> None:
    """The control: what the transition option is for."""
    fp = fingerprint("POST", "/", b"", FP_BODY)
    await put_previous(store, "k-up", shipped_v1(fp, b"paid once"))
    app = App()
    reply = await request(IdempotencyMiddleware(app, store=store), key="k-up", body=FP_BODY)
    assert reply.status == 201 and reply.body == SECRET and app.runs == 1
