"""A fake card processor: the second service `POST /payments` calls, as a shop calls a
payment API. It is an app of its own with its own middleware and store (a MemoryStore,
namespace ``card``), run inside the example app's process and reached through httpx's ASGI
transport wrapped in `goblin_idem.client.AsyncIdempotentTransport`, as a real client would
reach a real processor over the network.

``POST /charges`` ``{"account", "amount_cents", "currency"}`` makes one charge (201,
``{"id": "ch_000001", ...}``); ``GET /charges?account=`` lists what it charged. The
payments handler sends no key of its own, only the call's label (``charge``): inside its
run, the transport derives the key from the run's claim and that label, so a second run
of the same payment (its first one failed after the charge, its worker paused past its
lease, its claim lost with a store) sends the same key and the processor answers from its
record. Charges are kept in memory, like the store.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
from fastapi import FastAPI
from pydantic import BaseModel, Field

from goblin_idem import IdempotencyMiddleware, MemoryStore
from goblin_idem.client import AsyncIdempotentTransport, RetryPolicy

__all__ = ["CardProcessor"]

BASE_URL = "http://card.invalid"  # reached in process: no request leaves it


class ChargeIn(BaseModel):
    account: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0)
    currency: str = Field(pattern=r"^[A-Z]{3}$")


class CardProcessor:
    """The processor's app and the client the payments handler calls it with."""

    def __init__(self) -> None:
        self.charges: list[dict[str, Any]] = []
        self.app = self._build()
        transport = AsyncIdempotentTransport(
            httpx.ASGITransport(app=self.app), policy=RetryPolicy(max_attempts=3)
        )
        self.client = httpx.AsyncClient(transport=transport, base_url=BASE_URL)

    def _build(self) -> FastAPI:
        app = FastAPI(title="fake card processor")
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), namespace="card")
        numbers = itertools.count(1)

        @app.post("/charges", status_code=201)
        async def create_charge(body: ChargeIn) -> dict[str, Any]:
            charge = {"id": f"ch_{next(numbers):06d}", **body.model_dump()}
            self.charges.append(charge)
            return charge

        return app

    async def charge(self, account: str, amount_cents: int, currency: str) -> str:
        """Charge through the processor; its charge id. No key is passed: see the module."""
        body = {"account": account, "amount_cents": amount_cents, "currency": currency}
        response = await self.client.post(
            "/charges", json=body, extensions={"idempotency_label": "charge"}
        )
        response.raise_for_status()
        charge_id: str = response.json()["id"]
        return charge_id

    def charges_of(self, account: str | None) -> list[dict[str, Any]]:
        return [c for c in self.charges if account is None or c["account"] == account]

    async def aclose(self) -> None:
        await self.client.aclose()
