"""The middleware's opening step for a request with a key: one claim step, and what it means.

The store's `claim_unless_done` answers in one round trip: CLAIMED (this request runs), None
(another run holds the key) or the stored record (a stored result wins over a claim that was
lost, so a result that survived is never run again). Around it, each only when configured:
polling while the key is in flight (`wait_seconds`), 0.1.0's key names
(`previous_key_names`), and the database's word on a won claim (`records`), asked alongside
the claim so that a new key waits for the slower of the two, not for both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._claim import poll_claim
from .._keys import KeyNames
from .._recording import Lookup, Records
from ..store import CLAIMED, ClaimReply, Store
from ._names_010 import previous_reply

__all__ = ["ClaimStep"]


@dataclass(frozen=True, slots=True)
class ClaimStep:
    """Built once from the middleware's options; called once per request with a key."""

    store: Store
    wait_seconds: float
    poll_interval: float
    namespace: bytes
    previous_key_names: bool
    records: Records | None

    async def __call__(self, names: KeyNames, token: bytes, claim_seconds: int) -> ClaimReply:
        """The claim step's reply. Raises what the store or the database raised: the claim
        is then in doubt (a won claim the database could not confirm is freed first)."""
        lookup = None if self.records is None else Lookup(self.records, names.result)
        try:
            reply = await self.store.claim_unless_done(
                names.claim, names.result, token, claim_seconds
            )
            if reply is None and self.wait_seconds > 0:
                step = functools.partial(
                    self.store.claim_unless_done, names.claim, names.result, token, claim_seconds
                )
                reply = await poll_claim(step, self.wait_seconds, self.poll_interval)
                if lookup is not None and reply is CLAIMED:
                    lookup = lookup.again()  # the first answer predates the wait
            if reply is CLAIMED and self.previous_key_names:
                reply = await previous_reply(self.store, self.namespace, names, token)
        except BaseException:
            if lookup is not None:
                lookup.forget()
            raise
        if lookup is None:
            return reply
        return await lookup.settle(reply, self.store, names, token)
