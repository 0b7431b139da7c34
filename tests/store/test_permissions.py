"""An ACL user that may not run what the store sends is a configuration error, not an
outage: detection names each refused command and the rule that allows it, and at request
time the error is logged once per store (every keyed request still gets 503)."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from goblin_idem import IdempotencyMiddleware, RedisStore, StorePermissionError
from tests.support.inproc import CountingApp, send_once
from tests.support.servers import Server

MODES = [(kind, mode) for kind in ("redis", "valkey") for mode in ("script", "native")]


@pytest.fixture(params=MODES, ids=lambda p: "-".join(p))
def server(request: pytest.FixtureRequest) -> Server:
    kind, mode = request.param
    fixture = f"{kind}_native_server" if mode == "native" else f"{kind}_server"
    found: Server = request.getfixturevalue(fixture)
    return found


@pytest.fixture
def acl_user(server: Server) -> Iterator[tuple[str, Server]]:
    """A user name of this test's own; deleted from the shared server afterwards."""
    name = f"app-{secrets.token_hex(4)}"
    yield name, server
    with server.sync_client() as r:
        r.execute_command("ACL", "DELUSER", name)


def set_user(server: Server, name: str, *rules: str) -> None:
    with server.sync_client() as r:
        r.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", *rules)


def store_for(server: Server, name: str, **kwargs: object) -> RedisStore:
    return RedisStore.from_url(server.url, username=name, password="pw", **kwargs)  # type: ignore[arg-type]


def mode_of(server: Server) -> str:
    return "native" if "--loadmodule" in server.args else "script"


async def test_detection_names_each_refused_command_and_the_fix(
    acl_user: tuple[str, Server],
) -> None:
    name, server = acl_user
    refused = ["goblin.claim", "pttl"] if mode_of(server) == "native" else ["evalsha", "pttl"]
    set_user(server, name, "~*", "+@all", *(f"-{c}" for c in refused))
    store = store_for(server, name)
    try:
        with pytest.raises(StorePermissionError) as info:
            await store.detect()
        assert info.value.denied == tuple(refused)
        text = str(info.value)
        assert f"the store's ACL user {name!r} may not run {', '.join(refused)}" in text
        assert f"ACL SETUSER {name} +{refused[0]} +{refused[1]}" in text
        assert store.mode == mode_of(server)  # the rest of detection was done
    finally:
        await store.aclose()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_a_command_the_scripts_call_is_named(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Redis 7.0 does not say which command a script was refused; detection still does."""
    server: Server = request.getfixturevalue(f"{kind}_server")
    name = f"app-{secrets.token_hex(4)}"
    set_user(server, name, "~*", "+@all", "-pexpire")
    store = store_for(server, name)
    try:
        with pytest.raises(StorePermissionError) as info:
            await store.detect()
        assert info.value.denied == ("pexpire",)
    finally:
        await store.aclose()
        with server.sync_client() as r:
            r.execute_command("ACL", "DELUSER", name)


def readme_rule(mode: str) -> list[str]:
    """The ACL rule the Permissions page gives for a mode, as arguments after the user name."""
    page = Path(__file__).parents[2] / "docs" / "operating" / "permissions.md"
    readme = page.read_text()
    marker = "+evalsha" if mode == "script" else "+goblin.claim"
    rules = re.findall(r"^ACL SETUSER app on >secret (.+)$", readme, re.M)
    (rule,) = [r for r in rules if marker in r.split()]
    return str(rule).split()


async def test_the_readme_rule_is_enough(
    acl_user: tuple[str, Server], caplog: pytest.LogCaptureFixture
) -> None:
    name, server = acl_user
    set_user(server, name, *readme_rule(mode_of(server)))
    store = store_for(server, name)
    handler = CountingApp()
    mw = IdempotencyMiddleware(handler, store=store)
    try:
        with caplog.at_level(logging.INFO, logger="goblin_idem"):
            assert await store.detect() == mode_of(server)
            key = f"readme-{secrets.token_hex(4)}"  # a key no other test used
            assert (await send_once(mw, key)).status == 201
            assert (await send_once(mw, key)).replayed
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert not [line for line in lines if "ACL" in line or "permission" in line], lines
    finally:
        await store.aclose()


async def test_at_request_time_a_refused_command_is_logged_once_per_store(
    acl_user: tuple[str, Server], caplog: pytest.LogCaptureFixture
) -> None:
    """No detect() at startup: the first request detects, and every request gets 503; the
    error and its fix are logged once, not once per request."""
    name, server = acl_user
    refused = "goblin.claim" if mode_of(server) == "native" else "evalsha"
    set_user(server, name, "~*", "+@all", f"-{refused}")
    store = store_for(server, name)
    handler = CountingApp()
    mw = IdempotencyMiddleware(handler, store=store)
    try:
        with caplog.at_level(logging.INFO, logger="goblin_idem"):
            for i in range(5):
                answer = await send_once(mw, f"k{i}")
                assert (answer.status, answer.slug) == (503, "store-unavailable")
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors
        assert "logged once for this store" in errors[0]
        assert f"ACL SETUSER {name} +{refused}" in errors[0]
        assert mw.counters.store_errors == 5 and not handler.runs
        # A second middleware on the same store does not log it again.
        other = IdempotencyMiddleware(handler, store=store)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="goblin_idem"):
            assert (await send_once(other, "k9")).status == 503
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        await store.aclose()


async def test_a_refused_key_is_named_with_its_fix(
    acl_user: tuple[str, Server], caplog: pytest.LogCaptureFixture
) -> None:
    """The user may run every command but not on the middleware's keys: detection says so
    (it cannot know the namespace), and the requests' error names the key pattern to allow."""
    name, server = acl_user
    set_user(server, name, "~other:*", "+@all")
    store = store_for(server, name)
    mw = IdempotencyMiddleware(CountingApp(), store=store)
    try:
        with caplog.at_level(logging.INFO, logger="goblin_idem"):
            await store.detect()  # every command is allowed: no error
            for i in range(3):
                assert (await send_once(mw, f"k{i}")).status == 503
        info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert any("the ACL refused the probe key" in line for line in info), info
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and f"ACL SETUSER {name} ~idem:*" in errors[0], errors
    finally:
        await store.aclose()


async def test_a_wrong_password_is_logged_once_per_store(
    redis_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore.from_url(redis_server.url, username="nobody", password="wrong")
    mw = IdempotencyMiddleware(CountingApp(), store=store)
    try:
        with caplog.at_level(logging.INFO, logger="goblin_idem"):
            for i in range(3):
                assert (await send_once(mw, f"k{i}")).status == 503
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "AuthenticationError" in errors[0], errors
    finally:
        await store.aclose()


async def test_mode_detection_refused_says_how_to_do_without_it(
    acl_user: tuple[str, Server],
) -> None:
    """COMMAND refused: auto mode cannot tell native from script; an explicit mode needs
    no COMMAND at all."""
    name, server = acl_user
    set_user(server, name, "~*", "+@all", "-command")
    auto = store_for(server, name)
    explicit = store_for(server, name, mode=mode_of(server))
    try:
        with pytest.raises(StorePermissionError) as info:
            await auto.detect()
        assert info.value.denied == ("command|list",)
        assert "(or give mode='native' or 'script')" in str(info.value)
        assert await explicit.detect() == mode_of(server)
    finally:
        await auto.aclose()
        await explicit.aclose()
