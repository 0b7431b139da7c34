"""A Celery app for the sync `once` tests: Redis (REDIS_URL) as broker, result backend and
store; tasks acknowledged late, and redelivered 2 s after a worker that took them died.

``charge(event_id, work_ms, after_ms)`` runs the `once` function ``charge_once`` (which
counts ``started:<id>``, works for `work_ms`, checks its claim, then counts
``committed:<id>``), then waits `after_ms` before the task returns and is acknowledged:
a worker killed then has done the work and stored its value, but not acknowledged. A
redelivered task neither works nor waits (counts are kept in tests.support.apps.counting).
``refund(order, cents)`` runs ``refund_once``, keyed by the order alone: a task sent again
with other cents reuses the key with other arguments.
A call while another run holds the key waits for it (`wait_seconds`): for its value, or
for its lease to run out if its worker died, and then runs."""

from __future__ import annotations

import os
import time

from celery import Celery, Task

from goblin_idem import RedisStore, current_claim, once
from tests.support.apps import counting

URL = os.environ["REDIS_URL"]

app = Celery("goblin_idem_tests", broker=URL, backend=URL)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 2,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 1,  # a worker killed while it held the mutex
    },
)
store = RedisStore.from_url(URL)


# fingerprint=False: `work_ms` is this test's knob (a redelivery passes 0), not the request.
@once(
    store,
    key=lambda event_id, work_ms: event_id,
    lease_seconds=1,
    wait_seconds=10,
    fingerprint=False,
)
def charge_once(event_id: str, work_ms: int) -> dict[str, int]:
    started = counting.count(f"started:{event_id}")
    time.sleep(work_ms / 1000)
    claim = current_claim()
    assert claim is not None
    claim.ensure_owned()
    return {"started": started, "committed": counting.count(f"committed:{event_id}")}


@app.task(name="charge", bind=True)
def charge(self: Task, event_id: str, work_ms: int = 0, after_ms: int = 0) -> dict[str, int]:
    again = bool((self.request.delivery_info or {}).get("redelivered"))
    value = charge_once(event_id, 0 if again else work_ms)
    time.sleep(0 if again else after_ms / 1000)
    return value


@once(store, key=lambda order, cents: order)
def refund_once(order: str, cents: int) -> dict[str, int]:
    return {"cents": cents, "run": counting.count(f"refunds:{order}")}


@app.task(name="refund")
def refund(order: str, cents: int) -> dict[str, int]:
    return refund_once(order, cents)
