"""A server at maxmemory: detection warns of a policy that evicts goblin-idem's keys (or says
it could not check), and under noeviction a full server still answers every duplicate of a
completed key from its stored result; only new keys get 503."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from tests.support.inproc import CountingApp, send_once
from tests.support.servers import Server, start_server

KINDS = ["redis", "valkey"]


@pytest.fixture
def server_kind(
    request: pytest.FixtureRequest, modules_for: Callable[[str], list[str]]
) -> Iterator[tuple[str, str, Server]]:
    """A server of its own per test (its memory settings change), the module loaded for
    native mode."""
    kind, mode = request.param
    server = start_server(kind, modules=modules_for(mode))
    yield kind, mode, server
    server.stop()


def store_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "goblin_idem.store"]


@pytest.mark.parametrize(
    "server_kind",
    [(k, m) for k in KINDS for m in ("script", "native")],
    indirect=True,
    ids=lambda p: "-".join(p),
)
@pytest.mark.parametrize("autopipeline", [True, False], ids=["shared", "direct"])
async def test_a_full_server_still_answers_duplicates_of_completed_keys(
    server_kind: tuple[str, str, Server], autopipeline: bool
) -> None:
    _, mode, server = server_kind
    store = RedisStore.from_url(server.url, autopipeline=autopipeline)
    handler = CountingApp()
    mw = IdempotencyMiddleware(handler, store=store)
    try:
        assert await store.detect() == mode
        done = await send_once(mw, "done")
        assert done.status == 201
        busy = key_names(b"idem", b"", b"busy")
        assert await store.claim(busy.claim, busy.result, b"1:busy", 30) is not None
        await store.client.config_set("maxmemory", 1)  # full: every write is refused (OOM)
        try:
            replay = await send_once(mw, "done")
            assert (replay.status, replay.replayed, replay.body) == (201, True, done.body)
            reused = await send_once(mw, "done", body=b'{"other": 1}')
            assert (reused.status, reused.slug) == (422, "key-reused")
            in_flight = await send_once(mw, "busy")
            assert (in_flight.status, in_flight.slug) == (409, "in-flight")
            new = await send_once(mw, "new")
            assert (new.status, new.slug) == (503, "store-unavailable")
        finally:
            await store.client.config_set("maxmemory", 0)
        assert {k: len(v) for k, v in handler.runs.items()} == {"done": 1}
        assert (await send_once(mw, "new")).status == 201  # room again: the new key runs
    finally:
        await store.aclose()


async def detection_lines(
    kind: str, args: list[str], caplog: pytest.LogCaptureFixture
) -> tuple[list[str], Server]:
    """What detection logs at WARNING on a server of its own started with `args`."""
    server = start_server(kind, args=args)
    store = RedisStore.from_url(server.url)
    try:
        with caplog.at_level(logging.WARNING, logger="goblin_idem.store"):
            await store.detect()
        return store_lines(caplog), server
    finally:
        await store.aclose()
        server.stop()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "allkeys-random"])
async def test_detection_warns_of_a_policy_that_evicts(
    kind: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    args = ["--maxmemory", "64mb", "--maxmemory-policy", policy]
    (line,), server = await detection_lines(kind, args, caplog)
    assert f"127.0.0.1:{server.port} evicts keys when memory is full" in line
    assert f"(maxmemory-policy {policy}, maxmemory {64 * 1024 * 1024})" in line
    assert "runs the work again" in line and "Set maxmemory-policy noeviction" in line
    assert ("every goblin-idem key has one" in line) == policy.startswith("volatile-")


async def test_the_first_request_checks_the_policy(
    redis_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Without detect(), the first command detects: once, with the warning."""
    with redis_server.sync_client() as r:
        r.config_set("maxmemory-policy", "volatile-lru")
    store = RedisStore.from_url(redis_server.url, mode="script")
    mw = IdempotencyMiddleware(CountingApp(), store=store)
    try:
        with caplog.at_level(logging.WARNING, logger="goblin_idem.store"):
            assert (await send_once(mw, "first")).status == 201
            assert (await send_once(mw, "second")).status == 201
        (line,) = store_lines(caplog)
        assert "(maxmemory-policy volatile-lru, maxmemory 0)" in line
        assert "maxmemory is 0 (no limit)" in line
    finally:
        with redis_server.sync_client() as r:
            r.config_set("maxmemory-policy", "noeviction")
        await store.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_noeviction_is_not_warned_of(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    args = ["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]
    assert (await detection_lines(kind, args, caplog))[0] == []


@pytest.mark.parametrize("kind", KINDS)
async def test_without_config_the_policy_is_read_from_info(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Managed services rename CONFIG away; INFO memory still tells the policy."""
    args = ["--rename-command", "CONFIG", "", "--maxmemory-policy", "allkeys-lfu"]
    (line,), _ = await detection_lines(kind, args, caplog)
    assert "evicts keys when memory is full (maxmemory-policy allkeys-lfu, maxmemory 0)" in line


@pytest.mark.parametrize("kind", KINDS)
async def test_a_policy_that_cannot_be_read_is_said_so(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """CONFIG and INFO renamed away, or refused by the user's ACL."""
    renamed = start_server(
        kind, args=["--rename-command", "CONFIG", "", "--rename-command", "INFO", ""]
    )
    refused = start_server(kind)
    with refused.sync_client() as r:
        r.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "-config", "-info")
    stores = [
        RedisStore.from_url(renamed.url),
        RedisStore.from_url(refused.url, username="app", password="pw"),
    ]
    try:
        with caplog.at_level(logging.WARNING, logger="goblin_idem.store"):
            for store in stores:
                await store.detect()
        lines = store_lines(caplog)
        assert len(lines) == 2
        for line, server in zip(lines, (renamed, refused), strict=True):
            assert line.startswith(
                f"goblin-idem store: could not read the eviction policy of "
                f"127.0.0.1:{server.port} (CONFIG GET: "
            )
            assert "make sure its maxmemory-policy is noeviction" in line
        assert "unknown command 'CONFIG'" in lines[0] and "unknown command 'INFO'" in lines[0]
        assert "no permissions to run the 'config|get' command" in lines[1]
        assert "no permissions to run the 'info' command" in lines[1]
    finally:
        for store in stores:
            await store.aclose()
        renamed.stop()
        refused.stop()
