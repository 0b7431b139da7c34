"""One keyed run under the claim it won, whatever front door it came through.

Every door (the ASGI middleware's `Run`, a `once` call, and so gRPC's calls and the broker
consumers' deliveries) wins its claim with the claim step (`_claim_step`), then holds a
`Held` run, which owns what happens between the claim and the answer: the lease and its
watchdog (a lost one counted as lease_lost), the work's context (`current_claim()`, and
with records ``connection()`` in the run's transaction), the records' commit (a row that
another run committed first wins: `refused`), and one closing step run to its end whatever
cancels the caller: the publish (retried while the claim holds; another run's result left
standing; a lapsed claim said, or retaken) or the release (the records rolled back, the
claim freed if it still holds this run's token). The events are counted by the door's
event function.

A door says the rest in its own terms, by overriding the methods at the end of `Held`: its
log lines, what it stores instead of a result the store refused, what it does just before a
release. How the work's result becomes the stored bytes, and how "in flight", "key reused"
and "store unavailable" are answered, stay with the door.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ._claim import ClaimHolder, current
from ._closing import ClosingStep, free_claim, publish_retried, run_to_end
from ._events import Event
from ._keys import KeyNames
from ._lease import Lease, Watchdog
from ._recording import Committed, RecordRow, Records, RunTransaction
from .store import Published, Store

__all__ = ["Core", "Held", "silent"]

# Taking a lapsed claim back is retried after these pauses: the publish before it has just
# reached the store, and should it fail, the next duplicate's claim step takes it back.
RETAKE_PAUSES = (0.05, 0.25)


def silent(event: Event, key_hash: str) -> None:
    """The event function of a door that counts nothing (a plain `once`)."""


@dataclass(frozen=True, slots=True)
class Core:
    """What every run of one door shares, built once with the door: the store, its
    watchdog, the door's event function, the records (if any), and the closing steps
    started again after a cancel (`background`, until they end)."""

    store: Store
    watchdog: Watchdog
    report: Callable[[Event, str], None] = silent
    records: Records | None = None
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    lease_lost: Callable[[Lease], None] = field(init=False)  # told once by a lost lease

    def __post_init__(self) -> None:
        object.__setattr__(self, "lease_lost", functools.partial(_report_lost, self.report))


def _report_lost(report: Callable[[Event, str], None], lease: Lease) -> None:
    report("lease_lost", lease.label)


@dataclass(eq=False, slots=True)
class Held:
    """One run under a won claim: `names` claimed with `token`, its result kept `ttl_ms`.
    A door's run is this class, or a subclass of it that says the door's words."""

    core: Core
    names: KeyNames
    token: bytes
    ttl_ms: int
    lease: Lease = field(init=False)
    tx: RunTransaction | None = field(default=None, init=False)  # with records: the run's
    refused: bool = field(default=False, init=False)  # the commit found another run's row
    data: bytes = field(default=b"", init=False)  # the result `publish` stores by default
    _claim: contextvars.Token[ClaimHolder | None] = field(init=False)
    _in_sql: contextvars.Token[object] = field(init=False)

    def hold(self, lease_ms: int) -> None:
        """Hold the claim's lease: the store's watchdog renews it until the closing step."""
        self.lease = self.core.watchdog.hold(
            self.names.claim,
            self.token,
            lease_ms,
            label=self.names.hash,
            on_lost=self.core.lease_lost,
        )

    def begin(self, where: Callable[[], str]) -> RunTransaction:
        """The run's transaction, of the door's records; `where` names the run in the
        WARNING about commits outside it. Only for a door with records."""
        assert self.core.records is not None
        self.tx = self.core.records.transaction(where)
        return self.tx

    def enter(self, holder: ClaimHolder) -> None:
        """The work begins here: current_claim() is `holder`'s, and connection() (with
        records) the run's transaction, until `leave`."""
        self._claim = current.set(holder)
        if self.tx is not None:
            self._in_sql = self.tx.enter()

    def leave(self) -> None:
        current.reset(self._claim)
        if self.tx is not None:
            self.tx.leave(self._in_sql)

    async def commit(self, data: bytes, fp: bytes) -> bytes:
        """The work's writes and its record `data` (of fingerprint `fp`), committed
        together: the record to publish, which is another run's if that run's row came
        first (`refused`: this run's writes were rolled back). A commit that fails raises,
        and nothing of this run happened."""
        assert self.tx is not None
        try:
            await self.tx.commit(
                RecordRow(self.names.result, self.names.hash, fp, data, self.ttl_ms)
            )
        except Committed as exc:
            self.refused = True
            return exc.data
        return data

    async def rollback(self) -> None:
        """Undo the work's writes (nothing once committed); safe to repeat."""
        if self.tx is not None:
            await self.tx.rollback()

    def to_end(self, step: ClosingStep) -> Coroutine[Any, Any, None]:
        """`step` (publish or release), run so that cancelling the caller cannot cut it
        short (`run_to_end`)."""
        return run_to_end(step, self.core.background)

    # -- the closing steps: each safe to repeat, as `run_to_end` may start it again --

    async def release(self) -> None:
        """Give the key back for a retry to run: the work's writes rolled back, the lease
        stopped, the claim freed if it still holds this run's token."""
        await self.rollback()
        await self.releasing()
        if self.core.watchdog.stop(self.lease):
            await self.core.watchdog.release(self.lease)
        await free_claim(self.core.store, self.names, self.token)

    async def publish(self, data: bytes | None = None) -> None:
        """Store `data` (by default the run's `data`) and give the claim the result's TTL,
        together (one MULTI/EXEC), retried while the claim keeps duplicates out
        (`publish_retried`; the first attempt is made here, inline).

        If it never lands, the work is done but not recorded: the claim expires a lease
        later and a retry runs it again, which the door logs (`unpublished`), unless it
        stores something else `instead`. A result stored first by another run (which took
        the key after this run's claim lapsed or was lost) stands (`superseded`). A
        publish that found the claim lapsed stored the result (`lapsed`)."""
        core, names, lease = self.core, self.names, self.lease
        if core.watchdog.stop(lease):  # a renewal in flight lands first
            await core.watchdog.release(lease)
        data = self.data if data is None else data
        failed = None
        try:
            published = await core.store.publish(
                names.result, data, self.ttl_ms, names.claim, self.token
            )
        except Exception as exc:
            failed = exc
        if failed is not None:
            try:
                published = await publish_retried(
                    core.store, names, data, self.ttl_ms, lease, failed
                )
            except Exception as exc:
                if not await self.instead(exc):
                    core.report("publish_errors", names.hash)
                    self.unpublished(exc)
                return
        if published == Published.SUPERSEDED:
            core.report("superseded", names.hash)
            self.superseded()
        elif published != Published.STORED:
            await self.lapsed()

    async def retake(self) -> bytes | None:
        """After a publish that found the claim lapsed (the run outlived a lease the
        watchdog could not renew, or a restart lost it): the result is stored, so take the
        claim back for the result's TTL if it is free, so that duplicates are answered by
        the claim alone (without it, the next duplicate's claim step finds the result,
        replays it and takes the claim back). The token that holds the claim now: this
        run's, another run's (a second run is under way and nothing can stop it), or None
        (freed again each time). Retried (`RETAKE_PAUSES`): what lost the claim (a restart)
        also breaks pooled connections; the last error raises."""
        self.lease.lose()  # reported once (lease_lost), should this step be repeated
        store, names, token = self.core.store, self.names, self.token
        for delay in (*RETAKE_PAUSES, None):
            try:
                if await store.set(names.claim, token, px=self.ttl_ms, nx=True):
                    return token
                holder = await store.get(names.claim)  # an earlier try's, or another run's
                if holder is not None:
                    return holder
            except Exception:
                if delay is None:
                    raise
                await asyncio.sleep(delay)
        return None

    # -- what a door says and does in its own terms --

    async def releasing(self) -> None:
        """Just before the lease is stopped, while the claim is held: nothing by default."""

    async def instead(self, exc: Exception) -> bool:
        """Whether the door stored something else after the store refused the result with
        `exc` (then nothing is counted or logged here): not by default."""
        return False

    def unpublished(self, exc: Exception) -> None:
        """The result could not be stored (counted as publish_errors): the door's log line."""

    def superseded(self) -> None:
        """Another run's result was stored first (counted as superseded): the door's line."""

    async def lapsed(self) -> None:
        """The claim had lapsed when the result was stored: the door's line, or `retake`."""
