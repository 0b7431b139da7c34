"""The keys a claimed run sends another API, against a real one: `once` runs on a
redis-server call a card processor under uvicorn with the middleware
(tests/support/apps/card_app.py) through the httpx transports.

A call's derived key is named by its label: a re-run that skips a conditional call (a fee
the first run paid) or makes concurrent calls in another order still sends each call its
own key, so the processor charges each call once and never answers one call with another's
charge; a call without a label inside a run is refused before it is sent."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from goblin_idem import RedisStore, once
from goblin_idem._threads._loop import loop_thread
from goblin_idem.client import AsyncIdempotentTransport, IdempotentTransport
from tests.support.procs import start_uvicorn, stop
from tests.support.servers import Server, free_port


class Card:
    """The card processor's URL, and what it charged (read from its server)."""

    def __init__(self, url: str, control: redis.Redis) -> None:
        self.url = url
        self.control = control

    def charges(self, account: str) -> list[str]:
        return [c.decode() for c in self.control.lrange(f"card:charges:{account}", 0, -1)]

    def requests(self) -> int:
        return int(self.control.get("card:requests") or 0)


@pytest.fixture(scope="module")
def card(redis_server: Server) -> Iterator[Card]:
    port = free_port()
    proc = start_uvicorn(
        port, {"REDIS_URL": redis_server.url}, app="tests.support.apps.card_app:app"
    )
    control = redis_server.sync_client()
    try:
        yield Card(f"http://127.0.0.1:{port}", control)
    finally:
        stop(proc)
        control.close()


@pytest.fixture
async def store(redis_server: Server) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(redis_server.url)
    yield s
    await s.aclose()


def label(name: str) -> dict[str, Any]:
    return {"idempotency_label": name}


class Crash(Exception):
    """The run dies here (its claim is released, the next call runs it again)."""


def shop(
    store: RedisStore, card: Card, crash_after: list[str], equal_bodies: bool
) -> tuple[Any, httpx.AsyncClient]:
    """An order handler: a fee first if the shop's own ledger has none for `ref`, then the
    order, each through the async transport with a label. Its runs crash after the calls
    `crash_after` names, one each, in that order."""
    client = httpx.AsyncClient(transport=AsyncIdempotentTransport(), base_url=card.url)

    @once(store, key=lambda ref: ref, name="shop.order")
    async def order(ref: str) -> dict[str, Any]:
        fee_body = {"account": ref if equal_bodies else f"{ref}-fees", "amount": 100}
        order_body = {"account": ref if equal_bodies else f"{ref}-orders", "amount": 100}
        if not card.control.get(f"shop:fee:{ref}"):  # the shop's own ledger
            fee = await client.post("/charges", json=fee_body, extensions=label("fee"))
            card.control.set(f"shop:fee:{ref}", fee.json()["charge"])
            if crash_after[:1] == ["fee"]:
                raise Crash(crash_after.pop(0))
        answer = await client.post("/charges", json=order_body, extensions=label("order"))
        if crash_after[:1] == ["order"]:
            raise Crash(crash_after.pop(0))
        return {**answer.json(), "replayed": answer.extensions["idempotency"]["replayed"]}

    return order, client


@pytest.mark.parametrize("equal_bodies", [False, True], ids=["bodies-differ", "bodies-equal"])
async def test_a_rerun_that_skips_the_fee_charges_the_order_once_with_its_own_key(
    store: RedisStore, card: Card, equal_bodies: bool
) -> None:
    """Run 1 charges the fee and dies; run 2 sees the fee paid, charges the order and dies;
    run 3 sends the order again. The order is charged once, never answered with the fee."""
    ref = f"o-{secrets.token_hex(4)}"
    order, client = shop(store, card, ["fee", "order"], equal_bodies)
    with pytest.raises(Crash, match="fee"):
        await order(ref)
    with pytest.raises(Crash, match="order"):
        await order(ref)
    third = await order(ref)
    fee = card.control.get(f"shop:fee:{ref}").decode()
    assert third["charge"] != fee  # the order's own charge, not the fee's answer
    assert third["replayed"] is True  # run 2's order charge, answered again to run 3
    if equal_bodies:
        assert card.charges(ref) == [fee, third["charge"]]
    else:
        assert card.charges(f"{ref}-fees") == [fee]
        assert card.charges(f"{ref}-orders") == [third["charge"]]
    assert await order(ref) == third  # the stored value: nothing charged again
    await client.aclose()


async def test_concurrent_calls_in_another_order_keep_their_keys(
    store: RedisStore, card: Card
) -> None:
    """Two labelled calls at once; the re-run makes them in the other order. Each gets its
    own charge back (the account it asked for), each charged once."""
    ref = f"g-{secrets.token_hex(4)}"
    client = httpx.AsyncClient(transport=AsyncIdempotentTransport(), base_url=card.url)
    runs: list[int] = []

    @once(store, key=lambda r: r, name="shop.lines")
    async def lines(r: str) -> list[dict[str, Any]]:
        runs.append(1)
        names = ["line-1", "line-2"] if len(runs) == 1 else ["line-2", "line-1"]
        answers = await asyncio.gather(
            *(
                client.post(
                    "/charges", json={"account": f"{r}-{n}", "amount": 5}, extensions=label(n)
                )
                for n in names
            )
        )
        if len(runs) == 1:
            raise Crash("after both lines")
        return [{**a.json(), "replayed": a.extensions["idempotency"]["replayed"]} for a in answers]

    with pytest.raises(Crash):
        await lines(ref)
    second = await lines(ref)
    assert [a["account"] for a in second] == [f"{ref}-line-2", f"{ref}-line-1"]
    assert all(a["replayed"] for a in second)
    for a in second:
        assert card.charges(a["account"]) == [a["charge"]]
    await client.aclose()


async def test_an_unlabelled_call_in_a_run_is_refused_before_it_is_sent(
    store: RedisStore, card: Card
) -> None:
    """The fee/order handler without labels: a key by position would hand a re-run's order
    the fee's key. Refused at the first call, naming what to pass; nothing reaches the card
    processor, and the run stores nothing (the next call runs again)."""
    ref = f"u-{secrets.token_hex(4)}"
    client = httpx.AsyncClient(transport=AsyncIdempotentTransport(), base_url=card.url)
    runs: list[int] = []

    @once(store, key=lambda r: r, name="shop.unlabelled")
    async def order(r: str) -> None:
        runs.append(1)
        await client.post("/charges", json={"account": f"{r}-fees", "amount": 100})
        raise Crash("after the fee")

    @once(store, key=lambda r: r, name="shop.gather")
    async def both(r: str) -> None:
        await asyncio.gather(
            *(client.post("/charges", json={"account": f"{r}-{n}", "amount": 1}) for n in "ab")
        )

    before = card.requests()
    for _ in range(2):
        with pytest.raises(TypeError, match="idempotency_label") as refused:
            await order(ref)
        assert "POST /charges" in str(refused.value) and "Nothing was sent" in str(refused.value)
    with pytest.raises(TypeError, match="idempotency_label"):
        await both(ref)
    assert len(runs) == 2  # each call ran the function: the refusal released the claim
    assert card.requests() == before
    await client.aclose()


def test_the_sync_transport_names_calls_alike(redis_server: Server, card: Card) -> None:
    """The fee/order re-run through the sync transport in a plain def; and its unlabelled call
    refused."""
    ref = f"s-{secrets.token_hex(4)}"
    store = RedisStore.from_url(redis_server.url)
    client = httpx.Client(transport=IdempotentTransport(), base_url=card.url)
    crashes = ["fee"]

    @once(store, key=lambda r: r, name="shop.sync")
    def order(r: str) -> dict[str, Any]:
        if not card.control.get(f"shop:fee:{r}"):
            fee = client.post("/charges", json={"account": r, "amount": 9}, extensions=label("fee"))
            card.control.set(f"shop:fee:{r}", fee.json()["charge"])
            if crashes:
                raise Crash(crashes.pop())
        answer = client.post(
            "/charges", json={"account": r, "amount": 9}, extensions=label("order")
        )
        return {**answer.json(), "replayed": answer.extensions["idempotency"]["replayed"]}

    @once(store, key=lambda r: r, name="shop.sync-unlabelled")
    def unlabelled(r: str) -> None:
        client.post("/charges", json={"account": r, "amount": 9})

    try:
        with pytest.raises(Crash):
            order(ref)
        second = order(ref)
        fee = card.control.get(f"shop:fee:{ref}").decode()
        assert second["charge"] != fee and second["replayed"] is False
        assert card.charges(ref) == [fee, second["charge"]]
        before = card.requests()
        with pytest.raises(TypeError, match="idempotency_label"):
            unlabelled(ref)
        assert card.requests() == before
    finally:
        client.close()
        loop_thread().run(store.aclose())


def charge_in(
    store: RedisStore, card: Card, namespace: str, calls: list[tuple[str, str]]
) -> Callable[[str], Any]:
    """A `once` function named alike in every namespace, making `calls` (query, label)."""
    client = httpx.AsyncClient(transport=AsyncIdempotentTransport(), base_url=card.url)

    @once(store, key=lambda r: r, name="shop.charge", namespace=namespace)
    async def run(r: str) -> list[dict[str, Any]]:
        answers = []
        for query, name in calls:
            body = {"account": r, "amount": 3}
            answer = await client.post(f"/charges?{query}", json=body, extensions=label(name))
            answers.append(
                {**answer.json(), "replayed": answer.extensions["idempotency"]["replayed"]}
            )
        await client.aclose()
        return answers

    return run


async def test_two_namespaces_with_one_key_send_two_keys(store: RedisStore, card: Card) -> None:
    """Two services (namespaces) that see the same key and scope are two pieces of work:
    the namespace is in the derivation, so each is charged."""
    ref = f"n-{secrets.token_hex(4)}"
    first = await charge_in(store, card, "shop-a", [("n=1", "charge")])(ref)
    second = await charge_in(store, card, "shop-b", [("n=1", "charge")])(ref)
    assert first[0]["replayed"] is False and second[0]["replayed"] is False
    assert card.charges(ref) == [first[0]["charge"], second[0]["charge"]]


async def test_url_and_label_pairs_that_concatenate_alike_send_two_keys(
    store: RedisStore, card: Card
) -> None:
    """(URL ``…?n=1``, label ``xLy``) and (``…?n=1Lx``, ``y``) feed the same bytes unless
    each field is length-prefixed: two calls, two charges."""
    ref = f"p-{secrets.token_hex(4)}"
    answers = await charge_in(store, card, "shop", [("n=1", "xLy"), ("n=1Lx", "y")])(ref)
    assert [a["query"] for a in answers] == ["n=1", "n=1Lx"]
    assert [a["replayed"] for a in answers] == [False, False]
    assert card.charges(ref) == [a["charge"] for a in answers]
