"""`goblin_idem.forget` and ``python -m goblin_idem forget`` with SQL records: the claim, the
stored response and the record row go together, so the key's next request runs again; a key
in flight is refused. On each database with its store (tests/sql/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from goblin_idem import InFlightError, forget
from goblin_idem._keys import key_names
from goblin_idem.inspection import names_for_hash
from tests.sql.conftest import Setup
from tests.support.apps.sql_app import Gate, build
from tests.support.asgi import Reply, request
from tests.test_forget import RunLandsFirst

ROOT = Path(__file__).resolve().parents[2]


async def pay(app: Any, key: str, ref: str, mode: str | None = None) -> Reply:
    body = json.dumps({"ref": ref, "amount": 10, "mode": mode}).encode()
    headers = [("content-type", "application/json")]
    return await request(app, "POST", "/payments", key=key, body=body, headers=headers)


def replayed(reply: Reply) -> bool:
    return reply.header("idempotent-replayed") == b"true"


async def stored(setup: Setup, key: str) -> tuple[bool, bool, int]:
    """Whether the store holds the key's claim and result, and how many record rows."""
    names = key_names(b"idem", b"", key.encode())
    client = setup.store.client
    claim = await client.exists(names.claim)  # type: ignore[union-attr]
    result = await client.exists(names.result)  # type: ignore[union-attr]
    return bool(claim), bool(result), len(await setup.rows())


async def test_forget_removes_claim_result_and_record_and_the_key_runs_again(
    setup: Setup,
) -> None:
    app = build(setup.store, setup.records, setup.payments)
    first = await pay(app, "k1", "p1")
    assert first.status == 201 and await stored(setup, "k1") == (True, True, 1)
    assert await forget(setup.store, "k1", records=setup.records) is True
    assert await stored(setup, "k1") == (False, False, 0)
    assert await forget(setup.store, "k1", records=setup.records) is False  # nothing left
    again = await pay(app, "k1", "p1")
    assert again.status == 201 and not replayed(again) and again.body != first.body
    assert await setup.payment_count("p1") == 2  # forgotten on purpose: it ran again
    assert await stored(setup, "k1") == (True, True, 1)


async def test_a_record_the_store_lost_is_forgotten_too(setup: Setup) -> None:
    """With the store flushed, the row alone would answer the next request (and be
    published back): forget removes it, found by the key hash a log line shows."""
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    await setup.store.client.flushall()  # type: ignore[union-attr]
    names = names_for_hash(key_names(b"idem", b"", b"k1").hash)
    assert await forget(setup.store, names=names, records=setup.records) is True
    again = await pay(app, "k1", "p1")
    assert again.status == 201 and not replayed(again)
    assert await setup.payment_count("p1") == 2


async def test_a_key_in_flight_is_not_forgotten(setup: Setup) -> None:
    gate = Gate()
    app = build(setup.store, setup.records, setup.payments, gate=gate)
    running = asyncio.ensure_future(pay(app, "k1", "g1", "gate"))
    await gate.events("g1")[0].wait()
    with pytest.raises(InFlightError, match="in flight") as caught:
        await forget(setup.store, "k1", records=setup.records)
    assert 0 < caught.value.retry_after <= 30
    gate.events("g1")[1].set()
    assert (await running).status == 201
    assert await stored(setup, "k1") == (True, True, 1)  # the run was left alone


async def test_a_key_completed_in_sql_whose_store_holds_only_its_claim_is_forgotten(
    setup: Setup,
) -> None:
    """The store lost the result (or the publish failed) and keeps the run's claim: the
    record says the run committed, so the key is completed, not in flight."""
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    await setup.store.client.delete(key_names(b"idem", b"", b"k1").result)  # type: ignore[union-attr]
    assert await stored(setup, "k1") == (True, False, 1)
    assert await forget(setup.store, "k1", records=setup.records) is True
    assert await stored(setup, "k1") == (False, False, 0)
    again = await pay(app, "k1", "p1")
    assert again.status == 201 and not replayed(again)
    assert await setup.payment_count("p1") == 2


async def test_a_first_run_landing_as_forget_starts_leaves_store_and_database_agreeing(
    setup: Setup,
) -> None:
    """The key's first run claims, commits its record and publishes right after forget's
    first call to the store: afterwards the store and the database hold the key together or
    not at all, and the next request is answered by whichever holds it."""
    app = build(setup.store, setup.records, setup.payments)
    names = key_names(b"idem", b"", b"k1")
    store = RunLandsFirst.from_url(_store_url(setup))
    store.watched, store.land = names.claim, lambda: pay(app, "k1", "p1")
    try:
        assert await forget(store, "k1", records=setup.records) is True
        assert store.landed
    finally:
        await store.aclose()
    claim, result, rows = await stored(setup, "k1")
    assert (claim, result, rows) in ((False, False, 0), (True, True, 1))
    again = await pay(app, "k1", "p1")
    assert again.status == 201
    assert replayed(again) is result  # forgotten: it runs again; else the first run's answer
    assert await setup.payment_count("p1") == (1 if result else 2)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "goblin_idem", "forget", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("GOBLIN_SCOPE", "DATABASE_URL")},
        timeout=60,
    )


async def test_the_forget_command(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    store_url = _store_url(setup)
    table = ("--database-url", setup.url, "--table", setup.records.table.name)
    done = await asyncio.to_thread(cli, "--url", store_url, *table, "k1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "forgotten"
    assert await stored(setup, "k1") == (False, False, 0)
    again = await asyncio.to_thread(cli, "--url", store_url, *table, "k1")
    assert again.returncode == 0 and again.stdout.strip() == "nothing was stored for this key"
    assert (await asyncio.to_thread(cli, "--url", store_url)).returncode == 2  # no KEY


async def test_the_forget_command_without_a_database_removes_nothing_and_says_so(
    setup: Setup,
) -> None:
    """Forgetting the store alone would print "forgotten" while the record goes on
    answering the key: without --database-url (or --store-only) nothing is removed."""
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    refused = await asyncio.to_thread(cli, "--url", _store_url(setup), "k1")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "--database-url" in refused.stderr and "Nothing was removed" in refused.stderr
    assert await stored(setup, "k1") == (True, True, 1)
    again = await pay(app, "k1", "p1")
    assert replayed(again) and await setup.payment_count("p1") == 1


def _store_url(setup: Setup) -> str:
    kwargs = setup.store.client.connection_pool.connection_kwargs  # type: ignore[union-attr]
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"
