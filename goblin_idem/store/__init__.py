"""The stores: the four GOBLIN commands (../spec) and the plain commands goblin-idem needs,
behind one `Store` protocol.

- `_protocol`: `Store`, `CLAIMED`, `Published`.
- `_memory`: `MemoryStore`, the commands in this process.
- `_postgres`: `PostgresStore`, the commands as SQL statements (`_postgres_sql`) on a
  PostgreSQL table, through asyncpg or psycopg (`_postgres_pool`).
- `_redis`: `RedisStore`, the commands on a Redis-protocol server, natively or as Lua
  (`_scripts`), checked before the first command (`_detection`).
- `_executor`, `_single`, `_cluster`: how commands reach a server, chosen when the store is
  made; `_autopipeline`: the connection every caller of one event loop shares;
  `_redis_compat`: every use of redis-py's internals.
- `_arguments`: the argument and reply rules every store shares; `_server_errors`: the
  spec's reply texts, and what a server's error replies read as.
"""

from __future__ import annotations

from ..exceptions import NotReplicatedError, StorePermissionError
from ._arguments import as_bytes
from ._memory import MemoryStore
from ._postgres import PostgresStore
from ._protocol import CLAIMED, Claimed, ClaimReply, KeyT, Published, Store
from ._redis import RedisStore

__all__ = [
    "CLAIMED",
    "ClaimReply",
    "Claimed",
    "KeyT",
    "MemoryStore",
    "NotReplicatedError",
    "PostgresStore",
    "Published",
    "RedisStore",
    "Store",
    "StorePermissionError",
    "as_bytes",
]
