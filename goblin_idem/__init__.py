"""goblin-idem: exactly-once POST/PATCH for ASGI apps on atomic Redis-protocol claims."""

from .errors import GoblinError, LockError, LockNotOwnedError
from .memory import MemoryStore
from .store import CLAIMED, Claimed, ClaimReply, KeyT, RedisStore, Store

__all__ = [
    "CLAIMED",
    "ClaimReply",
    "Claimed",
    "GoblinError",
    "KeyT",
    "LockError",
    "LockNotOwnedError",
    "MemoryStore",
    "RedisStore",
    "Store",
]

__version__ = "0.1.0"
