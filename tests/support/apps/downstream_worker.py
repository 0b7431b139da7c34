"""The `once` side of the derived-key tests: a plain function that charges a card at
service B (downstream_app.py) through the sync client transport, as a Celery task or
called in the test's own process.

``pay(ref, mode)`` counts its run (``runs:a:<ref>``), charges through B, notes
``answered:<ref>:<run>``, and returns B's charge id, whether B replayed it, and its run. Its
first run then, by `mode`: ``raise`` (fails after B answered), ``hold`` (waits until the
test pushes to ``go:<ref>``: a worker killed there has charged and stored nothing). Its
store keys are the same in every process (the function is named), so a second run
anywhere derives the same key for B.

As a Celery app (``celery -A``, with ``B_URL`` set): tests/support/apps/celery_app.py's, with
``pay`` added (``REDIS_URL`` is broker, result backend and store, ``B_URL`` is B).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx
import redis
from celery import Celery

from goblin_idem import RedisStore, once
from goblin_idem.client import IdempotentTransport, RetryPolicy
from tests.support.apps import counting

NAME = "downstream.pay"
LEASE_SECONDS = 1


def make_pay(store: RedisStore, b_url: str, control: redis.Redis) -> Callable[..., Any]:
    transport = IdempotentTransport(policy=RetryPolicy(max_attempts=3, base_delay=0.1))
    b = httpx.Client(transport=transport, base_url=b_url, timeout=30)

    @once(
        store,
        key=lambda ref, mode: ref,
        name=NAME,
        lease_seconds=LEASE_SECONDS,
        wait_seconds=10,
    )
    def pay(ref: str, mode: str) -> dict[str, Any]:
        run = counting.count(f"a:{ref}")
        answer = b.post(
            "/charges", json={"ref": ref, "amount": 7}, extensions={"idempotency_label": "charge"}
        )
        answer.raise_for_status()
        charge = answer.json()["charge"]
        control.set(f"answered:{ref}:{run}", charge)
        if run == 1 and mode == "raise":
            raise RuntimeError("the order failed after the card was charged")
        if run == 1 and mode == "hold":
            control.blpop([f"go:{ref}"])
        replayed = answer.extensions["idempotency"]["replayed"]
        return {"charge": charge, "replayed": replayed, "run": run}

    return pay


def _celery() -> Celery | None:
    """celery_app's app (its broker settings: acknowledged late, redelivered 2 s after a
    worker died), with ``pay`` registered on it."""
    if "B_URL" not in os.environ:
        return None
    from tests.support.apps.celery_app import app as celery

    url = os.environ["REDIS_URL"]
    pay = make_pay(RedisStore.from_url(url), os.environ["B_URL"], redis.Redis.from_url(url))
    celery.task(name="pay")(pay)
    return celery


app = _celery()
