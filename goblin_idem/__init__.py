"""goblin-idem: exactly-once POST/PATCH for ASGI apps on atomic Redis-protocol claims."""

from . import _log
from .claim import Claim, current_claim
from .codecs import Codec
from .exceptions import (
    ClaimLostError,
    GoblinError,
    InFlightError,
    LockError,
    LockNotOwnedError,
    NotReplicatedError,
    StorePermissionError,
)
from .keys import cookie_scope, header_scope
from .lease import Lease, Watchdog
from .lock import Lock
from .memory import MemoryStore
from .middleware import Counters, IdempotencyMiddleware, RoutePolicy, idempotent
from .once import once
from .sealing_impl import Sealer
from .store import CLAIMED, Claimed, ClaimReply, KeyT, RedisStore, Store

__all__ = [
    "CLAIMED",
    "Claim",
    "ClaimLostError",
    "ClaimReply",
    "Claimed",
    "Codec",
    "Counters",
    "GoblinError",
    "IdempotencyMiddleware",
    "InFlightError",
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
    "current_claim",
    "header_scope",
    "idempotent",
    "once",
]

__version__ = "0.1.0"

_log.install()  # goblin-idem's lines in the server's log, until the app configures logging
