"""goblin-idem: exactly-once POST/PATCH for ASGI and WSGI apps on atomic Redis-protocol claims."""

from . import _log
from ._claim import Claim, current_claim
from ._forget import forget
from ._keys import cookie_scope, header_scope
from ._lease import Lease, Watchdog
from ._lock import Lock
from ._version import __version__ as __version__
from .exceptions import (
    ClaimLostError,
    CommitRefusedError,
    DatabaseUnavailableError,
    GoblinError,
    InFlightError,
    KeyReusedError,
    LockError,
    LockNotOwnedError,
    NotInRunError,
    NotReplicatedError,
    SqlRecordsError,
    StorePermissionError,
)
from .middleware import Counters, IdempotencyMiddleware, RoutePolicy, idempotent
from .once import Codec, once
from .records._sealing import Sealer
from .store import (
    CLAIMED,
    Claimed,
    ClaimReply,
    KeyT,
    MemoryStore,
    PostgresStore,
    RedisStore,
    Store,
)

__all__ = [
    "CLAIMED",
    "Claim",
    "ClaimLostError",
    "ClaimReply",
    "Claimed",
    "Codec",
    "CommitRefusedError",
    "Counters",
    "DatabaseUnavailableError",
    "GoblinError",
    "IdempotencyMiddleware",
    "InFlightError",
    "KeyReusedError",
    "KeyT",
    "Lease",
    "Lock",
    "LockError",
    "LockNotOwnedError",
    "MemoryStore",
    "NotInRunError",
    "NotReplicatedError",
    "PostgresStore",
    "RedisStore",
    "RoutePolicy",
    "Sealer",
    "SqlRecordsError",
    "Store",
    "StorePermissionError",
    "Watchdog",
    "cookie_scope",
    "current_claim",
    "forget",
    "header_scope",
    "idempotent",
    "once",
]


_log.install()  # goblin-idem's lines in the server's log, until the app configures logging
