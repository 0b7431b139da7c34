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

__all__ = ["CLAIMED", "ClaimReply", "Claimed", "KeyT", "Store"]

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
    ) -> int:
        """SET result_key value PX ttl_ms and CAEXPIRE claim_key token ttl_ms, together.

        One round trip. Both or neither take effect, so a claim never expires before the
        result it guards (which would let a duplicate win a fresh claim and run again).
        Replies the CAEXPIRE: 1 if the claim was still this token's, else 0.
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
