"""Every way an ASGI response can end: a final body message, http.response.pathsend (under
granian, which offers it to Starlette's FileResponse), http.response.zerocopysend, and the
final http.response.trailers of a response that declared trailers."""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore
from goblin_idem._keys import key_names
from goblin_idem.exceptions import RecordError
from goblin_idem.records._format import Record, decode, encode
from tests.support.asgi import Reply, request
from tests.support.procs import APPS, start_granian, stop
from tests.support.servers import Server, free_port

NOT_REPLAYABLE = "urn:goblin-idem:problem:not-replayable"
LIMIT = 64 * 1024  # the served app's max_response_bytes


# -- under a real server that offers pathsend -----------------------------------------------


@dataclass
class Served:
    url: str
    files: Path
    redis: Any

    async def runs(self, name: str) -> int:
        return int(await self.redis.get("runs:" + name) or 0)

    def write(self, name: str, data: bytes) -> None:
        (self.files / name).write_bytes(data)


@pytest.fixture(scope="module")
def files() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="goblin-files-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def granian_port(redis_server: Server, files: Path) -> Iterator[int]:
    port = free_port()
    env = {"REDIS_URL": redis_server.url, "FILE_DIR": str(files), "MAX_RESPONSE_BYTES": str(LIMIT)}
    proc = start_granian(port, env, f"{APPS}.file_app:app")
    yield port
    stop(proc)


@pytest.fixture
async def served(redis_server: Server, files: Path, granian_port: int) -> AsyncIterator[Served]:
    client = redis_server.client()
    await client.flushall()
    yield Served(f"http://127.0.0.1:{granian_port}", files, client)
    await client.aclose()


async def post(url: str, key: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(url, headers={"Idempotency-Key": key})


def without(headers: httpx.Headers, *names: str) -> list[tuple[str, str]]:
    return [(n, v) for n, v in headers.multi_items() if n not in names]


async def test_a_file_sent_with_pathsend_is_stored_and_replayed_byte_for_byte(
    served: Served,
) -> None:
    data = secrets.token_bytes(40_000)
    served.write("report.bin", data)
    first = await post(f"{served.url}/file/report.bin", "report-1")
    again = await post(f"{served.url}/file/report.bin", "report-1")
    assert first.status_code == again.status_code == 200
    assert first.headers["x-pathsend"] == "offered"  # the server did offer the extension
    assert first.content == again.content == data
    assert again.headers["idempotent-replayed"] == "true"
    volatile = ("date", "server", "idempotent-replayed")
    assert without(again.headers, *volatile) == without(first.headers, *volatile)
    assert await served.runs("report.bin") == 1


async def test_the_replay_is_what_the_first_client_got_even_if_the_file_changed(
    served: Served,
) -> None:
    served.write("export.csv", b"id,amount\n1,100\n")
    first = await post(f"{served.url}/file/export.csv", "export-1")
    served.write("export.csv", b"id,amount\n1,999\n")
    again = await post(f"{served.url}/file/export.csv", "export-1")
    assert first.content == again.content == b"id,amount\n1,100\n"
    assert await served.runs("export.csv") == 1


async def test_a_file_larger_than_max_response_bytes_is_sent_but_not_replayed(
    served: Served,
) -> None:
    data = secrets.token_bytes(LIMIT + 1)
    served.write("big.bin", data)
    first = await post(f"{served.url}/file/big.bin", "big-1")
    again = await post(f"{served.url}/file/big.bin", "big-1")
    assert first.status_code == 200 and first.content == data  # sent whole, by the server
    assert again.status_code == 409 and again.json()["type"] == NOT_REPLAYABLE
    assert await served.runs("big.bin") == 1


# -- at the ASGI level ----------------------------------------------------------------------


class App:
    """Sends the scripted messages after reading the request body; counts its runs."""

    def __init__(self, *messages: Message) -> None:
        self.messages = messages
        self.runs = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs += 1
        await receive()
        for message in self.messages:
            await send(dict(message))


def kinds(reply: Reply) -> list[str]:
    return [m["type"].removeprefix("http.response.") for m in reply.messages]


async def test_pathsend_reaches_the_client_as_the_bytes_stored(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"\x00file\xff" * 100)
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"600")]}
    app = App(start, {"type": "http.response.pathsend", "path": str(path)})
    mw = IdempotencyMiddleware(app, store=MemoryStore())
    ext = {"http.response.pathsend": {}}
    first = await request(mw, key="k", extensions=ext)
    again = await request(mw, key="k", extensions=ext)
    assert kinds(first) == kinds(again) == ["start", "body"]
    assert first.body == again.body == path.read_bytes()
    assert again.without("idempotent-replayed") == first.headers
    assert app.runs == 1 and mw.counters.released == 0


async def test_pathsend_of_a_file_too_large_goes_as_it_came(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 101)
    app = App(
        {"type": "http.response.start", "status": 200, "headers": []},
        {"type": "http.response.pathsend", "path": str(path)},
    )
    mw = IdempotencyMiddleware(app, store=MemoryStore(), max_response_bytes=100)
    first = await request(mw, key="k")
    again = await request(mw, key="k")
    assert first.messages[-1] == {"type": "http.response.pathsend", "path": str(path)}
    assert again.status == 409 and json.loads(again.body)["type"] == NOT_REPLAYABLE
    assert app.runs == 1 and mw.counters.too_large == 1


async def test_pathsend_of_a_file_that_cannot_be_read_releases_the_key(tmp_path: Path) -> None:
    missing = str(tmp_path / "gone.bin")
    app = App(
        {"type": "http.response.start", "status": 200, "headers": []},
        {"type": "http.response.pathsend", "path": missing},
    )
    store = MemoryStore()
    mw = IdempotencyMiddleware(app, store=store)
    first = await request(mw, key="k")
    assert first.messages[-1] == {"type": "http.response.pathsend", "path": missing}
    assert mw.counters.released == 1
    assert await store.get(key_names(b"idem", b"", b"k").claim) is None
    await request(mw, key="k")
    assert app.runs == 2  # nothing was stored: the retry runs


@pytest.fixture
def zfile(tmp_path: Path) -> Iterator[BinaryIO]:
    path = tmp_path / "z.bin"
    path.write_bytes(b"0123456789abcdef")
    with open(path, "rb") as f:
        yield f


async def test_zerocopysend_from_the_file_position_and_from_an_offset(zfile: BinaryIO) -> None:
    zfile.seek(2)
    app = App(
        {"type": "http.response.start", "status": 200, "headers": []},
        {"type": "http.response.zerocopysend", "file": zfile, "count": 4, "more_body": True},
        {"type": "http.response.zerocopysend", "file": zfile, "count": 3, "more_body": True},
        {"type": "http.response.zerocopysend", "file": zfile.fileno(), "offset": 14},
    )
    mw = IdempotencyMiddleware(app, store=MemoryStore())
    first = await request(mw, key="k")
    assert zfile.tell() == 9  # moved past what the first two sent, as sendfile would
    again = await request(mw, key="k")
    assert first.chunks == [b"2345", b"678", b"ef"]
    assert kinds(first) == ["start", "body", "body", "body"]
    assert again.body == b"2345678ef" and app.runs == 1


async def test_trailers_end_the_response_and_are_replayed() -> None:
    headers = [(b"content-type", b"text/plain"), (b"trailer", b"x-checksum, x-status")]
    app = App(
        {"type": "http.response.debug", "info": {"template": "none"}},  # not an end
        {"type": "http.response.start", "status": 200, "headers": headers, "trailers": True},
        {"type": "http.response.body", "body": b"part 1,", "more_body": True},
        {"type": "http.response.body", "body": b"part 2", "more_body": False},  # not the end
        {
            "type": "http.response.trailers",
            "headers": [(b"x-checksum", b"abc")],
            "more_trailers": True,
        },
        {
            "type": "http.response.trailers",
            "headers": [(b"x-status", b"ok")],
            "more_trailers": False,
        },
    )
    store = MemoryStore()
    names = key_names(b"idem", b"", b"k")
    published_before_the_last_trailers: list[bool] = []
    mw = IdempotencyMiddleware(app, store=store)

    async def watch(scope: Scope, receive: Receive, send: Send) -> None:
        async def watched(message: Message) -> None:
            if message["type"] == "http.response.trailers" and not message["more_trailers"]:
                published_before_the_last_trailers.append(await store.get(names.result) is not None)
            await send(message)

        await mw(scope, receive, watched)

    ext = {"http.response.trailers": {}}
    first = await request(watch, key="k", extensions=ext)
    again = await request(mw, key="k", extensions=ext)
    assert published_before_the_last_trailers == [True]
    assert kinds(again) == ["start", "body", "trailers"]
    assert again.messages[0]["trailers"] is True
    assert again.without("idempotent-replayed") == headers  # Trailer kept, no Content-Length
    assert again.body == first.body == b"part 1,part 2"
    assert again.messages[-1] == {
        "type": "http.response.trailers",
        "headers": [(b"x-checksum", b"abc"), (b"x-status", b"ok")],
        "more_trailers": False,
    }
    assert app.runs == 1


def test_only_a_response_with_trailers_gets_the_new_record_version() -> None:
    """Records without trailers keep the layout earlier releases read; one with trailers is
    version 2, which an earlier release refuses (503) instead of replaying it without them."""
    plain = Record(201, [(b"content-type", b"text/plain")], b"body", b"f" * 16)
    with_trailers = replace(plain, trailers=[(b"x-checksum", b"abc"), (b"x-empty", b"")])
    assert encode(plain)[2] == 1 and encode(with_trailers)[2] == 2
    assert decode(encode(plain)) == plain
    assert decode(encode(with_trailers)) == with_trailers
    assert decode(encode(replace(plain, trailers=[]))).trailers == []
    with pytest.raises(RecordError):
        decode(encode(with_trailers)[:-6])  # cut inside the trailers


async def test_a_replay_from_the_cache_is_unchanged_by_a_layer_that_edits_messages(
    redis_server: Server,
) -> None:
    """With the replay cache, a record is decoded once and kept (`records._format.Decoded`):
    a layer outside the middleware that edits the messages it is sent, in place, must not
    change what the next replay of the key sends."""
    headers = [(b"content-type", b"text/plain"), (b"trailer", b"x-status")]
    app = App(
        {"type": "http.response.start", "status": 200, "headers": headers, "trailers": True},
        {"type": "http.response.body", "body": b"done", "more_body": False},
        {
            "type": "http.response.trailers",
            "headers": [(b"x-status", b"ok")],
            "more_trailers": False,
        },
    )
    store = RedisStore.from_url(redis_server.url, replay_cache_bytes=1 << 20)
    mw = IdempotencyMiddleware(app, store=store)

    async def editing(scope: Scope, receive: Receive, send: Send) -> None:
        async def edit(message: Message) -> None:
            if "headers" in message:
                message["headers"].append((b"x-edited", b"1"))
            await send(message)

        await mw(scope, receive, edit)

    ext = {"http.response.trailers": {}}
    key = secrets.token_hex(8)
    try:
        await request(mw, key=key, extensions=ext)
        replays = [await request(editing, key=key, extensions=ext) for _ in range(2)]
        plain = await request(mw, key=key, extensions=ext)
        assert mw.answers.decoded is not None and mw.answers.decoded.entries  # kept decoded
        assert mw.counters.replayed == 3 and app.runs == 1
        assert replays[0].messages == replays[1].messages  # the edits did not accumulate
        assert plain.without("idempotent-replayed") == headers
        assert plain.messages[-1]["headers"] == [(b"x-status", b"ok")]
        assert (await request(mw, key=key, body=b"other", extensions=ext)).status == 422
    finally:
        await store.aclose()
