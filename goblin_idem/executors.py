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
import contextlib
import inspect
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import redis.asyncio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import scripts
from .autopipeline import AutoPipeline
from .errors import NotReplicatedError

__all__ = [
    "NOT_WAITED",
    "Acked",
    "ClusterPipelined",
    "Clustered",
    "Command",
    "Direct",
    "Executor",
    "Pipelined",
    "Wait",
    "copy_client",
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

#: Redirects a cluster send follows before it gives up (the slot table keeps changing).
MAX_REDIRECTS: Final = 5
#: How long a cluster send refused with TRYAGAIN (a slot migrating) is sent again, and the
#: pauses before each time (doubling from the first to the cap).
TRYAGAIN_SECONDS: Final = 2.0
TRYAGAIN_FIRST_PAUSE: Final = 0.02
TRYAGAIN_MAX_PAUSE: Final = 0.2
#: A lost connection or a timeout: whether the commands ran is unknown.
_LOST: Final = (RedisConnectionError, RedisTimeoutError, OSError)

# Connections a fork's child inherited: never closed or used there, only kept from the
# garbage collector, whose cleanup would unregister their sockets from the epoll instance
# the child shares with its parent (and so stall the parent's own reads).
_inherited: list[object] = []


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
            _shut_down(connection)

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
    """A cluster through redis-py: one command through the cluster client, several on one
    connection to the primary of their slot (a plain client per primary, with the cluster
    client's settings).

    `_together` is the one redirect loop of both cluster executors; `_group` says how a
    group reaches a node (here a redis-py pipeline, in `ClusterPipelined` the node's shared
    `AutoPipeline`)."""

    client: RedisCluster

    def __init__(self, client: RedisCluster, wait: Wait | None) -> None:
        super().__init__(client, wait)
        self.primaries: dict[Address, redis.asyncio.Redis] = {}

    async def _together(
        self, key: bytes, commands: Sequence[Command], tried: tuple[Address, Outcome] | None = None
    ) -> tuple[list[Any], Where]:
        """`commands` on one connection of the primary that serves `key` (`_redirected`),
        sent again while TRYAGAIN refuses one of them; `tried` as in `_redirected`.

        TRYAGAIN answers a command of several keys on a slot being migrated when its keys
        are not all on the node that answered (split between the two nodes, or a new key's
        on neither yet). The command ran nothing (inside a MULTI, the EXEC is refused or
        aborted), and whatever RedisStore sends with one is a read, a renewal with the same
        token, or WAIT: the group is safe to send again. It is, from the start (the slot may
        have moved meanwhile), after a pause of 20 ms doubling up to 200 ms, for up to
        `TRYAGAIN_SECONDS` (a slot of 20,000 keys took 0.7-0.9 s in docs/RELIABILITY.md); the
        refusal then comes back in place (a publish is retried on by `publish_retried`).
        """
        pause, give_up = TRYAGAIN_FIRST_PAUSE, 0.0
        while True:
            replies, node = await self._redirected(key, commands, tried)
            if not any(isinstance(reply, TryAgainError) for reply in replies):
                return replies, node
            now = time.monotonic()
            give_up = give_up or now + TRYAGAIN_SECONDS
            if now + pause > give_up:
                return replies, node
            await asyncio.sleep(pause)
            pause, tried = min(2 * pause, TRYAGAIN_MAX_PAUSE), None

    async def _redirected(
        self, key: bytes, commands: Sequence[Command], tried: tuple[Address, Outcome] | None
    ) -> tuple[list[Any], Where]:
        """`commands` on one connection of the primary that serves `key`, following
        redirects; `tried` is a first attempt already made (the node it went to, what it
        ended in), taken as this loop's first.

        MOVED (in any reply; inside a MULTI it answers the queued command and EXEC fails with
        EXECABORT, so nothing ran) refreshes the cluster client's slot table and sends to
        the new owner; ASK sends to the named node after ASKING (`_asking`), once; a
        connection error refreshes the slot table, and is retried only if another node now
        owns the slot (a claim that did reach the old primary then reads as in flight, never
        as won). At most `MAX_REDIRECTS` sends. Keys of more than one slot are refused as
        redis-py refuses them (RedisClusterException), whether the server said CROSSSLOT or
        redirected one of the commands elsewhere. TRYAGAIN comes back in place.
        """
        ask: Address | None = None
        for _ in range(MAX_REDIRECTS):
            if tried is not None:
                (node, outcome), tried = tried, None
            else:
                node = ask or await self._primary_for(key)
                outcome = await self._attempt(node, commands, asking=ask is not None)
            if isinstance(outcome, BaseException):
                await self._refresh_slots()
                if ask is None and await self._primary_for(key) != node:
                    continue
                raise outcome
            ask = None
            redirect = _redirect(key, outcome)
            if redirect is None:
                return outcome, node
            if isinstance(redirect, MovedError):
                await self._refresh_slots()
            else:
                remapped = self.client.nodes_manager.remap_host_port(redirect.host, redirect.port)
                ask = (str(remapped[0]), int(remapped[1]))
        raise ResponseError("too many cluster redirections (the slot table keeps changing)")

    async def _attempt(self, node: Address, commands: Sequence[Command], asking: bool) -> Outcome:
        """One send of a group to `node` (each command after ASKING, for an ASK): its replies,
        or the lost connection or timeout, for `_together` to judge."""
        try:
            if not asking:
                return await self._group(node, commands)
            sent = _asking(commands)
            replies = await self._group(node, sent)
        except _LOST as exc:
            return exc
        return [r for r, command in zip(replies, sent, strict=True) if command is not _ASKING]

    async def _group(self, node: Address, commands: Sequence[Command]) -> list[Any]:
        """`commands` on one connection of `node`, in one round trip; errors in place."""
        return await _pipelined(self._primary_client(node), commands)

    async def _primary_for(self, key: bytes) -> Address:
        if self.client._initialize:  # redis-py flagged its slot table stale (or unread)
            await self._initialize()
        return self._address_of(key)

    async def _initialize(self) -> None:
        await self.client.initialize()  # a no-op unless the layout is (still) stale

    def _address_of(self, key: bytes) -> Address:
        """The primary that serves `key`, by the slot table as it stands (no network call)."""
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

    def _primary_client(self, address: Address) -> redis.asyncio.Redis:
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
        loads: list[Command] = [("SCRIPT", "LOAD", script.body) for script in scripts.ALL]
        if where is not None:  # the node that answered NOSCRIPT, over the same kind of link
            for reply in await self._group(where, loads):
                if isinstance(reply, Exception):
                    raise reply
            return
        nodes = self.client.get_primaries() if key is None else [self._node_of(key)]
        for script in scripts.ALL:
            for node in nodes:
                await self.client.execute_command("SCRIPT LOAD", script.body, target_nodes=node)

    def forget(self) -> list[object]:
        primaries, self.primaries = list(self.primaries.values()), {}
        dropped = [c for primary in primaries for c in _drop_pool(primary)]
        client = self.client
        nodes = {id(n): n for n in (*client.get_nodes(), *startup_nodes(client))}
        for node in nodes.values():  # redis-py has no public way to reset a node's pool
            connections = getattr(node, "_connections", None)
            if isinstance(connections, list):
                dropped += connections
                node._connections = []
                node._free.clear()
        return dropped

    def discard(self) -> None:
        super().discard()
        # Marked closed, as aclose (which awaits) would: redis-py logs an error for a
        # cluster client collected while initialized.
        self.client._initialize = True

    async def aclose(self) -> None:
        primaries, self.primaries = list(self.primaries.values()), {}
        for primary in primaries:
            await primary.aclose()


class ClusterPipelined(Clustered):
    """A cluster over one shared `AutoPipeline` per primary (made on first use, with the
    cluster client's connection settings): every command, alone or in a group, goes to the
    pipeline of the primary that serves its key's slot, and a call costs what it costs on a
    single server. Never with WAIT, which would block a shared connection for everyone.

    The slot table is the cluster client's (`get_node_from_key`, no network call); redis-py
    keeps it current for its own commands, `_together` refreshes it on MOVED or a lost
    connection. A primary that left the slot table has its pipeline closed at the refresh
    that saw it go."""

    def __init__(self, client: RedisCluster, settings: dict[str, Any]) -> None:
        super().__init__(client, None)
        self.settings = settings
        self.pipelines: dict[Address, AutoPipeline] = {}

    @classmethod
    def for_client(cls, client: RedisCluster) -> ClusterPipelined | None:
        """One for `client`, or None where a shared pipeline cannot honour its connection
        settings (TLS, a credential provider, a custom connection class, no hiredis)."""
        kwargs = client.get_connection_kwargs()
        if kwargs.get("connection_class", redis.asyncio.Connection) is not redis.asyncio.Connection:
            return None  # TLS, or a connection class of the application's
        settings = AutoPipeline.settings_of(kwargs)
        return None if settings is None else cls(client, settings)

    async def send(self, key: bytes, commands: Sequence[Command]) -> list[Any]:
        """`commands` back to back on the shared connection of the primary that serves
        `key`, in one write (a MULTI ... EXEC among them runs there as one transaction);
        their replies, errors in place.

        The hot path: the slot table read in place, the pipeline's own future awaited here.
        A reply that is an error, or a lost connection or timeout (whether the commands ran
        is then unknown), hands this first attempt to `_together`, which follows redirects
        and decides whether a resend is safe; NOSCRIPT then as in `Executor.send`."""
        client = self.client
        if client._initialize:  # redis-py flagged its slot table stale (or unread)
            await self._initialize()
        address = self._address_of(key)
        try:
            replies = await self._pipeline_for(address).execute(commands)
        except _LOST as exc:
            outcome: Outcome = exc
        else:
            if _clean(replies):
                return replies
            outcome = replies
        replies, where = await self._together(key, commands, (address, outcome))
        if _no_script(replies):
            return await self._again(key, commands, where)
        return replies

    async def _send(self, key: bytes, commands: Sequence[Command]) -> tuple[list[Any], Where]:
        return await self._together(key, commands)

    async def _group(self, node: Address, commands: Sequence[Command]) -> list[Any]:
        return await self._pipeline_for(node).execute(commands)

    def _pipeline_for(self, address: Address) -> AutoPipeline:
        pipeline = self.pipelines.get(address)
        if pipeline is None:
            host, port = address
            pipeline = self.pipelines[address] = AutoPipeline(host=host, port=port, **self.settings)
        return pipeline

    async def _each(self, commands: Sequence[Command]) -> list[Any]:
        """Commands of any keys: grouped by the primary of each key's slot, one pipelined
        write per primary, all at once; replies in the callers' order. A command that was
        redirected, or whose primary's connection was lost, goes through `_together` alone
        (with what its group met as the first attempt), its error in place."""
        if self.client._initialize:
            await self._initialize()
        groups: dict[Address, list[int]] = {}
        for i, command in enumerate(commands):
            groups.setdefault(self._address_of(_key_of(command)), []).append(i)
        outcomes = await asyncio.gather(
            *(self._attempt(a, [commands[i] for i in group], False) for a, group in groups.items())
        )
        replies: list[Any] = [None] * len(commands)
        again: list[tuple[int, Address, Outcome]] = []
        for (address, group), outcome in zip(groups.items(), outcomes, strict=True):
            if isinstance(outcome, BaseException):
                again += [(i, address, outcome) for i in group]
                continue
            for i, reply in zip(group, outcome, strict=True):
                if isinstance(reply, AskError):
                    again.append((i, address, [reply]))
                else:
                    replies[i] = reply
        if again:
            redone = await asyncio.gather(
                *(self._alone(commands[i], (address, outcome)) for i, address, outcome in again)
            )
            for (i, _, _), reply in zip(again, redone, strict=True):
                replies[i] = reply
        return replies

    async def _alone(self, command: Command, tried: tuple[Address, Outcome]) -> Any:
        """One command of `_each` through the redirect loop: its reply, or its error."""
        try:
            (reply,), _ = await self._together(_key_of(command), [command], tried)
        except Exception as exc:
            return exc
        return reply

    async def _initialize(self) -> None:
        await super()._initialize()
        await self._close_unused()

    async def _refresh_slots(self) -> None:
        await super()._refresh_slots()
        await self._close_unused()

    async def _close_unused(self) -> None:
        """Close the pipelines of nodes that no longer serve slots as primaries (failed,
        demoted, removed): their calls in flight fail as a lost connection would."""
        serving = {(str(n.host), int(n.port)) for n in self.client.get_primaries()}
        for address in [a for a in self.pipelines if a not in serving]:
            await self.pipelines.pop(address).aclose()

    def forget(self) -> list[object]:
        pipelines, self.pipelines = list(self.pipelines.values()), {}
        dropped: list[object] = [c for p in pipelines for c in p.forget()]
        return [*dropped, *super().forget()]

    async def aclose(self) -> None:
        pipelines, self.pipelines = list(self.pipelines.values()), {}
        for pipeline in pipelines:
            await pipeline.aclose()
        await super().aclose()


def startup_nodes(client: RedisCluster) -> list[Any]:
    return list(client.nodes_manager.startup_nodes.values())


async def _pipelined(client: Any, commands: Sequence[Command]) -> list[Any]:
    """`commands` through a redis-py pipeline (not a transaction), errors in place."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


def _redirect(key: bytes, replies: Sequence[Any]) -> AskError | None:
    """The first MOVED or ASK among `replies` (MovedError is an AskError), if any.

    Raises RedisClusterException for commands whose keys span slots: the server refused
    them with CROSSSLOT, or redirected one of them away from `key`'s slot (nothing the
    redirect loop could fix)."""
    redirect: AskError | None = None
    for reply in replies:
        if isinstance(reply, AskError):
            redirect = redirect or reply
        elif isinstance(reply, ClusterCrossSlotError):
            raise _cross_slot()
    if redirect is not None and redirect.slot_id != key_slot(key):
        raise _cross_slot()
    return redirect


_ASKING: Final = ("ASKING",)


def _asking(commands: Sequence[Command]) -> list[Command]:
    """`commands` for the node an ASK named: ASKING before each one, as it lasts for one
    command only, except inside a MULTI, where the ASKING before MULTI lasts until EXEC."""
    out: list[Command] = []
    queued = False
    for command in commands:
        name = str(command[0]).upper()
        if not queued:
            out.append(_ASKING)
        out.append(command)
        if name == "MULTI":
            queued = True
        elif name in ("EXEC", "DISCARD"):
            queued = False
    return out


def _cross_slot() -> RedisClusterException:
    return RedisClusterException(
        "the keys of one call must map to the same key slot (share a {hash tag})"
    )


def _clean(replies: Sequence[Any]) -> bool:
    """No error reply, and no NOSCRIPT inside an EXEC's reply: nothing to redirect or redo."""
    for reply in replies:
        if isinstance(reply, Exception):
            return False
        if type(reply) is list and _no_script(reply):
            return False
    return True


def _key_of(command: Command) -> bytes:
    """The key of a command that stands alone: after a script's sha and key count, else the
    first argument (every command `send_each` is given: the CAEXPIREs of renewals)."""
    key = command[3] if str(command[0]).upper() in ("EVALSHA", "EVAL") else command[1]
    return key if isinstance(key, bytes) else str(key).encode()


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


def _shut_down(connection: object) -> None:
    """Shut the socket of a dropped connection (an AutoPipeline's, or redis-py's) down,
    without a call into its event loop. uvloop closes its sockets with its loop."""
    transport = getattr(connection, "transport", None)
    if transport is None:  # redis-py's keeps its transport in its stream writer
        transport = getattr(getattr(connection, "_writer", None), "transport", None)
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:
        with contextlib.suppress(OSError):  # already closed by the server
            sock.shutdown(socket.SHUT_RDWR)


def copy_client(client: Any) -> Any:
    """A client with `client`'s connection settings and no connection yet, for another
    event loop: redis-py's pools, connections and locks belong to the loop that first
    used them.

    A single server's client gets a pool of the same class and settings; a cluster client
    a new one from its startup nodes, connection settings and the cluster options redis-py
    keeps (full coverage, replicas, remapping, retries). A pool of another kind (Sentinel's)
    cannot be copied: TypeError, which says to make one store per event loop.
    """
    if isinstance(client, RedisCluster):
        return _copy_cluster(client)
    pool = client.connection_pool
    pools = (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool)
    if type(pool) not in pools:
        raise TypeError(
            f"a RedisStore over a {type(pool).__name__} serves one event loop only: it "
            "cannot open connections of its own in another one. Make one store per event "
            "loop (each with its own client)"
        )
    extra = (
        {"timeout": pool.timeout} if isinstance(pool, redis.asyncio.BlockingConnectionPool) else {}
    )
    copy = type(pool)(
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **extra,
        **pool.connection_kwargs,
    )
    other = type(client)(
        connection_pool=copy, single_connection_client=client.single_connection_client
    )
    other.response_callbacks.update(client.response_callbacks)
    return other


def _copy_cluster(client: RedisCluster) -> RedisCluster:
    settings: dict[str, Any] = dict(client.get_connection_kwargs())
    settings["ssl"] = settings.get("connection_class") is redis.asyncio.SSLConnection
    manager = client.nodes_manager
    settings.update(
        require_full_coverage=manager.require_full_coverage,
        address_remap=getattr(manager, "address_remap", None),
        dynamic_startup_nodes=getattr(manager, "_dynamic_startup_nodes", True),
        reinitialize_steps=client.reinitialize_steps,
        retry=client.retry,
    )
    strategy = getattr(client, "load_balancing_strategy", None)
    if strategy is not None:
        settings["load_balancing_strategy"] = strategy
    elif client.read_from_replicas:  # deprecated since redis-py 5.3, so only if set
        settings["read_from_replicas"] = True
    accepted = inspect.signature(type(client).__init__).parameters
    nodes = [ClusterNode(str(n.host), int(n.port)) for n in startup_nodes(client)]
    kwargs = {k: v for k, v in settings.items() if k in accepted and k != "startup_nodes"}
    return type(client)(startup_nodes=nodes, **kwargs)


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
