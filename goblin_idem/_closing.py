"""The closing steps of a claimed run, shared by the middleware and `once`: publish the
result (retried while the claim still keeps duplicates out), or free the claim; and
`run_to_end`, which keeps a cancelled caller from cutting either short."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    DataError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from ._keys import KeyNames
from ._lease import Lease
from ._log import describe
from .store import Published, Store

__all__ = [
    "ClosingStep",
    "free_claim",
    "publish_deadline",
    "publish_retried",
    "run_to_end",
    "start_again",
]

logger = logging.getLogger("goblin_idem.claim")

ClosingStep = Callable[[], Coroutine[Any, Any, None]]

#: Refusals a server gives only for now: a slot migrating, the cluster down, a primary
#: demoted to a replica by a failover.
TRANSIENT_REFUSALS = (TryAgainError, ClusterDownError, ReadOnlyError)

# A publish that failed is sent again after a pause that starts here and doubles up to
# the cap (the middleware's and once's), until `publish_deadline`.
PUBLISH_FIRST_PAUSE = 0.05
PUBLISH_MAX_PAUSE = 0.2


def publish_deadline(lease: Lease) -> float:
    """When a publish stops being retried (time.monotonic()): a third of the lease before
    the claim would expire, counted from its last successful renewal (or from when it was
    held).

    Until then the claim keeps duplicates out, so a publish that lands after a store
    restart, a failover or a slot's migration still makes them replay; the third left
    covers the last attempt (up to a socket timeout if the store does not answer) and the
    claim's own round trip. The watchdog renews at a third of the lease, so a publish is
    retried for a third to two thirds of it (less if renewals were failing): for the
    default 30 s lease 10 to 20 s, and a client waits for the end of its response at most
    20 s plus one socket timeout (5 s by `from_url`'s default)."""
    return lease.renewed_at + lease.ms * 2 / 3000


async def publish_retried(
    store: Store,
    names: KeyNames,
    data: bytes,
    ttl_ms: int,
    lease: Lease,
    failed: Exception | None = None,
) -> Published:
    """`store.publish` (the result and the claim's new TTL in one MULTI/EXEC), sent again
    after an error a retry can fix (`_worth_retrying`), after pauses of 50 ms doubling up to
    200 ms, while the next attempt would start before `publish_deadline`; the last error
    propagates. Every attempt is bounded by the store's socket timeout, and a repeat is
    safe: SET NX writes nothing over an earlier attempt that landed, which the store tells
    apart from another run's result. `failed`: the error of a first attempt the caller
    made itself (inline, so that a publish that lands at once costs no coroutine here)."""
    deadline = publish_deadline(lease)
    pause = PUBLISH_FIRST_PAUSE
    while True:
        if failed is None:
            try:
                return await store.publish(names.result, data, ttl_ms, names.claim, lease.token)
            except Exception as exc:
                failed = exc
        if not _worth_retrying(failed) or time.monotonic() + pause >= deadline:
            raise failed
        failed = None
        await asyncio.sleep(pause)
        pause = min(2 * pause, PUBLISH_MAX_PAUSE)


def _worth_retrying(exc: Exception) -> bool:
    """Whether a store call that failed with `exc` may succeed if sent again soon: not when
    the server refused the command itself (a ResponseError: a permission, a wrong type, a
    value too large, memory) or the credentials, or the arguments were wrong, unless the
    refusal is for now only (TRYAGAIN while a slot migrates, CLUSTERDOWN, READONLY after a
    failover). A lost connection, a timeout, a server still loading its data, or too few
    replicas acknowledging (NotReplicatedError) are worth another try."""
    if isinstance(exc, TRANSIENT_REFUSALS):
        return True
    permanent = (ResponseError, AuthenticationError, DataError, TypeError, ValueError)
    return not isinstance(exc, permanent)


async def free_claim(store: Store, names: KeyNames, token: bytes) -> None:
    """Free the claim if it still holds `token` (its lease's TTL frees it if this fails)."""
    try:
        await store.cad(names.claim, token)
    except Exception as exc:
        logger.warning(
            "could not release key %s (its lease will expire): %s", names.hash, describe(exc)
        )


async def run_to_end(step: ClosingStep, background: set[asyncio.Task[Any]]) -> None:
    """Run a closing store step (publish, release) so that cancelling the caller cannot cut
    it short, without a task per run.

    The step runs inline. If the caller is cancelled while the step waits, the step starts
    again from the beginning in a task of its own (kept in `background` until it ends) and
    the cancellation goes on; whatever the first attempt had sent may still run, so every
    step must be safe to repeat (SET and CAEXPIRE with the same value and token, CAD with the
    same token) and count nothing that a repeat would count twice. A task per first run (to
    shield it) cost about 8 us and half the garbage collections of a Redis-backed first run.
    """
    try:
        await step()
    except asyncio.CancelledError:
        start_again(step, background)
        raise


def start_again(step: ClosingStep, background: set[asyncio.Task[Any]]) -> None:
    """`step`, cut short by a cancel, started again in a task of its own (`run_to_end`):
    for a caller that runs the step inline itself, without `run_to_end`'s coroutine."""
    task = asyncio.ensure_future(step())
    background.add(task)
    task.add_done_callback(background.discard)
