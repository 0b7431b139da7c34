"""The `goblin` server module itself, on stock redis-server 7 and valkey-server 9.

Replies are read off the socket as raw RESP bytes, so every reply-table row, error text and
spec transcript is checked byte for byte. Beyond the spec pages: parity with the spec's Lua
bodies, replication to a replica without the module (and with replication commands renamed
away), AOF reload (with and without the module), cluster routing, WATCH / keyspace-event
behaviour, how values stay stored after compares, maxmemory, module load and refused unload,
and the build cache. Leases expire for real: nothing here mocks a clock.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import redis
import redis.exceptions

from goblin_idem.native import build_module, source_path
from goblin_idem.store._scripts import CAD_LUA, CAEXPIRE_LUA, CAS_LUA, CLAIM_LUA
from tests.support.servers import KINDS, Cluster, Server, start_server
from tests.support.waits import until_sync

Arg = bytes | str | int

WRONGTYPE = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
NOT_INT = b"-ERR value is not an integer or out of range\r\n"
CLAIMED = b"$7\r\nCLAIMED\r\n"
NIL = b"$-1\r\n"
OK = b"+OK\r\n"
ZERO = b":0\r\n"
ONE = b":1\r\n"
LLONG_MAX = 2**63 - 1
BINARY_KEY = b"k:\x00\xff\xfe{tag}\r\n"
BINARY_VALUE = b"\x00\x01\x80\xff not utf-8 \xc3\x28 \x00"
NON_INTEGERS: list[Arg] = [
    "abc",
    "1.5",
    "30.0",
    "",
    " 30",
    "30 ",
    "+30",
    "030",
    "0x1e",
    "1e3",
    "9223372036854775808",
    "-9223372036854775809",
]


def arity_error(command: str) -> bytes:
    return f"-ERR wrong number of arguments for '{command}' command\r\n".encode()


def expire_error(command: str) -> bytes:
    return f"-ERR invalid expire time in '{command}' command\r\n".encode()


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


# -- a raw RESP client: the reply exactly as the server wrote it ----------------------------


def _encode(args: Sequence[Arg]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        data = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(f: BinaryIO) -> bytes:
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError(f"truncated reply {line!r}")
    kind, rest = line[:1], line[1:-2]
    if kind == b"$" and rest != b"-1":
        return line + f.read(int(rest) + 2)
    if kind == b"*" and rest != b"-1":
        return line + b"".join(_read_reply(f) for _ in range(int(rest)))
    return line


class Raw:
    """One plain connection; `call` returns the full reply bytes."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=10)
        self.file: BinaryIO = self.sock.makefile("rb")

    def call(self, *args: Arg) -> bytes:
        self.sock.sendall(_encode(args))
        return _read_reply(self.file)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=KINDS)
def server(request: pytest.FixtureRequest, native_module: Path) -> Iterator[Server]:
    s = start_server(request.param, modules=[str(native_module)])
    yield s
    s.stop()


@pytest.fixture
def r(server: Server) -> Iterator[redis.Redis]:
    client = server.sync_client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def raw(server: Server, r: redis.Redis) -> Iterator[Callable[..., bytes]]:
    conn = Raw(server)
    yield conn.call
    conn.close()


# -- GOBLIN.CLAIM ---------------------------------------------------------------------------


def test_claim_reply_table(raw: Callable[..., bytes], r: redis.Redis) -> None:
    # the claim was free and is now taken -> CLAIMED (bulk), token stored with the lease
    assert raw("GOBLIN.CLAIM", "claim:1", "result:1", "worker-3", 30) == CLAIMED
    assert r.get("claim:1") == b"worker-3"
    assert 29_000 < r.pttl("claim:1") <= 30_000
    assert r.exists("result:1") == 0
    # the claim was held; result_key is absent -> nil
    assert raw("GOBLIN.CLAIM", "claim:1", "result:1", "worker-9", 30) == NIL
    assert r.get("claim:1") == b"worker-3"  # a lost claim changes nothing
    # the claim was held; result_key has a value -> that value
    r.set("result:1", "done")
    assert raw("GOBLIN.CLAIM", "claim:1", "result:1", "worker-9", 30) == bulk(b"done")
    # the claim was held; result_key is a non-string -> WRONGTYPE
    r.hset("result:h", "f", "v")
    r.zadd("result:z", {"m": 1})
    assert raw("GOBLIN.CLAIM", "claim:1", "result:h", "w", 30) == WRONGTYPE
    assert raw("GOBLIN.CLAIM", "claim:1", "result:z", "w", 30) == WRONGTYPE


@pytest.mark.parametrize("kind", ["hash", "zset", "list"])
def test_claim_key_of_any_type_just_fails_the_claim(
    raw: Callable[..., bytes], r: redis.Redis, kind: str
) -> None:
    {
        "hash": lambda: r.hset("c", "f", "v"),
        "zset": lambda: r.zadd("c", {"m": 1}),
        "list": lambda: r.rpush("c", "x"),
    }[kind]()
    assert raw("GOBLIN.CLAIM", "c", "r", "t", 30) == NIL
    r.set("r", "v")
    assert raw("GOBLIN.CLAIM", "c", "r", "t", 30) == bulk(b"v")
    assert r.type("c") == kind.encode()


def test_claim_spec_example_webhook(raw: Callable[..., bytes], r: redis.Redis) -> None:
    assert raw("GOBLIN.CLAIM", "claim:evt88", "result:evt88", "worker-3", 30) == CLAIMED
    # a duplicate that races in while worker-3 is still charging
    assert raw("GOBLIN.CLAIM", "claim:evt88", "result:evt88", "worker-9", 30) == NIL
    assert raw("SET", "result:evt88", "charged:txn_551", "EX", 86400) == OK
    # a duplicate delivery of the same event, seconds later
    assert raw("GOBLIN.CLAIM", "claim:evt88", "result:evt88", "worker-9", 30) == bulk(
        b"charged:txn_551"
    )


def test_claim_lease_really_expires(raw: Callable[..., bytes], r: redis.Redis) -> None:
    # worker-3 crashes and never publishes; after the lease the work is claimable again
    assert raw("GOBLIN.CLAIM", "claim:evt88", "result:evt88", "worker-3", 1) == CLAIMED
    assert raw("GOBLIN.CLAIM", "claim:evt88", "result:evt88", "worker-9", 1) == NIL
    time.sleep(1.1)
    assert raw("GOBLIN.CLAIM", "claim:evt88", "result:evt88", "worker-9", 30) == CLAIMED
    assert r.get("claim:evt88") == b"worker-9"
    assert r.pttl("claim:evt88") > 29_000


def test_claim_elapsed_result_reads_nil(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.set("c", "held")
    r.set("r", "old", px=100)
    time.sleep(0.15)
    assert raw("GOBLIN.CLAIM", "c", "r", "t", 30) == NIL


@pytest.mark.parametrize("seconds", NON_INTEGERS)
def test_claim_seconds_not_an_integer(raw: Callable[..., bytes], seconds: Arg) -> None:
    assert raw("GOBLIN.CLAIM", "c", "r", "t", seconds) == NOT_INT
    assert raw("EXISTS", "c") == ZERO


@pytest.mark.parametrize(
    "seconds", [0, -1, -30, -(2**63), LLONG_MAX // 1000 + 1, LLONG_MAX // 1000, LLONG_MAX]
)
def test_claim_seconds_invalid_expire(raw: Callable[..., bytes], seconds: int) -> None:
    # LLONG_MAX // 1000 itself passes the first bound, but now + ms overflows
    assert raw("GOBLIN.CLAIM", "c", "r", "t", seconds) == expire_error("goblin.claim")
    assert raw("EXISTS", "c") == ZERO
    # same texts as the SET ... EX the command mirrors
    assert raw("SET", "c", "t", "NX", "EX", seconds) == expire_error("set")


def test_claim_validates_seconds_before_touching_keys(
    raw: Callable[..., bytes], r: redis.Redis
) -> None:
    r.set("c", "held")
    r.hset("r", "f", "v")  # would be WRONGTYPE if it were read
    assert raw("GOBLIN.CLAIM", "c", "r", "t", 0) == expire_error("goblin.claim")
    assert raw("GOBLIN.CLAIM", "c", "r", "t", "x") == NOT_INT
    assert raw("GOBLIN.CLAIM", "free", "r", "t", -5) == expire_error("goblin.claim")
    assert r.exists("free") == 0


def test_claim_very_long_lease_that_fits(raw: Callable[..., bytes], r: redis.Redis) -> None:
    seconds = 9_000_000_000_000_000  # 9e18 ms: fits in an int64 with today's clock
    assert raw("GOBLIN.CLAIM", "c", "r", "t", seconds) == CLAIMED
    assert r.pttl("c") > 8_900_000_000_000_000_000


def test_claim_binary_and_empty(raw: Callable[..., bytes], r: redis.Redis) -> None:
    key, res = BINARY_KEY, BINARY_KEY + b":result"
    assert raw("GOBLIN.CLAIM", key, res, BINARY_VALUE, 30) == CLAIMED
    assert r.get(key) == BINARY_VALUE
    assert raw("GOBLIN.CLAIM", key, res, b"other", 30) == NIL
    r.set(res, BINARY_VALUE)
    assert raw("GOBLIN.CLAIM", key, res, b"other", 30) == bulk(BINARY_VALUE)
    # empty key names, an empty token, an empty (not missing) result
    assert raw("GOBLIN.CLAIM", "", "", "", 30) == CLAIMED
    assert r.get("") == b""
    assert raw("GOBLIN.CLAIM", "", "", "x", 30) == b"$0\r\n\r\n"
    r.set("r0", "")
    r.set("c0", "held")
    assert raw("GOBLIN.CLAIM", "c0", "r0", "t", 30) == b"$0\r\n\r\n"


def test_claim_same_key_for_claim_and_result(raw: Callable[..., bytes]) -> None:
    assert raw("GOBLIN.CLAIM", "k", "k", "t1", 30) == CLAIMED
    assert raw("GOBLIN.CLAIM", "k", "k", "t2", 30) == bulk(b"t1")


# -- GOBLIN.CAEXPIRE ------------------------------------------------------------------------


def test_caexpire_spec_example(raw: Callable[..., bytes], r: redis.Redis) -> None:
    assert raw("SET", "lock:job", "client-42-uuid", "NX", "PX", 30000) == OK
    assert raw("GOBLIN.CAEXPIRE", "lock:job", "wrong-owner", 30000) == ZERO
    assert raw("GOBLIN.CAEXPIRE", "lock:job", "client-42-uuid", 30000) == ONE
    assert 29_900 <= r.pttl("lock:job") <= 30_000


def test_caexpire_watchdog_example(raw: Callable[..., bytes]) -> None:
    assert raw("SET", "lock:job", "unique-token", "NX", "PX", 30000) == OK
    assert raw("GOBLIN.CAEXPIRE", "lock:job", "unique-token", 30000) == ONE
    assert raw("GOBLIN.CAD", "lock:job", "unique-token") == ONE
    assert raw("EXISTS", "lock:job") == ZERO


def test_caexpire_reply_table(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.set("k", "tok", px=60_000)
    # != expected -> 0, lease untouched
    assert raw("GOBLIN.CAEXPIRE", "k", "other", 5000) == ZERO
    assert r.pttl("k") > 59_000
    # == expected -> 1, TTL (re)set to ms
    assert raw("GOBLIN.CAEXPIRE", "k", "tok", 5000) == ONE
    assert 4_900 < r.pttl("k") <= 5_000
    # a key without TTL gets one
    r.set("p", "tok")
    assert raw("GOBLIN.CAEXPIRE", "p", "tok", 5000) == ONE
    assert 4_900 < r.pttl("p") <= 5_000
    # missing -> 0, not created
    assert raw("GOBLIN.CAEXPIRE", "missing", "tok", 5000) == ZERO
    assert r.exists("missing") == 0
    # non-string -> WRONGTYPE
    r.hset("h", "f", "v")
    r.zadd("z", {"m": 1})
    assert raw("GOBLIN.CAEXPIRE", "h", "tok", 5000) == WRONGTYPE
    assert raw("GOBLIN.CAEXPIRE", "z", "tok", 5000) == WRONGTYPE
    assert r.ttl("h") == -1


@pytest.mark.parametrize("ms", [0, -1, -(2**63)])
def test_caexpire_non_positive_deletes_and_replies_1(
    raw: Callable[..., bytes], r: redis.Redis, ms: int
) -> None:
    r.set("k", "tok", px=60_000)
    assert raw("GOBLIN.CAEXPIRE", "k", "other", ms) == ZERO
    assert r.exists("k") == 1
    assert raw("GOBLIN.CAEXPIRE", "k", "tok", ms) == ONE
    assert r.exists("k") == 0


@pytest.mark.parametrize("ms", NON_INTEGERS)
def test_caexpire_ms_not_an_integer(raw: Callable[..., bytes], r: redis.Redis, ms: Arg) -> None:
    r.set("k", "tok")
    assert raw("GOBLIN.CAEXPIRE", "k", "tok", ms) == NOT_INT
    assert raw("GOBLIN.CAEXPIRE", "missing", "tok", ms) == NOT_INT
    assert r.ttl("k") == -1


def test_caexpire_overflow(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.set("k", "tok")
    for ms in (LLONG_MAX, LLONG_MAX - 1000):
        assert raw("GOBLIN.CAEXPIRE", "k", "tok", ms) == expire_error("goblin.caexpire")
        assert raw("GOBLIN.CAEXPIRE", "missing", "x", ms) == expire_error("goblin.caexpire")
        assert raw("PEXPIRE", "k", ms) == expire_error("pexpire")
    assert r.ttl("k") == -1


def test_caexpire_elapsed_key_is_missing(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.set("k", "tok", px=100)
    time.sleep(0.15)
    assert raw("GOBLIN.CAEXPIRE", "k", "tok", 5000) == ZERO
    assert r.exists("k") == 0


# -- GOBLIN.CAS -----------------------------------------------------------------------------


def test_cas_spec_ttl_example(raw: Callable[..., bytes], r: redis.Redis) -> None:
    assert raw("SET", "config", "v1", "PX", 30000) == OK
    before = r.execute_command("PEXPIRETIME", "config")
    assert raw("GOBLIN.CAS", "config", "v1", "v2") == OK
    assert 29_000 < r.pttl("config") <= 30_000  # still ticking
    assert r.execute_command("PEXPIRETIME", "config") == before  # the same deadline
    assert raw("SET", "config", "v3") == OK
    assert raw("PTTL", "config") == b":-1\r\n"  # a bare SET drops it: the contrast


def test_cas_spec_counter_example(raw: Callable[..., bytes]) -> None:
    assert raw("SET", "counter:42", "v1") == OK
    assert raw("GOBLIN.CAS", "counter:42", "v0", "v2") == ZERO
    assert raw("GOBLIN.CAS", "counter:42", "v1", "v2") == OK
    assert raw("GET", "counter:42") == bulk(b"v2")
    assert raw("PTTL", "counter:42") == b":-1\r\n"  # no TTL before, none after


def test_cas_spec_optimistic_loop(raw: Callable[..., bytes]) -> None:
    raw("SET", "doc:1", "current")
    assert raw("GET", "doc:1") == bulk(b"current")
    assert raw("GOBLIN.CAS", "doc:1", "current", "next") == OK
    assert raw("GOBLIN.CAS", "doc:1", "current", "next2") == ZERO  # someone raced us
    assert raw("GET", "doc:1") == bulk(b"next")


def test_cas_reply_table(raw: Callable[..., bytes], r: redis.Redis) -> None:
    assert raw("GOBLIN.CAS", "missing", "", "v") == ZERO
    assert raw("GOBLIN.CAS", "missing", "v1", "v2") == ZERO
    assert r.exists("missing") == 0  # never created
    r.hset("h", "f", "v")
    r.zadd("z", {"m": 1})
    assert raw("GOBLIN.CAS", "h", "v1", "v2") == WRONGTYPE
    assert raw("GOBLIN.CAS", "z", "v1", "v2") == WRONGTYPE


def test_cas_elapsed_key_is_not_recreated(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.set("k", "v1", px=100)
    time.sleep(0.15)
    assert raw("GOBLIN.CAS", "k", "v1", "v2") == ZERO
    assert r.exists("k") == 0


def test_cas_compare_is_byte_exact(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.set(BINARY_KEY, BINARY_VALUE)
    for near in (
        BINARY_VALUE[:-1],
        BINARY_VALUE + b"\x00",
        BINARY_VALUE.upper(),
        b" " + BINARY_VALUE,
        b"",
    ):
        assert raw("GOBLIN.CAS", BINARY_KEY, near, b"x") == ZERO
    assert raw("GOBLIN.CAS", BINARY_KEY, BINARY_VALUE, b"\xff\x00") == OK
    assert r.get(BINARY_KEY) == b"\xff\x00"
    # empty strings on either side, and integer-looking values (int-encoded on the server)
    r.set("e", "")
    assert raw("GOBLIN.CAS", "e", "", "12345") == OK
    assert raw("GOBLIN.CAS", "e", "012345", "x") == ZERO
    assert raw("GOBLIN.CAS", "e", "12345", "") == OK
    assert r.get("e") == b""
    r.set("Tok", "Value")
    assert raw("GOBLIN.CAS", "Tok", "value", "x") == ZERO
    assert raw("GOBLIN.CAS", "tok", "Value", "x") == ZERO


def test_cas_ten_megabyte_value(raw: Callable[..., bytes], r: redis.Redis) -> None:
    big = bytes(range(256)) * (10 * 1024 * 1024 // 256)
    r.set("blob", "v1", px=30000)
    deadline = r.execute_command("PEXPIRETIME", "blob")
    assert raw("GOBLIN.CAS", "blob", "v1", big) == OK
    assert r.get("blob") == big
    assert raw("GOBLIN.CAS", "blob", big[:-1] + b"x", "v2") == ZERO
    assert raw("GOBLIN.CAS", "blob", big, "v2") == OK
    assert r.get("blob") == b"v2"
    assert r.execute_command("PEXPIRETIME", "blob") == deadline


# -- GOBLIN.CAD -----------------------------------------------------------------------------


def test_cad_spec_example(raw: Callable[..., bytes]) -> None:
    assert raw("SET", "lock:job", "client-42-uuid", "NX", "PX", 30000) == OK
    assert raw("GOBLIN.CAD", "lock:job", "someone-else") == ZERO
    assert raw("EXISTS", "lock:job") == ONE
    assert raw("GOBLIN.CAD", "lock:job", "client-42-uuid") == ONE
    assert raw("GOBLIN.CAD", "lock:job", "client-42-uuid") == ZERO


def test_cad_reply_table(raw: Callable[..., bytes], r: redis.Redis) -> None:
    r.hset("h", "f", "v")
    r.zadd("z", {"m": 1})
    assert raw("GOBLIN.CAD", "h", "v") == WRONGTYPE
    assert raw("GOBLIN.CAD", "z", "v") == WRONGTYPE
    assert r.exists("h", "z") == 2
    assert raw("GOBLIN.CAD", "missing", "") == ZERO
    r.set(BINARY_KEY, BINARY_VALUE)
    assert raw("GOBLIN.CAD", BINARY_KEY, BINARY_VALUE[:-1]) == ZERO
    assert raw("GOBLIN.CAD", BINARY_KEY, BINARY_VALUE) == ONE
    r.set("e", "")
    assert raw("GOBLIN.CAD", "e", "x") == ZERO
    assert raw("GOBLIN.CAD", "e", "") == ONE
    r.set("gone", "v", px=100)
    time.sleep(0.15)
    assert raw("GOBLIN.CAD", "gone", "v") == ZERO


# -- arity, command table -------------------------------------------------------------------

ARITY = {"goblin.claim": 5, "goblin.caexpire": 4, "goblin.cas": 4, "goblin.cad": 3}


@pytest.mark.parametrize("command", sorted(ARITY))
def test_wrong_arity(raw: Callable[..., bytes], command: str) -> None:
    n = ARITY[command]
    for argc in (1, n - 1, n + 1, n + 3):
        for spelling in (command.upper(), command):
            args = [spelling, *["x"] * (argc - 1)]
            assert raw(*args) == arity_error(command)
    assert raw("SET", "a") == arity_error("set")  # the server's own wording, mirrored


def test_command_table(server: Server, r: redis.Redis) -> None:
    info = r.command()
    # CAS stores and compares values of any size, like SET: not `fast`
    expected = {
        "goblin.claim": (5, 1, 2, {"write", "denyoom", "fast"}),
        "goblin.caexpire": (4, 1, 1, {"write", "fast"}),
        "goblin.cas": (4, 1, 1, {"write", "denyoom"}),
        "goblin.cad": (3, 1, 1, {"write", "fast"}),
    }
    for name, (arity, first, last, flags) in expected.items():
        entry = info[name]
        assert (entry["arity"], entry["first_key_pos"], entry["last_key_pos"]) == (
            arity,
            first,
            last,
        )
        assert entry["step_count"] == 1
        assert set(entry["flags"]) - {"module"} == flags, name
        assert "movablekeys" not in entry["flags"]
    assert r.command_getkeys("goblin.claim", "a", "b", "t", "5") == ["a", "b"]
    assert r.command_getkeys("goblin.caexpire", "k", "t", "5") == ["k"]
    assert r.command_getkeys("goblin.cas", "k", "t", "n") == ["k"]
    assert r.command_getkeys("goblin.cad", "k", "t") == ["k"]
    specs = info["goblin.claim"]["key_specifications"]
    assert [set(as_map(s)[b"flags"]) for s in specs] == [{b"OW", b"insert"}, {b"RO", b"access"}]


def test_acl_key_permissions_follow_key_specs(server: Server, r: redis.Redis) -> None:
    # write-only on claims, read-only on results: enough for GOBLIN.CLAIM, not for CAS
    r.execute_command("ACL", "SETUSER", "worker", "on", ">pw", "+@all", "%W~claim:*", "%R~result:*")
    try:
        with server.sync_client(username="worker", password="pw") as w:
            assert w.execute_command("GOBLIN.CLAIM", "claim:1", "result:1", "t", 30) == b"CLAIMED"
            with pytest.raises(redis.exceptions.NoPermissionError):
                w.execute_command("GOBLIN.CLAIM", "result:1", "claim:1", "t", 30)
            with pytest.raises(redis.exceptions.NoPermissionError):
                w.execute_command("GOBLIN.CAS", "claim:1", "t", "u")  # reads the value
    finally:
        r.execute_command("ACL", "DELUSER", "worker")


# -- parity with the spec's Lua bodies ------------------------------------------------------

SETUPS: dict[str, list[tuple[Arg, ...]]] = {
    "empty": [],
    "held": [("SET", "c", "tok", "PX", 60000)],
    "held+result": [("SET", "c", "tok", "PX", 60000), ("SET", "r", "done")],
    "held+empty-result": [("SET", "c", "tok"), ("SET", "r", "")],
    "hash-claim": [("HSET", "c", "f", "v"), ("SET", "r", "done")],
    "int-value": [("SET", "c", "12345", "PX", 60000)],
}
CALLS: list[tuple[str, str, list[Arg], list[Arg]]] = [
    ("GOBLIN.CLAIM", CLAIM_LUA, ["c", "r"], ["w", 30]),
    ("GOBLIN.CAEXPIRE", CAEXPIRE_LUA, ["c"], ["tok", 5000]),
    ("GOBLIN.CAEXPIRE", CAEXPIRE_LUA, ["c"], ["12345", 0]),
    ("GOBLIN.CAEXPIRE", CAEXPIRE_LUA, ["c"], ["nope", 5000]),
    ("GOBLIN.CAS", CAS_LUA, ["c"], ["tok", "new"]),
    ("GOBLIN.CAS", CAS_LUA, ["c"], ["12345", ""]),
    ("GOBLIN.CAS", CAS_LUA, ["c"], ["nope", "new"]),
    ("GOBLIN.CAD", CAD_LUA, ["c"], ["tok"]),
    ("GOBLIN.CAD", CAD_LUA, ["c"], ["12345"]),
    ("GOBLIN.CAD", CAD_LUA, ["c"], [""]),
]


def _state(r: redis.Redis) -> list[object]:
    out: list[object] = []
    for key in ("c", "r"):
        kind = r.type(key)
        ttl = r.pttl(key)
        value = r.get(key) if kind == b"string" else None
        out.append((key, kind, value, round(ttl / 1000) if ttl > 0 else ttl))
    return out


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_same_replies_and_effects_as_the_lua_bodies(
    raw: Callable[..., bytes], r: redis.Redis, setup: str
) -> None:
    for command, lua, keys, args in CALLS:
        results = []
        for native in (True, False):
            r.flushall()
            for step in SETUPS[setup]:
                r.execute_command(*step)
            if native:
                reply = raw(command, *keys, *args)
            else:
                reply = raw("EVAL", lua, len(keys), *keys, *args)
            if reply.startswith(b"-WRONGTYPE"):
                reply = WRONGTYPE  # Lua appends where in the script it failed
            results.append((reply, _state(r)))
        assert results[0] == results[1], (command, args)


# -- side effects the scripts have and the module must match: WATCH, keyspace events --------


def test_only_real_changes_abort_a_watch(server: Server, r: redis.Redis) -> None:
    r.set("c", "tok", px=60_000)
    for call, aborts in [
        (("GOBLIN.CLAIM", "c", "r", "t2", 30), False),  # lost claim
        (("GOBLIN.CAS", "c", "nope", "x"), False),
        (("GOBLIN.CAD", "c", "nope"), False),
        (("GOBLIN.CAEXPIRE", "c", "nope", 1000), False),
        (("GOBLIN.CAEXPIRE", "c", "tok", 50_000), True),
        (("GOBLIN.CAS", "c", "tok", "tok"), True),
        (("GOBLIN.CAD", "c", "tok"), True),
        (("GOBLIN.CLAIM", "c", "r", "tok", 30), True),  # won claim
    ]:
        with r.pipeline() as p:
            p.watch("c")
            r.execute_command(*call)
            p.multi()
            p.get("c")
            if aborts:
                with pytest.raises(redis.exceptions.WatchError):
                    p.execute()
            else:
                assert p.execute() == [r.get("c")], call


def _events(r: redis.Redis, calls: Sequence[Sequence[Arg]]) -> list[tuple[bytes, bytes]]:
    with r.pubsub() as ps:
        ps.psubscribe("__keyevent@0__:*")
        assert ps.get_message(timeout=2) is not None  # the psubscribe confirmation
        for call in calls:
            r.execute_command(*call)
        r.execute_command("PUBLISH", "__keyevent@0__:end", "end")
        out: list[tuple[bytes, bytes]] = []
        while True:
            msg = ps.get_message(timeout=2)
            assert msg is not None
            if msg["channel"] == b"__keyevent@0__:end":
                return out
            out.append((msg["channel"].rsplit(b":", 1)[1], msg["data"]))


def test_keyspace_events_match_the_scripts(server: Server, r: redis.Redis) -> None:
    kind = server.kind
    r.config_set("notify-keyspace-events", "Eg$x")
    try:
        sequences: list[list[tuple[Arg, ...]]] = []
        for native in (True, False):

            def call(
                cmd: str, lua: str, keys: list[Arg], args: list[Arg], native: bool = native
            ) -> tuple[Arg, ...]:
                return (cmd, *keys, *args) if native else ("EVAL", lua, len(keys), *keys, *args)

            sequences.append(
                [
                    call("GOBLIN.CLAIM", CLAIM_LUA, ["c", "r"], ["t", 30]),
                    call("GOBLIN.CLAIM", CLAIM_LUA, ["c", "r"], ["t", 30]),
                    call("GOBLIN.CAEXPIRE", CAEXPIRE_LUA, ["c"], ["t", 9000]),
                    call("GOBLIN.CAEXPIRE", CAEXPIRE_LUA, ["c"], ["x", 9000]),
                    call("GOBLIN.CAS", CAS_LUA, ["c"], ["t", "u"]),
                    call("GOBLIN.CAS", CAS_LUA, ["c"], ["t", "u"]),
                    call("GOBLIN.CAD", CAD_LUA, ["c"], ["u"]),
                    call("GOBLIN.CAD", CAD_LUA, ["c"], ["u"]),
                    ("SET", "d", "v"),
                    call("GOBLIN.CAEXPIRE", CAEXPIRE_LUA, ["d"], ["v", 0]),
                ]
            )
        r.flushall()
        native_events = _events(r, sequences[0])
        r.flushall()
        script_events = _events(r, sequences[1])
        assert native_events == script_events
        # a deadline already past: "del" on Redis, "expired" on Valkey 8.1+ (as PEXPIRE)
        past = b"expired" if kind == "valkey" else b"del"
        assert native_events == [
            (b"set", b"c"),
            (b"expire", b"c"),
            (b"expire", b"c"),
            (b"set", b"c"),
            (b"del", b"c"),
            (b"set", b"d"),
            (past, b"d"),
        ]
    finally:
        r.config_set("notify-keyspace-events", "")


def test_maxmemory_refuses_only_commands_that_can_grow(
    raw: Callable[..., bytes], r: redis.Redis
) -> None:
    # CLAIM and CAS are deny-oom like SET; CAD and CAEXPIRE are not, like DEL and PEXPIRE,
    # so a lock can still be released or renewed under memory pressure.
    r.set("k", "tok")
    r.config_set("maxmemory", 1)
    try:
        assert raw("GOBLIN.CLAIM", "c", "r", "t", 30).startswith(b"-OOM ")
        assert raw("GOBLIN.CAS", "k", "tok", "x").startswith(b"-OOM ")
        assert raw("GOBLIN.CAEXPIRE", "k", "tok", 5000) == ONE
        assert raw("GOBLIN.CAD", "k", "tok") == ONE
    finally:
        r.config_set("maxmemory", 0)


STORAGE = [("OBJECT", "ENCODING"), ("MEMORY", "USAGE")]


def _pipelined(r: redis.Redis, calls: Sequence[Sequence[Arg]]) -> list[object]:
    """Replies to `calls`, sent 100 at a time: client buffers stay small and steady."""
    replies: list[object] = []
    for start in range(0, len(calls), 100):
        p = r.pipeline(transaction=False)
        for call in calls[start : start + 100]:
            p.execute_command(*call)
        replies += p.execute(raise_on_error=False)
    return replies


def test_failed_compares_keep_how_values_are_stored(r: redis.Redis) -> None:
    # int-encoded (shared below 10000, and not), embedded strings (Redis: up to 44 bytes,
    # Valkey: about 110 with the key) and plain ones; DMA would rewrite the first three
    n = 1000
    values: dict[str, bytes] = {}
    for i in range(n):
        values[f"s:{i}"] = b"%d" % i
        values[f"i:{i}"] = b"%d" % (10**12 + i)
        values[f"e:{i}"] = b"token-%08d" % i
        values[f"l:{i}"] = b"%-100d" % i
    r.mset(values)
    r.mset({"warm:" + k: v for k, v in values.items()})
    r.set("held", "someone")

    def failing(prefix: str) -> list[tuple[Arg, ...]]:
        calls: list[tuple[Arg, ...]] = []
        for key, value in values.items():
            same_length = b"x" * len(value)  # passes the length check, fails on the bytes
            calls += [
                ("GOBLIN.CAD", prefix + key, same_length),
                ("GOBLIN.CAD", prefix + key, value + b"x"),
                ("GOBLIN.CAEXPIRE", prefix + key, same_length, 5000),
                ("GOBLIN.CAS", prefix + key, same_length, "new"),
                ("GOBLIN.CLAIM", "held", prefix + key, "t", 30),  # reads the value
            ]
        return calls

    def stored() -> dict[str, tuple[object, object]]:
        replies = _pipelined(r, [(cmd, sub, k) for k in values for cmd, sub in STORAGE])
        return dict(zip(values, zip(replies[::2], replies[1::2], strict=True), strict=True))

    # the same work on copies first, and the first INFO memory, which allocates once:
    # nothing the measured part does is then a first time
    _pipelined(r, failing("warm:"))
    stored()
    r.info("memory")
    before, used_before = stored(), r.info("memory")["used_memory"]
    replies = _pipelined(r, failing(""))
    after, used_after = stored(), r.info("memory")["used_memory"]
    assert replies == [x for v in values.values() for x in (0, 0, 0, 0, v)]
    assert {b"int", b"embstr"} <= {enc for enc, _ in before.values()}  # the cases exist
    changed = {k: (before[k], after[k]) for k in values if after[k] != before[k]}
    grown = used_after - used_before
    assert not changed, (
        f"{len(changed)} values stored differently, used_memory {grown:+d} bytes; "
        f"(encoding, MEMORY USAGE) before and after, e.g. {list(changed.items())[:4]}"
    )
    assert grown < 4 * len(values)  # and nothing grew elsewhere
    # a renewal reads the value the same way: still not rewritten
    assert r.execute_command("GOBLIN.CAEXPIRE", "i:1", values["i:1"], 5000) == 1
    assert r.execute_command("GOBLIN.CAEXPIRE", "e:1", values["e:1"], 5000) == 1
    assert r.object("encoding", "i:1") == b"int" and r.object("encoding", "e:1") == b"embstr"


def test_caexpire_past_deadline_counts_like_pexpire(server: Server, r: redis.Redis) -> None:
    # Valkey 8.1+ counts a PEXPIRE into the past in expired_keys; Redis 7.0 does not
    def expired_keys() -> int:
        return int(r.info("stats")["expired_keys"])

    counted: dict[str, int] = {}
    for name, call in [
        ("pexpire", ("PEXPIRE", "k", -1)),
        ("native", ("GOBLIN.CAEXPIRE", "k", "v", 0)),
        ("script", ("EVAL", CAEXPIRE_LUA, 1, "k", "v", -5)),
    ]:
        r.set("k", "v")
        before = expired_keys()
        assert r.execute_command(*call) == 1
        assert r.exists("k") == 0
        counted[name] = expired_keys() - before
    n = 1 if server.kind == "valkey" else 0
    assert counted == {"pexpire": n, "native": n, "script": n}


# -- replication ----------------------------------------------------------------------------


def _wait_link_up(replica: Server, timeout: float = 10.0) -> None:
    with replica.sync_client() as c:
        linked = lambda: c.info("replication").get("master_link_status") == "up"  # noqa: E731
        until_sync(linked, timeout, "the replica connected to its master")


@pytest.mark.parametrize("kind", KINDS)
def test_replica_without_module_sees_the_effects(kind: str, native_module: Path) -> None:
    master = start_server(kind, modules=[str(native_module)])
    replica: Server | None = None
    try:
        replica = start_server(kind, args=["--replicaof", "127.0.0.1", str(master.port)])
        _wait_link_up(replica)
        with master.sync_client() as m, replica.sync_client() as s:

            def synced() -> None:
                assert m.execute_command("WAIT", 1, 5000) == 1

            def same(key: str) -> None:
                synced()
                assert s.get(key) == m.get(key)
                assert s.execute_command("PEXPIRETIME", key) == m.execute_command(
                    "PEXPIRETIME", key
                )

            errors_before = s.info("errorstats")
            assert m.execute_command("GOBLIN.CLAIM", "c", "r", "tok", 100) == b"CLAIMED"
            same("c")
            assert s.get("c") == b"tok" and 90_000 < s.pttl("c") <= 100_000
            # a lost claim is not propagated and changes nothing anywhere
            m.set("r", "done")
            assert m.execute_command("GOBLIN.CLAIM", "c", "r", "x", 5) == b"done"
            same("c")
            assert m.execute_command("GOBLIN.CAEXPIRE", "c", "tok", 250_000) == 1
            same("c")
            assert 240_000 < s.pttl("c") <= 250_000
            assert m.execute_command("GOBLIN.CAS", "c", "tok", "new") == b"OK"
            same("c")
            assert s.get("c") == b"new" and s.pttl("c") > 240_000
            m.set("p", "v1")
            assert m.execute_command("GOBLIN.CAS", "p", "v1", "v2") == b"OK"
            same("p")
            assert s.pttl("p") == -1
            assert m.execute_command("GOBLIN.CAD", "c", "new") == 1
            synced()
            assert s.exists("c") == 0
            m.set("d", "v", px=60_000)
            assert m.execute_command("GOBLIN.CAEXPIRE", "d", "v", 0) == 1
            synced()
            assert s.exists("d") == 0
            # the replica only ever received built-in commands, and none failed (counted
            # from the first use of `s`: redis-py's CLIENT SETINFO is an error on Redis 7.0)
            assert not any("goblin" in k for k in s.info("commandstats"))
            assert s.info("errorstats") == errors_before
    finally:
        if replica is not None:
            replica.stop()
        master.stop()


# SET renamed to another name, PEXPIREAT and DEL removed: every form a GOBLIN command
# replicates its effect as (SET ... PXAT, PEXPIREAT, SET ... KEEPTTL, DEL) is refused.
RENAMED = """\
rename-command SET SET-RENAMED
rename-command PEXPIREAT ""
rename-command DEL ""
"""


def no_replication(command: str, missing: str) -> bytes:
    return (
        f"-ERR {command} changed nothing: the server has no {missing} command to replicate "
        f"it with (remove 'rename-command {missing}' from the server configuration)\r\n"
    ).encode()


@pytest.mark.parametrize("kind", KINDS)
def test_an_effect_the_server_cannot_replicate_is_not_made(kind: str, native_module: Path) -> None:
    primary = start_server(
        kind,
        modules=[str(native_module)],
        config=RENAMED,
        args=["--repl-diskless-sync-delay", "0"],
    )
    replica: Server | None = None
    conn: Raw | None = None
    try:
        replica = start_server(kind, args=["--replicaof", "127.0.0.1", str(primary.port)])
        _wait_link_up(replica)
        conn = Raw(primary)
        assert conn.call("MSET", "k", "tok", "x", "tok", "d", "tok") == OK
        replies = [
            conn.call("GOBLIN.CLAIM", "c", "r", "t", 30),  # SET c t PXAT
            conn.call("GOBLIN.CAEXPIRE", "k", "tok", 50_000),  # PEXPIREAT k
            conn.call("GOBLIN.CAS", "k", "tok", "new"),  # SET k new KEEPTTL
            conn.call("GOBLIN.CAD", "d", "tok"),  # DEL d
            conn.call("GOBLIN.CAD", "d", "tok"),
            conn.call("GOBLIN.CAEXPIRE", "x", "tok", 0),  # DEL x on Redis; see below
        ]
        assert conn.call("WAIT", 1, 5000) == b":1\r\n"
        with primary.sync_client() as m, replica.sync_client() as s:

            def state(c: redis.Redis) -> dict[str, tuple[object, object]]:
                return {k: (c.get(k), c.execute_command("PEXPIRETIME", k)) for k in "ckxd"}

            # first of all: the replica holds exactly what the primary holds
            assert state(s) == state(m)
            assert m.mget("c", "k", "d") == [None, b"tok", b"tok"] and m.pttl("k") == -1
        # Valkey expires a key given a past deadline and the server propagates the deletion
        # itself, which no rename can refuse; Redis deletes it and replicates a DEL
        past = ONE if kind == "valkey" else no_replication("goblin.caexpire", "DEL")
        assert replies == [
            no_replication("goblin.claim", "SET"),
            no_replication("goblin.caexpire", "PEXPIREAT"),
            no_replication("goblin.cas", "SET"),
            no_replication("goblin.cad", "DEL"),
            no_replication("goblin.cad", "DEL"),
            past,
        ]
        log = (primary.dir / "server.log").read_text()
        for missing in ("SET", "PEXPIREAT", "DEL"):
            assert log.count(f"the server has no {missing} command (rename-command?)") == 1
    finally:
        if conn is not None:
            conn.close()
        if replica is not None:
            replica.stop()
        primary.stop()


# -- AOF ------------------------------------------------------------------------------------

AOF_ARGS = ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]


def _aof_bytes(directory: Path) -> bytes:
    files = sorted((directory / "appendonlydir").glob("*.aof"))
    assert files, f"no AOF files in {directory}"
    return b"".join(f.read_bytes() for f in files)


@pytest.mark.parametrize("kind", KINDS)
def test_aof_reload_keeps_absolute_deadlines(kind: str, native_module: Path) -> None:
    server = start_server(kind, modules=[str(native_module)], args=AOF_ARGS, persist=True)
    plain: Server | None = None
    try:
        with server.sync_client() as c:
            assert c.execute_command("GOBLIN.CLAIM", "claim", "result", "tok", 100) == b"CLAIMED"
            c.set("leased", "v1", px=100_000)
            assert c.execute_command("GOBLIN.CAS", "leased", "v1", "v2") == b"OK"
            c.set("lock", "me")
            assert c.execute_command("GOBLIN.CAEXPIRE", "lock", "me", 100_000) == 1
            c.set("gone1", "x")
            c.set("gone2", "x")
            assert c.execute_command("GOBLIN.CAD", "gone1", "x") == 1
            assert c.execute_command("GOBLIN.CAEXPIRE", "gone2", "x", -1) == 1
            size = len(_aof_bytes(server.dir))
            # nothing changed, nothing is written
            c.execute_command("GOBLIN.CLAIM", "claim", "result", "other", 100)
            c.execute_command("GOBLIN.CAS", "leased", "nope", "x")
            c.execute_command("GOBLIN.CAD", "lock", "nope")
            c.execute_command("GOBLIN.CAEXPIRE", "lock", "nope", 5)
            assert len(_aof_bytes(server.dir)) == size
            deadlines = {
                k: c.execute_command("PEXPIRETIME", k) for k in ("claim", "leased", "lock")
            }
        aof = _aof_bytes(server.dir)
        assert b"goblin" not in aof.lower()
        for word in (b"PXAT", b"KEEPTTL", b"PEXPIREAT", b"DEL"):
            assert word in aof
        time.sleep(1.5)
        server.kill()

        def check(s: Server) -> None:
            with s.sync_client() as c:
                for key, deadline in deadlines.items():
                    assert c.execute_command("PEXPIRETIME", key) == deadline
                    assert 90_000 < c.pttl(key) <= 98_600  # 1.5 s went by: not re-leased
                assert c.mget("claim", "leased", "lock", "gone1", "gone2") == [
                    b"tok",
                    b"v2",
                    b"me",
                    None,
                    None,
                ]

        server.restart()
        check(server)
        server.stop(remove_dir=False)
        # the AOF holds built-in commands only: a server without the module loads it too
        plain = start_server(kind, args=AOF_ARGS, persist=True, directory=server.dir)
        check(plain)
    finally:
        if plain is not None:
            plain.stop()
        server.stop()


# -- cluster --------------------------------------------------------------------------------


@pytest.fixture
def cluster(shared_cluster: tuple[Cluster, str]) -> Cluster:
    """The module's shared cluster, narrowed to native mode by `native_clusters`."""
    return shared_cluster[0]


native_clusters = pytest.mark.parametrize(
    "shared_cluster", [(kind, "native") for kind in KINDS], indirect=True, ids="-".join
)


def _owner(cluster: Cluster, key: str) -> Server:
    """The master serving `key`, as the cluster itself says (a MOVED points at it)."""
    first = cluster.servers[0]
    conn = Raw(first)
    try:
        reply = conn.call("EXISTS", key)
    finally:
        conn.close()
    if not reply.startswith(b"-MOVED "):
        return first
    port = int(reply.split()[2].rsplit(b":", 1)[1])
    return next(s for s in cluster.servers if s.port == port)


@native_clusters
async def test_cluster_client_routes_goblin_commands(cluster: Cluster) -> None:
    tags = ["t", "a", "b", "c", "d", "e", "f", "g"]
    owners = {_owner(cluster, f"{{{t}}}").port for t in tags}
    assert len(owners) == 3  # the tags cover every master
    rc = cluster.client()
    try:
        for t in tags:
            c, res = f"{{{t}}}:c", f"{{{t}}}:r"
            assert await rc.execute_command("GOBLIN.CLAIM", c, res, "tok", 30) == b"CLAIMED"
            assert await rc.execute_command("GOBLIN.CLAIM", c, res, "x", 30) is None
            assert await rc.execute_command("GOBLIN.CAEXPIRE", c, "tok", 60_000) == 1
            assert await rc.execute_command("GOBLIN.CAS", c, "tok", "v2") == b"OK"
            owner = _owner(cluster, c)
            with owner.sync_client() as direct:
                assert direct.get(c) == b"v2"
                assert direct.pttl(c) > 59_000
            assert await rc.execute_command("GOBLIN.CAD", c, "v2") == 1
        # keys in different slots are refused by the client before anything is sent
        with pytest.raises(redis.exceptions.RedisClusterException):
            await rc.execute_command("GOBLIN.CLAIM", "{a}:c", "{b}:r", "tok", 30)
    finally:
        await rc.aclose()


@native_clusters
def test_cluster_node_redirects_and_refuses_cross_slot(cluster: Cluster) -> None:
    key = "{t}:c"
    owner = _owner(cluster, key)
    other = next(s for s in cluster.servers if s.port != owner.port)
    conn = Raw(other)
    try:
        assert conn.call("GOBLIN.CAD", key, "v").startswith(b"-MOVED ")
        assert conn.call("GOBLIN.CLAIM", key, "{t}:r", "tok", 30).startswith(b"-MOVED ")
        assert conn.call("GOBLIN.CLAIM", "{a}:c", "{b}:r", "tok", 30) == (
            b"-CROSSSLOT Keys in request don't hash to the same slot\r\n"
        )
    finally:
        conn.close()


# -- MODULE LOAD / UNLOAD -------------------------------------------------------------------


@pytest.fixture(params=KINDS)
def module_command_server(request: pytest.FixtureRequest, native_module: Path) -> Iterator[Server]:
    """A throwaway server that allows MODULE LOAD / UNLOAD, which a test may crash."""
    s = start_server(
        request.param, modules=[str(native_module)], args=["--enable-module-command", "yes"]
    )
    yield s
    s.stop()


def test_module_refuses_to_be_unloaded_under_a_queued_transaction(
    module_command_server: Server,
) -> None:
    s = module_command_server
    tx, other = Raw(s), Raw(s)
    try:
        assert tx.call("SET", "k", "a") == OK
        assert tx.call("MULTI") == OK
        assert tx.call("GOBLIN.CAS", "k", "a", "b") == b"+QUEUED\r\n"
        unload = other.call("MODULE", "UNLOAD", "goblin")
        try:
            executed = tx.call("EXEC")
        except OSError:  # the connection died with the server
            s.proc.wait(timeout=60)  # the crash report takes a moment
            pytest.fail(f"EXEC after MODULE UNLOAD killed the server (exit {s.proc.returncode})")
        assert unload == b"-ERR Error unloading module: operation not possible.\r\n"
        assert executed == b"*1\r\n+OK\r\n"
        assert other.call("GET", "k") == bulk(b"b")
        assert other.call("GOBLIN.CAD", "k", "b") == ONE  # still served
        assert s.running() and other.call("PING") == b"+PONG\r\n"
    finally:
        tx.close()
        other.close()
    # a shutdown is let through (Valkey unloads every module on its way out), quietly
    s.stop(remove_dir=False)
    assert s.proc.returncode == 0
    assert (s.dir / "server.log").read_text().count("goblin cannot be unloaded") == 1


def test_module_is_loaded_once(module_command_server: Server, native_module: Path) -> None:
    with module_command_server.sync_client() as c:
        with pytest.raises(redis.exceptions.ResponseError):
            c.execute_command("MODULE", "LOAD", str(native_module))
        assert c.ping()
        names = [as_map(m)[b"name"] for m in c.execute_command("MODULE", "LIST")]
        assert names.count(b"goblin") == 1
        c.set("k", "v")
        assert c.execute_command("GOBLIN.CAD", "k", "v") == 1


# -- building -------------------------------------------------------------------------------


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $XDG_CACHE_HOME for this test: the user's own cache is never touched."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_build_is_cached_by_source_hash(cache_home: Path, native_module: Path) -> None:
    first = build_module()
    root = cache_home / "goblin-idem"
    assert first.is_absolute() and first.is_relative_to(root)
    assert os.access(first, os.X_OK)
    # private to this user: nobody else can put a module where it will be loaded from
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    recorded = (first.parent / "goblin.so.sha256").read_text().strip()
    assert recorded == hashlib.sha256(first.read_bytes()).hexdigest()
    stamp = first.stat().st_mtime_ns
    assert build_module(cc="no-such-compiler-needed") == first  # reused, no compile
    assert first.stat().st_mtime_ns == stamp
    assert native_module.name == first.name and os.access(native_module, os.X_OK)
    assert source_path().is_file() and source_path().suffix == ".c"
    assert not list(first.parent.glob(".goblin-*"))  # no temp file left behind


@pytest.mark.parametrize("damage", ["replaced", "hash-missing", "truncated"])
def test_build_cache_compiles_again_what_its_hash_does_not_match(
    cache_home: Path, damage: str
) -> None:
    first = build_module()
    good = first.read_bytes()
    if damage == "replaced":
        first.write_bytes(b"\x7fELF not the module our build wrote")
    elif damage == "hash-missing":
        (first.parent / "goblin.so.sha256").unlink()
    else:
        first.write_bytes(good[: len(good) // 2])
    with pytest.raises(RuntimeError, match="no C compiler found"):
        build_module(cc="no-such-cc-anywhere")  # it wants to compile, not to load that file
    assert build_module() == first
    assert first.read_bytes() == good
    assert (first.parent / "goblin.so.sha256").read_text().strip() == (
        hashlib.sha256(good).hexdigest()
    )


OWN_CACHE = "set $XDG_CACHE_HOME to a directory of your own, or build with `build-module --out DIR`"


def _cache_refusal() -> str:
    with pytest.raises(RuntimeError) as err:
        build_module()
    return str(err.value)


@pytest.mark.parametrize("which", ["root", "build"])
def test_build_cache_refuses_a_directory_others_can_write(cache_home: Path, which: str) -> None:
    first = build_module()
    directory = cache_home / "goblin-idem" if which == "root" else first.parent
    directory.chmod(0o777)
    assert _cache_refusal() == (
        f"refusing the module cache {directory}: it is writable by group or others "
        f"(mode 777); run `chmod 700 {directory}`, or {OWN_CACHE}"
    )
    directory.chmod(0o755)  # readable by others is fine: not writable
    assert build_module() == first


def test_build_cache_refuses_a_directory_another_user_owns(cache_home: Path) -> None:
    root = cache_home / "goblin-idem"
    if os.geteuid() == 0:  # root can hand a directory to another user
        root.mkdir(parents=True, mode=0o700)
        os.chown(root, 65534, 65534)
    else:  # anyone else reaches one that root owns through the cache path
        cache_home.mkdir(parents=True)
        root.symlink_to(Path(sys.prefix).anchor)
    assert _cache_refusal() == (
        f"refusing the module cache {root}: it is owned by uid {root.stat().st_uid}, not by "
        f"you (uid {os.geteuid()}); remove it, or {OWN_CACHE}"
    )
    if os.geteuid() == 0:
        assert list(root.iterdir()) == []  # nothing was built into it


def test_build_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no C compiler found") as err:
        build_module(tmp_path, cc="no-such-cc-anywhere")
    assert "`build-module --cc COMPILER`" in str(err.value)  # the CLI's own flag
    with pytest.raises(RuntimeError, match="failed"):
        build_module(tmp_path, cc="false")
    assert list(tmp_path.iterdir()) == []
    cli = subprocess.run(
        [sys.executable, "-m", "goblin_idem", "build-module", "--out", str(tmp_path)],
        env={**os.environ, "CC": "no-such-cc-anywhere"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 1 and "--cc COMPILER" in cli.stderr


def test_cli_prints_the_path_last(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "goblin_idem", "build-module", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(out.strip().splitlines()[-1])
    assert path == (tmp_path / "goblin.so").absolute() and os.access(path, os.X_OK)


def as_map(reply: Any) -> dict[Any, Any]:
    """A map reply as redis-py gives it: a dict (redis-py 8), or the flat list of pairs
    earlier releases give for a RESP2 map."""
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
