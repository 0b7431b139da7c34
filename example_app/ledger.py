"""A toy ledger kept in the same store as the idempotency keys, for the stream worker
(`example_app.worker`), whose `once` has no database. The HTTP app keeps its payments in
SQL instead, committed with its records (`example_app.payments`), in the same shape.

It exists to make a double charge visible: every charge adds to the account's balance and
to the list of payments made under its Idempotency-Key, so a key that ran twice shows two
payment ids and a balance that is too high.

Every write is a read-modify-write made safe by `Store.cas` (compare-and-set, keeping the
key's TTL) in an optimistic loop, so it stays correct with several processes on one Redis.
The ledger is not transactional across keys: a process killed between the writes of one
charge leaves them half done. The handlers do all their slow work before the first write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from goblin_idem import Store

__all__ = [
    "ContentionError",
    "Payment",
    "cas_update",
    "charge",
    "get_payment",
    "ledger_view",
    "view",
]

PREFIX = "ledger"
COUNTER = f"{PREFIX}:payments"
ACCOUNTS = f"{PREFIX}:accounts"


class ContentionError(RuntimeError):
    """An optimistic update lost the race too many times in a row."""


def _payment_key(payment_id: str) -> str:
    return f"{PREFIX}:payment:{payment_id}"


def _account_key(account: str) -> str:
    return f"{PREFIX}:account:{account}"


async def cas_update(
    store: Store,
    key: str,
    update: Callable[[bytes | None], bytes],
    *,
    attempts: int = 1000,
) -> bytes:
    """Apply `update` (old value or None -> new value) to `key` atomically; return the new value.

    Read, compute, then swap only if nobody changed the key since (CAS); a missing key is
    created with SET NX, since CAS never creates one. Lost races are retried.
    """
    for _ in range(attempts):
        current = await store.get(key)
        new = update(current)
        if current is None:
            if await store.set(key, new, nx=True):
                return new
        elif await store.cas(key, current, new):
            return new
    raise ContentionError(f"{key}: gave up after {attempts} lost races")


@dataclass(frozen=True, slots=True)
class Payment:
    id: str
    account: str
    amount_cents: int
    currency: str
    created: str
    idempotency_key: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "account": self.account,
            "amount_cents": self.amount_cents,
            "currency": self.currency,
            "created": self.created,
        }


def _increment(old: bytes | None) -> bytes:
    return str(int(old or b"0") + 1).encode()


async def charge(
    store: Store,
    account: str,
    amount_cents: int,
    currency: str,
    idempotency_key: str | None,
) -> Payment:
    """Record one payment: a new id, the payment record, the account's balance and index."""
    number = int(await cas_update(store, COUNTER, _increment))
    payment = Payment(
        id=f"pay_{number:06d}",
        account=account,
        amount_cents=amount_cents,
        currency=currency,
        created=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        idempotency_key=idempotency_key,
    )
    await store.set(_payment_key(payment.id), json.dumps(payment.as_dict()))

    def add(old: bytes | None) -> bytes:
        doc: dict[str, Any] = (
            json.loads(old) if old else {"balances": {}, "payments": 0, "by_key": {}}
        )
        doc["balances"][currency] = doc["balances"].get(currency, 0) + amount_cents
        doc["payments"] += 1
        if idempotency_key is not None:
            doc["by_key"].setdefault(idempotency_key, []).append(payment.id)
        return json.dumps(doc, sort_keys=True).encode()

    await cas_update(store, _account_key(account), add)

    def register(old: bytes | None) -> bytes:
        accounts: list[str] = json.loads(old) if old else []
        if account not in accounts:
            accounts.append(account)
        return json.dumps(sorted(accounts)).encode()

    await cas_update(store, ACCOUNTS, register)
    return payment


async def get_payment(store: Store, payment_id: str) -> dict[str, Any] | None:
    data = await store.get(_payment_key(payment_id))
    return None if data is None else dict(json.loads(data))


async def ledger_view(store: Store, account: str | None = None) -> dict[str, Any]:
    """Balances, payment counts, and the payment ids made under each Idempotency-Key."""
    if account is not None:
        names = [account]
    else:
        raw = await store.get(ACCOUNTS)
        names = json.loads(raw) if raw else []
    accounts: dict[str, Any] = {}
    for name in names:
        raw = await store.get(_account_key(name))
        if raw is not None:
            accounts[name] = json.loads(raw)
    count = await store.get(COUNTER)
    return view(int(count or b"0"), accounts)


def view(total: int, accounts: dict[str, Any]) -> dict[str, Any]:
    """The ledger as ``GET /ledger`` shows it, with every key that charged more than once."""
    return {
        "payments_total": total,
        "accounts": accounts,
        "duplicate_charges": {
            f"{name}/{key}": ids
            for name, doc in accounts.items()
            for key, ids in doc["by_key"].items()
            if len(ids) > 1
        },
    }
