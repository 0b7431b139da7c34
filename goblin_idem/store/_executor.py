"""How RedisStore's commands reach the server: one executor, chosen when the store is made.

An executor sends a list of commands and returns their replies with errors in place (only a
lost connection or a timeout raises), so the store builds each command once and reads the
replies once, whatever the topology:

- `Pipelined`: a single server, over the connection every concurrent caller shares
  (`AutoPipeline`): about a tenth of redis-py's CPU per call.
- `Direct`: a single server, through the redis-py client (its pool and its retries).
- `ClusterPipelined`: a cluster, over one shared `AutoPipeline` per primary: every command,
  alone or in a group, goes to the pipeline of the primary that serves its key's slot (the
  cluster client's slot table, read without a network call), and `Clustered._together`
  follows MOVED and ASK, sends again after TRYAGAIN, and decides when a lost connection may
  be retried.
- `Clustered`: a cluster through redis-py, where the shared pipelines cannot be used (TLS,
  a credential provider, no hiredis, ``autopipeline=False``, or ``wait_replicas``, whose
  WAIT would block a shared connection). One command goes through the cluster client, which
  routes it and follows redirects; commands that must share one connection (a MULTI/EXEC, a
  write and its WAIT) go over a plain connection to the primary that serves their slot,
  through the same redirect loop, because redis-py's async cluster client cannot route a
  keyless WAIT and runs a transaction pipeline in a thread of its own that breaks after a
  topology change.

One NOSCRIPT policy serves them all (`Executor.send`, `Executor._again`): the scripts are
loaded where the reply came from and the commands sent once more, once. `Wait` makes a
write durable: WAIT follows it on the same connection, in the same round trip. An executor
serves one event loop of one process: a store gives each loop its own (`copy_client` makes
the client of a second one), and drops one whose loop has closed (`Executor.release`, and
`Executor.discard` for a copy) or that a fork's child inherited (`Executor.disown`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..exceptions import NotReplicatedError
from . import _scripts as scripts
from ._redis_compat import drop_pool, shut_down

if TYPE_CHECKING:
    from ._autopipeline import AutoPipeline

__all__ = [
    "NOT_WAITED",
    "Acked",
    "Address",
    "Command",
    "Executor",
    "Outcome",
    "Replays",
    "Wait",
    "Where",
    "no_script",
    "pipelined",
]

logger = logging.getLogger("goblin_idem.store")

Command: TypeAlias = tuple[Any, ...]
#: A cluster node's (host, port), as the cluster client's slot table names it.
Address: TypeAlias = tuple[str, int]
#: Where a reply came from, for NOSCRIPT: the cluster node that answered, or None for
#: wherever the store's client routes the key.
Where: TypeAlias = Address | None
#: What a group sent to a node ended in: its replies, or the lost connection or timeout.
Outcome: TypeAlias = list[Any] | BaseException

#: A lost connection or a timeout: whether the commands ran is unknown.
LOST: Final = (RedisConnectionError, RedisTimeoutError, OSError)

# Connections a fork's child inherited: never closed or used there, only kept from the
# garbage collector, whose cleanup would unregister their sockets from the epoll instance
# the child shares with its parent (and so stall the parent's own reads).
_inherited: list[object] = []


class Replays(Protocol):
    """Where an executor's replay caches are (`_replay_cache`): a single server's shared
    connection (`AutoPipeline`), or the one of the primary that serves each key in a cluster
    (`ClusterReplays`)."""

    def cached(self, key: bytes) -> bytes | None: ...

    def fill(self, key: bytes, claim: bytes) -> None: ...

    def discard(self, key: bytes) -> None: ...


@dataclass(frozen=True)
class Wait:
    """WAIT after a write (``wait_replicas``): a won claim or a publish counts only once
    `replicas` replicas acknowledged it within `timeout_ms`."""

    replicas: int
    timeout_ms: int

    @property
    def command(self) -> Command:
        return ("WAIT", self.replicas, self.timeout_ms)


class Acked:
    """WAIT's reply to a durable send, checked where the store knows the write mattered (a
    claim that found its key held or done wrote nothing, so it is never checked)."""

    __slots__ = ("reply", "wait")

    def __init__(self, wait: Wait | None, reply: Any) -> None:
        self.wait = wait
        self.reply = reply

    def check(self, what: str) -> None:
        """Raise NotReplicatedError if fewer replicas than asked acknowledged `what`."""
        wait = self.wait
        if wait is None:
            return
        if isinstance(self.reply, Exception):
            raise self.reply
        if int(self.reply) < wait.replicas:
            raise NotReplicatedError(
                f"WAIT: {int(self.reply)} of {wait.replicas} replica(s) acknowledged "
                f"{what} within {wait.timeout_ms} ms"
            )


NOT_WAITED: Final = Acked(None, None)


class Executor:
    """Sends commands for one store in one event loop; subclasses say over which
    connections. `detecting` is the lock the loop's first calls wait on while detection
    runs (an asyncio lock belongs to one loop too)."""

    #: The replay caches that serve this executor's duplicates, if any.
    replays: Replays | None = None
    #: The connection every caller shares, on which `RedisStore`'s first-run steps send
    #: themselves and await its reply future (`Pipelined`: one server, no WAIT); None: they
    #: go through `send_durably`. What does not come back clean goes to `resent`.
    shared: AutoPipeline | None = None

    def __init__(self, client: Any, wait: Wait | None) -> None:
        self.client = client
        self.wait = wait
        self.detecting = asyncio.Lock()

    async def send(self, key: bytes, commands: Sequence[Command]) -> list[Any]:
        """`commands` in order on one connection (the one that serves `key`), in one round
        trip: their replies, errors in place.

        NOSCRIPT (the server forgot the scripts: restarted, failed over, flushed) ran
        nothing, and what a store sends with a script is harmless to repeat (a read, or the
        SET of a publish): the scripts are loaded where the reply came from and the
        commands sent once more; a second NOSCRIPT comes back in place.
        """
        replies, where = await self._send(key, commands)
        if no_script(replies):
            return await self._again(key, commands, where)
        return replies

    async def _again(self, key: bytes, commands: Sequence[Command], where: Where) -> list[Any]:
        """After NOSCRIPT: load the scripts where it came from, send once more."""
        await self._load_scripts(key, where)
        replies, _ = await self._send(key, commands)
        return replies

    async def resent(
        self, key: bytes, commands: Sequence[Command], replies: list[Any]
    ) -> list[Any]:
        """The replies of `commands` sent on `shared`, as `send` would return them: sent
        once more after NOSCRIPT."""
        if no_script(replies):
            return await self._again(key, commands, None)
        return replies

    async def send_durably(
        self, key: bytes, commands: Sequence[Command]
    ) -> tuple[list[Any], Acked]:
        """`send`, then WAIT on the same connection if the store waits for replicas (WAIT
        measures the replication offset of the connection that wrote): one round trip."""
        if self.wait is None:
            return await self.send(key, commands), NOT_WAITED
        replies = await self.send(key, [*commands, self.wait.command])
        return replies[:-1], Acked(self.wait, replies[-1])

    async def send_each(self, commands: Sequence[Command]) -> list[Any]:
        """Commands that stand alone (not a transaction, keys anywhere), in one round trip
        per node; errors in place, NOSCRIPT as in `send` (the scripts loaded everywhere)."""
        replies = await self._each(commands)
        if no_script(replies):
            await self.load_scripts()
            replies = await self._each(commands)
        return replies

    async def load_scripts(self) -> None:
        """Load the Lua scripts on every primary."""
        await self._load_scripts(None, None)

    def disown(self) -> None:
        """In a fork's child (``gunicorn --preload``: the app imported, and the store used,
        before the fork): drop the parent's connections, never written to or closed, as
        redis-py's synchronous pool does after a fork; new ones open on first use."""
        _inherited.extend(self._drop())

    def release(self) -> None:
        """After its event loop closed: drop the connections and shut their sockets down,
        so that the server frees them at once, with no call into the closed loop (each
        socket is closed when its connection is collected); new ones open on first use,
        in the next loop."""
        for connection in self._drop():
            shut_down(connection)

    def discard(self) -> None:
        """`release`, for an executor on a copy of the store's client, which is not used
        again."""
        self.release()

    def _drop(self) -> list[object]:
        self.detecting = asyncio.Lock()  # it may belong to the old loop
        return self.forget()

    # -- what each executor says --

    async def _send(self, key: bytes, commands: Sequence[Command]) -> tuple[list[Any], Where]:
        """One command as a call of the client's own (routed, retried as it says), several
        together on one connection."""
        if len(commands) > 1:
            return await self._together(key, commands)
        client: Any = self.client
        try:
            return [await client.execute_command(*commands[0])], None
        except ResponseError as exc:
            return [exc], None

    async def _together(self, key: bytes, commands: Sequence[Command]) -> tuple[list[Any], Where]:
        return await pipelined(self.client, commands), None

    async def _each(self, commands: Sequence[Command]) -> list[Any]:
        return await pipelined(self.client, commands)

    async def _load_scripts(self, key: bytes | None, where: Where) -> None:
        """Load the scripts on the server (single server), or where `key` or `where` says
        (a cluster; every primary if neither)."""
        for script in scripts.ALL:
            await self.client.execute_command("SCRIPT LOAD", script.body)

    def forget(self) -> list[object]:
        """Drop every connection without closing it; the dropped ones."""
        return drop_pool(self.client)

    async def aclose(self) -> None:
        """Close the connections the executor opened itself (not the client's)."""


async def pipelined(client: Any, commands: Sequence[Command]) -> list[Any]:
    """`commands` through a redis-py pipeline (not a transaction), errors in place."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


def no_script(replies: Sequence[Any]) -> bool:
    """Did NOSCRIPT answer any of `replies` (inside an EXEC's reply too)?"""
    for reply in replies:
        if isinstance(reply, NoScriptError):
            return True
        if type(reply) is list and no_script(reply):
            return True
    return False
