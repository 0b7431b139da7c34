"""The Store protocol: what every store offers, and the `CLAIMED` reply.

A store offers the four atomic GOBLIN commands (``../spec``): CLAIM, CAEXPIRE, CAS and CAD,
plus the plain GET/SET/PTTL/DEL the middleware needs. `RedisStore` speaks them to a
Redis-protocol server, `MemoryStore` runs them in this process; both give the same replies
and the same error texts (`rules` holds the rules they share).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final, Protocol, TypeAlias, runtime_checkable

__all__ = ["CLAIMED", "ClaimReply", "Claimed", "KeyT", "Published", "Store"]

KeyT: TypeAlias = str | bytes


class Claimed(enum.Enum):
    """Type of the `CLAIMED` sentinel (an enum member, so `is CLAIMED` narrows for mypy)."""

    CLAIMED = "CLAIMED"

    def __repr__(self) -> str:
        return "CLAIMED"


CLAIMED: Final = Claimed.CLAIMED
"""`Store.claim` returns this when the caller won the claim and must do the work.

On the wire the reply is the bulk string ``CLAIMED``, which a result_key holding the
bytes ``b"CLAIMED"`` would also produce: every store maps that reply to this sentinel,
so never publish ``b"CLAIMED"`` as a result (goblin-idem's own records cannot be it).
"""

ClaimReply: TypeAlias = Claimed | bytes | None


class Published(enum.IntEnum):
    """What `Store.publish` did. An int whose 1 and 0 are the claim's CAEXPIRE reply, as
    earlier releases returned it, so a store that replies those still conforms."""

    STORED = 1
    """The result is stored, and the claim holds the token with the result's TTL."""
    LAPSED = 0
    """The result is stored, but the claim no longer held the token (it lapsed, or another
    run took it): the claim was left as it was."""
    SUPERSEDED = -1
    """Another result was already stored: nothing was written over it (the claim, if it
    still held the token, was given that result's remaining TTL)."""


@runtime_checkable
class Store(Protocol):
    """What the middleware and Lock need of a store; every method is one atomic step."""

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIMED: do the work; bytes: it is done, use it; None: in flight, retry."""
        ...

    async def claim_unless_done(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIM, where a stored result wins over a free claim: the middleware's opening step.

        The replies mean what CLAIM's do, and CLAIMED is returned only if no result was
        stored when the claim was won. A claim can vanish while its result stays (evicted,
        lost in a restart or failover, or lapsed and not retaken): CLAIM alone would then
        let the work run again. Here the result is returned instead, and the claim is kept
        for the result's remaining TTL (a lease at least), so later duplicates are answered
        by CLAIM alone again. One round trip (CLAIM and a PTTL of the result, together); the
        rare lost-claim case costs one more.

        When the server refuses the claim for memory (OOM: maxmemory reached under
        noeviction, and CLAIM writes), the result and the claim are read instead: a stored
        result is returned, a held claim gives None, and only a free key raises the OOM error.
        """
        ...

    async def caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        """Renew `key`'s TTL to `ms` only while it still holds `expected`: 1, else 0."""
        ...

    async def cas(self, key: KeyT, expected: KeyT, new: KeyT) -> bool:
        """Swap to `new` only if `key` holds `expected`, keeping the TTL."""
        ...

    async def cad(self, key: KeyT, expected: KeyT) -> int:
        """Delete `key` only if it holds `expected`: 1, else 0."""
        ...

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> Published:
        """SET result_key value PX ttl_ms NX and CAEXPIRE claim_key token ttl_ms, together.

        One round trip. Both or neither take effect, so a claim never expires before the
        result it guards (which would let a duplicate win a fresh claim and run again).
        NX: a result once stored stands for its TTL, so a run that outlived its lease and
        publishes after another run never changes what duplicates were already given.

        Replies `Published`: STORED or LAPSED (the CAEXPIRE's 1 or 0) when the result was
        written, SUPERSEDED when another result stood. Only when a result stood does a
        second round trip read it: if it holds these very bytes it is this call's own (an
        earlier attempt landed and its reply was lost), replied as if written now.
        """
        ...

    async def forget(
        self, claim_key: KeyT, result_key: KeyT, *others: KeyT, expected: KeyT | None = None
    ) -> int:
        """Delete `result_key`, `others` and `claim_key` together, unless a run holds the
        claim: it exists, `result_key` does not, and it does not hold `expected` (None
        matches nothing). One atomic step: -1, nothing deleted, while a run holds it; else
        how many of the keys existed (0: nothing was stored).

        A claim is thus deleted only when it guards a stored result or holds the token the
        caller was shown completed (its SQL record committed): never under a run, which a
        second run could then join. `goblin_idem.forget` is its one caller.
        """
        ...

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        """CAEXPIRE each (key, expected, ms) in one round trip; an error is returned in place."""
        ...

    async def get(self, key: KeyT) -> bytes | None: ...

    async def set(
        self,
        key: KeyT,
        value: KeyT,
        *,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
    ) -> bool: ...

    async def pttl(self, key: KeyT) -> int: ...

    async def delete(self, *keys: KeyT) -> int: ...

    async def aclose(self) -> None: ...
