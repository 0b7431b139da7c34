"""The opening step of a keyed run (the middleware's request, a `once` call): one claim step.

The store's `claim_unless_done` answers in one round trip: CLAIMED (this run goes ahead),
None (another run holds the key) or the stored result (a stored result wins over a claim
that was lost, so a result that survived is never run again). Around it, each only when
configured: polling while the key is in flight (`wait_seconds`), a look under other names
(`previous`: the middleware's 0.1.0 key names), and the database's word on a won claim
(`records`).

The database is asked alongside the claim step while most keys are new, so that a new key
waits for the slower of the two, not for both; while most are duplicates, after it, and only
for a won claim, so that a replay costs no query (a query per replay cut replays to a
quarter, in bench/README.md). `Overlap` follows which of the two the traffic is.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ._claim import poll_claim
from ._keys import KeyNames
from ._recording import Lookup, Records
from .store import CLAIMED, ClaimReply, Store

__all__ = ["ClaimStep", "Overlap"]


class Overlap:
    """Whether recent claim steps were mostly won (new keys): a moving average over about
    the last 16, which starts at "new" (a fresh app's first keys are)."""

    __slots__ = ("won",)

    def __init__(self) -> None:
        self.won = 1.0

    def alongside(self) -> bool:
        return self.won >= 0.5

    def saw(self, won: bool) -> None:
        self.won += ((1.0 if won else 0.0) - self.won) / 16


@dataclass(frozen=True, slots=True)
class ClaimStep:
    """Built once from the options; called once per keyed run."""

    store: Store
    wait_seconds: float
    poll_interval: float
    records: Records | None
    # A won claim's reply under other names (the key, its claim token): the middleware's
    # 0.1.0 names (`previous_key_names`).
    previous: Callable[[KeyNames, bytes], Awaitable[ClaimReply]] | None = None
    overlap: Overlap = field(default_factory=Overlap)
    plain: bool = field(init=False)  # none of the three: the store's step alone

    def __post_init__(self) -> None:
        plain = self.wait_seconds <= 0 and self.previous is None and self.records is None
        object.__setattr__(self, "plain", plain)

    def __call__(self, names: KeyNames, token: bytes, claim_seconds: int) -> Awaitable[ClaimReply]:
        """The claim step's reply. Raises what the store or the database raised: the claim
        is then in doubt (a won claim the database could not confirm is freed first). With
        no option around the step, the store's own awaitable: no coroutine of this step's
        on the path of every keyed request."""
        if self.plain:
            return self.store.claim_unless_done(names.claim, names.result, token, claim_seconds)
        return self._around(names, token, claim_seconds)

    async def _around(self, names: KeyNames, token: bytes, claim_seconds: int) -> ClaimReply:
        records = self.records
        lookup = None
        if records is not None and self.overlap.alongside():
            lookup = Lookup(records, names.result)
        try:
            reply = await self.store.claim_unless_done(
                names.claim, names.result, token, claim_seconds
            )
            if reply is None and self.wait_seconds > 0:
                if lookup is not None:  # its answer would predate the wait: asked again after
                    lookup.forget()  # (and its connection is not held through the wait)
                    lookup = None
                step = functools.partial(
                    self.store.claim_unless_done, names.claim, names.result, token, claim_seconds
                )
                reply = await poll_claim(step, self.wait_seconds, self.poll_interval)
            if reply is CLAIMED and self.previous is not None:
                reply = await self.previous(names, token)
        except BaseException:
            if lookup is not None:
                lookup.forget()
            raise
        if records is None:
            return reply
        self.overlap.saw(reply is CLAIMED)
        if lookup is None:
            if reply is not CLAIMED:
                return reply
            lookup = Lookup(records, names.result)
        return await lookup.settle(reply, self.store, names, token)
