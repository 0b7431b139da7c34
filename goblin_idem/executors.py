"""How RedisStore's commands reach the server: one executor, chosen when the store is made.

An executor sends a list of commands and returns their replies with errors in place (only a
lost connection or a timeout raises), so the store builds each command once and reads the
replies once, whatever the topology:

- `Pipelined`: a single server, over the connection every concurrent caller shares
  (`AutoPipeline`): about a tenth of redis-py's CPU per call.
- `Direct`: a single server, through the redis-py client (its pool and its retries).
- `Clustered`: a cluster. One command goes through the cluster client, which routes it and
  follows redirects; commands that must share one connection (a MULTI/EXEC, a write and
  its WAIT) go over a plain connection to the primary that serves their slot, following
  MOVED and ASK itself, because redis-py's async cluster client cannot route a keyless
  WAIT and runs a transaction pipeline in a thread of its own that breaks after a
  topology change.

One NOSCRIPT policy serves them all (`Executor.send`, `Executor._again`): the scripts are
loaded where the reply came from and the commands sent once more, once. `Wait` makes a
write durable: WAIT follows it on the same connection, in the same round trip. Connections
belong to the process and event loop that opened them (`Executor.here`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, MovedError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import scripts
from .autopipeline import AutoPipeline
from .errors import NotReplicatedError

__all__ = ["NOT_WAITED", "Acked", "Clustered", "Command", "Direct", "Executor", "Pipelined", "Wait"]

logger = logging.getLogger("goblin_idem.store")

Command: TypeAlias = tuple[Any, ...]
#: Where a reply came from, for NOSCRIPT: a plain client of one node, or None for wherever
#: the store's client routes the key.
Where: TypeAlias = redis.asyncio.Redis | None

_forks = 0  # how many forks made this process (a child counts one more than its parent)
# Connections a fork's child inherited: never closed or used there, only kept from the
# garbage collector, whose cleanup would unregister their sockets from the epoll instance
# the child shares with its parent (and so stall the parent's own reads).
_inherited: list[object] = []


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


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
    """Sends commands for one store; subclasses say over which connections."""

    def __init__(self, client: Any, wait: Wait | None) -> None:
        self.client = client
        self.wait = wait
        self._loop: asyncio.AbstractEventLoop | None = None  # where the connections were made
        self._forks = _forks

    async def send(self, key: bytes, commands: Sequence[Command]) -> list[Any]:
        """`commands` in order on one connection (the one that serves `key`), in one round
        trip: their replies, errors in place.

        NOSCRIPT (the server forgot the scripts: restarted, failed over, flushed) ran
        nothing, and what a store sends with a script is harmless to repeat (a read, or the
        SET of a publish): the scripts are loaded where the reply came from and the
        commands sent once more; a second NOSCRIPT comes back in place.
        """
        replies, where = await self._send(key, commands)
        if _no_script(replies):
            return await self._again(key, commands, where)
        return replies

    async def _again(self, key: bytes, commands: Sequence[Command], where: Where) -> list[Any]:
        """After NOSCRIPT: load the scripts where it came from, send once more."""
        await self._load_scripts(key, where)
        replies, _ = await self._send(key, commands)
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
        if _no_script(replies):
            await self.load_scripts()
            replies = await self._each(commands)
        return replies

    async def load_scripts(self) -> None:
        """Load the Lua scripts on every primary."""
        await self._load_scripts(None, None)

    def here(self) -> bool:
        """Before any command: drop the connections this process or loop cannot use; True
        if it did.

        In a fork's child (``gunicorn --preload``: the app imported, and the store used,
        before the fork) they are the parent's sockets; after ``asyncio.run()`` returned,
        their loop is closed. Either way they are dropped, never written to or closed, and
        new ones open on first use, as redis-py's synchronous pool does after a fork. A loop
        that is merely another one (a second thread's) keeps its connections."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._forks == _forks:
            return False
        forked = self._forks != _forks
        previous = self._loop
        self._loop, self._forks = loop, _forks
        if not forked and (previous is None or not previous.is_closed()):
            return False
        dropped = self.forget()
        if forked:
            _inherited.extend(dropped)
        return True

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
        return await _pipelined(self.client, commands), None

    async def _each(self, commands: Sequence[Command]) -> list[Any]:
        return await _pipelined(self.client, commands)

    async def _load_scripts(self, key: bytes | None, where: Where) -> None:
        """Load the scripts on the server (single server), or where `key` or `where` says
        (a cluster; every primary if neither)."""
        for script in scripts.ALL:
            await self.client.execute_command("SCRIPT LOAD", script.body)

    def forget(self) -> list[object]:
        """Drop every connection without closing it; the dropped ones."""
        return _drop_pool(self.client)

    async def aclose(self) -> None:
        """Close the connections the executor opened itself (not the client's)."""


class Direct(Executor):
    """A single server through the redis-py client: one command as a call of its own,
    several as a pipeline (not a transaction: a MULTI among them makes one)."""

    client: redis.asyncio.Redis


class Pipelined(Executor):
    """A single server over the connection every concurrent caller shares (`AutoPipeline`);
    never with WAIT, which would block it for everyone."""

    client: redis.asyncio.Redis

    def __init__(self, client: redis.asyncio.Redis, pipeline: AutoPipeline) -> None:
        super().__init__(client, None)
        self.pipeline = pipeline

    async def send(self, key: bytes, commands: Sequence[Command]) -> list[Any]:
        # The hot path, with no coroutine between the store's and the pipeline's own.
        replies = await self.pipeline.execute(commands)
        if _no_script(replies):
            return await self._again(key, commands, None)
        return replies

    async def send_durably(
        self, key: bytes, commands: Sequence[Command]
    ) -> tuple[list[Any], Acked]:
        replies = await self.pipeline.execute(commands)
        if _no_script(replies):
            replies = await self._again(key, commands, None)
        return replies, NOT_WAITED

    async def _send(self, key: bytes, commands: Sequence[Command]) -> tuple[list[Any], Where]:
        return await self.pipeline.execute(commands), None

    async def _each(self, commands: Sequence[Command]) -> list[Any]:
        return await self.pipeline.execute(commands)

    async def _load_scripts(self, key: bytes | None, where: Where) -> None:
        # on the connection that met NOSCRIPT, which is surely up
        loaded = await self.pipeline.execute([("SCRIPT", "LOAD", s.body) for s in scripts.ALL])
        for reply in loaded:
            if isinstance(reply, Exception):
                raise reply

    def forget(self) -> list[object]:
        return [*self.pipeline.forget(), *_drop_pool(self.client)]

    async def aclose(self) -> None:
        await self.pipeline.aclose()


class Clustered(Executor):
    """A cluster: one command through the cluster client, several on one connection to the
    primary of their slot (a plain client per primary, with the cluster client's settings)."""

    client: RedisCluster

    def __init__(self, client: RedisCluster, wait: Wait | None) -> None:
        super().__init__(client, wait)
        self.primaries: dict[tuple[str, int], redis.asyncio.Redis] = {}

    async def _together(self, key: bytes, commands: Sequence[Command]) -> tuple[list[Any], Where]:
        """`commands` on one connection of the primary that serves `key`.

        MOVED refreshes the cluster client's slot table and sends to the new owner; ASK
        sends to the named node after ASKING; a connection error refreshes the slot table,
        and is retried only if another node now owns the slot (a claim that did reach the
        old primary then reads as in flight, never as won).
        """
        ask: tuple[str, int] | None = None
        for _ in range(5):
            node = ask or await self._primary_for(key)
            client = self._primary_client(node)
            try:
                replies = await _pipelined(client, [("ASKING",), *commands] if ask else commands)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                await self._refresh_slots()
                if ask is None and await self._primary_for(key) != node:
                    continue
                raise
            replies = replies[1:] if ask else replies
            redirect = next((r for r in replies if isinstance(r, AskError)), None)
            ask = None
            if isinstance(redirect, MovedError):
                await self._refresh_slots()
            elif redirect is not None:
                remapped = self.client.nodes_manager.remap_host_port(redirect.host, redirect.port)
                ask = (str(remapped[0]), int(remapped[1]))
            else:
                return replies, client
        raise ResponseError("too many cluster redirections (the slot table keeps changing)")

    async def _primary_for(self, key: bytes) -> tuple[str, int]:
        await self.client.initialize()  # a no-op unless redis-py flagged the layout stale
        node = self._node_of(key)
        return str(node.host), int(node.port)

    def _node_of(self, key: bytes) -> Any:
        node = self.client.get_node_from_key(key)  # type: ignore[arg-type]
        if node is None:
            raise ResponseError("no primary serves the key's slot")
        return node

    async def _refresh_slots(self) -> None:
        try:
            await self.client.nodes_manager.initialize()
        except Exception as exc:  # the cluster client refreshes again on its next command
            logger.warning(
                "could not refresh the cluster slot table: %s: %s", type(exc).__name__, exc
            )

    def _primary_client(self, address: tuple[str, int]) -> redis.asyncio.Redis:
        """A plain client of one primary, with the cluster client's connection settings and
        no retries of its own (a retry belongs to `_together`, which knows the topology)."""
        client = self.primaries.get(address)
        if client is None:
            settings = self.client.get_connection_kwargs()
            kwargs = {k: v for k, v in settings.items() if k in _PLAIN_KWARGS or k[:4] == "ssl_"}
            pool = redis.asyncio.ConnectionPool(
                host=address[0],
                port=address[1],
                connection_class=settings.get("connection_class")
                or redis.asyncio.connection.Connection,
                max_connections=settings.get("max_connections"),
                retry=Retry(NoBackoff(), 0),
                **kwargs,
            )
            client = self.primaries[address] = redis.asyncio.Redis(connection_pool=pool)
        return client

    async def _load_scripts(self, key: bytes | None, where: Where) -> None:
        for script in scripts.ALL:
            if where is not None:
                await where.execute_command("SCRIPT LOAD", script.body)  # type: ignore[no-untyped-call]
                continue
            nodes = self.client.get_primaries() if key is None else [self._node_of(key)]
            for node in nodes:
                await self.client.execute_command("SCRIPT LOAD", script.body, target_nodes=node)

    def forget(self) -> list[object]:
        dropped: list[object] = list(self.primaries.values())
        self.primaries = {}
        client = self.client
        nodes = {id(n): n for n in (*client.get_nodes(), *startup_nodes(client))}
        for node in nodes.values():  # redis-py has no public way to reset a node's pool
            connections = getattr(node, "_connections", None)
            if isinstance(connections, list):
                dropped += connections
                node._connections = []
                node._free.clear()
        return dropped

    async def aclose(self) -> None:
        primaries, self.primaries = list(self.primaries.values()), {}
        for primary in primaries:
            await primary.aclose()


def startup_nodes(client: RedisCluster) -> list[Any]:
    return list(client.nodes_manager.startup_nodes.values())


async def _pipelined(client: Any, commands: Sequence[Command]) -> list[Any]:
    """`commands` through a redis-py pipeline (not a transaction), errors in place."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


def _no_script(replies: Sequence[Any]) -> bool:
    """Did NOSCRIPT answer any of `replies` (inside an EXEC's reply too)?"""
    for reply in replies:
        if isinstance(reply, NoScriptError):
            return True
        if type(reply) is list and _no_script(reply):
            return True
    return False


def _drop_pool(client: redis.asyncio.Redis) -> list[object]:
    """Empty a single server's pool (and a single_connection_client's connection)."""
    pool = client.connection_pool
    dropped: list[object] = [
        *getattr(pool, "_available_connections", ()),
        *getattr(pool, "_in_use_connections", ()),
    ]
    pool.reset()  # type: ignore[no-untyped-call]
    if getattr(client, "connection", None) is not None:  # single_connection_client
        dropped.append(client.connection)
        client.connection = None
    return dropped


# The connection settings a per-primary client of a cluster store takes from the cluster client.
_PLAIN_KWARGS: Final = frozenset(
    {
        "username",
        "password",
        "credential_provider",
        "client_name",
        "lib_name",
        "lib_version",
        "driver_info",
        "db",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "socket_read_size",
        "health_check_interval",
        "encoding",
        "encoding_errors",
        "decode_responses",
        "protocol",
    }
)
