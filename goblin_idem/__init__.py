"""goblin-idem: exactly-once POST/PATCH for ASGI apps on atomic Redis-protocol claims."""

from .errors import (
    GoblinError,
    LockError,
    LockNotOwnedError,
    NotReplicatedError,
    StorePermissionError,
)
from .keys import cookie_scope, header_scope
from .lease import Lease, Lock, Watchdog
from .memory import MemoryStore
from .middleware import Counters, IdempotencyMiddleware, RoutePolicy, idempotent
from .sealing import Sealer
from .store import CLAIMED, Claimed, ClaimReply, KeyT, RedisStore, Store

__all__ = [
    "CLAIMED",
    "ClaimReply",
    "Claimed",
    "Counters",
    "GoblinError",
    "IdempotencyMiddleware",
    "KeyT",
    "Lease",
    "Lock",
    "LockError",
    "LockNotOwnedError",
    "MemoryStore",
    "NotReplicatedError",
    "RedisStore",
    "RoutePolicy",
    "Sealer",
    "Store",
    "StorePermissionError",
    "Watchdog",
    "cookie_scope",
    "header_scope",
    "idempotent",
]

__version__ = "0.1.0"
