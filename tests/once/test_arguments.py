"""`once` compares a reused key's arguments by value (`once/_arguments.py`), on a real
redis-server: a value of any kind that differs raises KeyReusedError and runs nothing, the
same value spelled otherwise is the same call, and an argument that has no value to compare
is refused at the call, with nothing claimed."""

from __future__ import annotations

import decimal
import fractions
import ipaddress
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import numpy as np
import pytest

from goblin_idem import KeyReusedError, RedisStore, once
from goblin_idem._keys import key_names
from tests.support.servers import Server


@pytest.fixture
async def store(redis_server: Server) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(redis_server.url)
    yield s
    await s.aclose()


@attrs.define
class Refund:
    order: str
    cents: int


class Slotted:
    __slots__ = ("cents", "order")

    def __init__(self, order: str, cents: int) -> None:
        self.order = order
        self.cents = cents


class Plain:
    def __init__(self, order: str, cents: int, **extra: Any) -> None:
        self.order = order
        self.cents = cents
        self.__dict__.update(extra)


class Holder:
    """An object whose state holds something with no value: a lock."""

    def __init__(self) -> None:
        self.pool = {"lock": threading.Lock()}


def tax(amount: int) -> int:
    return amount // 10


def vat(amount: int) -> int:
    return amount // 5


counter = 0


def unique(name: str) -> str:
    global counter
    counter += 1
    return f"{name}-{counter}"


def charge_with(
    store: RedisStore, runs: list[Any], name: str = "", **options: Any
) -> Callable[..., Any]:
    @once(store, key=lambda k, *_, **__: k, name=name or unique("charge"), **options)
    async def charge(k: str, amount: Any, note: Any = None) -> int:
        runs.append(amount)
        return len(runs)

    return charge


# (first, the same value spelled otherwise, another value): each a call's `amount`.
VALUES = {
    "numpy-int": (np.int64(500), 500, np.int64(999)),
    "whole-numbers": (500, [500.0, decimal.Decimal("500.00"), np.float32(500)], 501),
    "fraction": (
        fractions.Fraction(1, 2),
        [0.5, decimal.Decimal("0.50")],
        fractions.Fraction(1, 3),
    ),
    "float": (0.1, [np.float64(0.1)], np.float32(0.1)),
    "complex": (complex(1, 2), [np.complex128(1 + 2j)], complex(1, 3)),
    "real-complex": (complex(7, 0), [7], complex(7, 1)),
    "numpy-array": (np.array([1, 2]), [np.array([1, 2])], np.array([1, 3])),
    "array-shape": (np.array([[1, 2]]), [np.array([[1, 2]])], np.array([1, 2])),
    "array-dtype": (
        np.array([1, 2]),
        [np.array([1, 2], dtype=np.int64)],
        np.array([1, 2], np.int32),
    ),
    "numpy-bool": (np.bool_(True), [True], np.bool_(False)),
    "path": (Path("/srv/a"), [PurePosixPath("/srv/a/")], Path("/srv/b")),
    "ip-address": (ipaddress.ip_address("10.0.0.1"), [], ipaddress.ip_address("10.0.0.2")),
    "ip-network": (ipaddress.ip_network("10.0.0.0/8"), [], ipaddress.ip_interface("10.0.0.0/8")),
    "attrs": (Refund("o", 5), [Refund("o", 5)], Refund("o", 6)),
    "slots": (Slotted("o", 5), [Slotted("o", 5)], Slotted("o", 6)),
    "plain": (Plain("o", 5), [Plain("o", 5)], Plain("o", 5, reason="dup")),
    "nested": ([Plain("o", Refund("o", 5))], [(Plain("o", Refund("o", 5)),)], [Plain("o", 1)]),
    "function": (tax, [tax], vat),
}


@pytest.mark.parametrize("kind", list(VALUES))
async def test_a_value_that_differs_raises_and_the_same_value_is_the_same_call(
    store: RedisStore, kind: str
) -> None:
    first, same, other = VALUES[kind]
    runs: list[Any] = []
    charge = charge_with(store, runs)
    assert await charge("k", first) == 1
    for spelled in same if isinstance(same, list) else [same]:
        assert await charge("k", spelled) == 1  # the stored value: nothing ran
    with pytest.raises(KeyReusedError, match="first used with other arguments"):
        await charge("k", other)
    assert len(runs) == 1


async def test_a_default_left_out_or_given_is_one_call(store: RedisStore) -> None:
    runs: list[Any] = []

    @once(store, key=lambda k, *_, **__: k, name=unique("defaults"))
    async def refund(k: str, cents: int, reason: str = "duplicate") -> int:
        runs.append(cents)
        return len(runs)

    assert await refund("k", 5) == 1
    assert await refund("k", 5, reason="duplicate") == 1
    assert await refund("k", cents=5, reason="duplicate") == 1
    with pytest.raises(KeyReusedError):
        await refund("k", 5, reason="fraud")
    assert runs == [5]


def a_socket() -> socket.socket:
    s = socket.socket()
    s.close()  # a closed one has no more value than an open one
    return s


def self_referring() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


UNCOMPARABLE = {
    "lock": (threading.Lock, "argument 'amount' (_thread.lock)"),
    "generator": (lambda: (n for n in range(3)), "argument 'amount' (builtins.generator)"),
    "lambda": (lambda: lambda n: n, "argument 'amount' (builtins.function)"),
    "socket": (a_socket, "argument 'amount' (socket.socket)"),
    "inside-an-object": (Holder, "argument 'amount' (at .pool['lock'], _thread.lock)"),
    "inside-a-note": (lambda: None, "argument 'note' (at [1], _thread.lock)"),
    "self-referring": (self_referring, "argument 'amount' (at [0], builtins.list)"),
}


@pytest.mark.parametrize("kind", list(UNCOMPARABLE))
async def test_an_argument_without_a_value_is_refused_at_the_call(
    store: RedisStore, redis_server: Server, kind: str
) -> None:
    """Never a silent "same": TypeError naming the argument and fingerprint=, before the
    claim (the store holds nothing of the key); fingerprint= a function of the arguments,
    or False, is what to do instead."""
    make, where = UNCOMPARABLE[kind]
    runs: list[Any] = []
    name = unique("refused")
    charge = charge_with(store, runs, name)
    note = [1, threading.Lock()] if kind == "inside-a-note" else None
    with pytest.raises(TypeError, match="fingerprint=") as refused:
        await charge("k", make(), note)
    assert f"once cannot compare {where} by value" in str(refused.value)
    assert "fingerprint=False" in str(refused.value)
    assert runs == []
    names = key_names(b"once", name.encode(), b"k")
    control = redis_server.sync_client()
    try:
        assert control.exists(names.claim, names.result) == 0  # nothing claimed
    finally:
        control.close()

    chosen = charge_with(store, runs, fingerprint=lambda k, amount, note=None: k)
    assert await chosen("k", make(), note) == 1
    assert await chosen("k", make(), note) == 1
    unfingerprinted = charge_with(store, runs, fingerprint=False)
    assert await unfingerprinted("k", make(), note) == 2


async def test_what_fingerprint_returns_is_compared_and_refused_alike(store: RedisStore) -> None:
    runs: list[Any] = []
    charge = charge_with(store, runs, fingerprint=lambda k, amount, note=None: (k, note))
    assert await charge("k", threading.Lock(), "a") == 1
    with pytest.raises(KeyReusedError):
        await charge("k", threading.Lock(), "b")
    locked = charge_with(store, runs, fingerprint=lambda k, amount, note=None: amount)
    with pytest.raises(TypeError, match="the value fingerprint= returned"):
        await locked("k", threading.Lock())
    with pytest.raises(TypeError, match="fingerprint must be True, False, or a function"):
        once(store, key=lambda k: k, fingerprint="no")  # type: ignore[arg-type]
