"""The store layer's names in one place: the Store protocol, `CLAIMED`, `Published`,
RedisStore.

Where each piece lives: `protocol` (Store, CLAIMED, Published), `rules` (the argument and
reply rules every store shares), `replies` (a server's error texts), `executors` (how
commands reach a server), `detection` (what is checked before the first command),
`redis_store` (RedisStore) and `memory` (MemoryStore).
"""

from __future__ import annotations

from ..exceptions import NotReplicatedError, StorePermissionError
from ._arguments import as_bytes
from ._protocol import CLAIMED, Claimed, ClaimReply, KeyT, Published, Store
from ._redis import RedisStore

__all__ = [
    "CLAIMED",
    "ClaimReply",
    "Claimed",
    "KeyT",
    "NotReplicatedError",
    "Published",
    "RedisStore",
    "Store",
    "StorePermissionError",
    "as_bytes",
]
