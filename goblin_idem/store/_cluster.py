"""The executors of a Redis Cluster: over one shared connection per primary
(`ClusterPipelined`, the default, with the primaries' replay caches: `ClusterReplays`), or
through redis-py (`Clustered`); `Clustered._together` is the one redirect loop of both (MOVED,
ASK, TRYAGAIN, a lost connection)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    MovedError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from . import _scripts as scripts
from ._autopipeline import PUSHES, AutoPipeline, settings_of
from ._executor import LOST, Address, Command, Executor, Outcome, Wait, Where, no_script, pipelined
from ._redis_compat import (
    drop_cluster_nodes,
    drop_pool,
    mark_cluster_closed,
    slots_stale,
)

__all__ = ["ClusterPipelined", "ClusterReplays", "Clustered"]

logger = logging.getLogger("goblin_idem.store")

#: Redirects a cluster send follows before it gives up (the slot table keeps changing).
MAX_REDIRECTS: Final = 5
#: How long a cluster send refused with TRYAGAIN (a slot migrating) is sent again, and the
#: pauses before each time (doubling from the first to the cap).
TRYAGAIN_SECONDS: Final = 2.0
TRYAGAIN_FIRST_PAUSE: Final = 0.02
TRYAGAIN_MAX_PAUSE: Final = 0.2


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
        except LOST as exc:
            return exc
        return [r for r, command in zip(replies, sent, strict=True) if command is not _ASKING]

    async def _group(self, node: Address, commands: Sequence[Command]) -> list[Any]:
        """`commands` on one connection of `node`, in one round trip; errors in place."""
        return await pipelined(self._primary_client(node), commands)

    async def _primary_for(self, key: bytes) -> Address:
        if slots_stale(self.client):
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
        dropped = [c for primary in primaries for c in drop_pool(primary)]
        return [*dropped, *drop_cluster_nodes(self.client)]

    def discard(self) -> None:
        super().discard()
        mark_cluster_closed(self.client)  # as aclose (which awaits) would

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
    that saw it go. With a replay cache budget every pipeline tracks (`ClusterReplays`)."""

    def __init__(self, client: RedisCluster, settings: dict[str, Any]) -> None:
        super().__init__(client, None)
        self.settings = settings
        self.pipelines: dict[Address, AutoPipeline] = {}
        if settings.get("replay_cache_bytes") and PUSHES:
            self.replays = ClusterReplays(self)

    @classmethod
    def for_client(
        cls, client: RedisCluster, replay_cache_bytes: int = 0
    ) -> ClusterPipelined | None:
        """One for `client`, or None where a shared pipeline cannot honour its connection
        settings (TLS, a credential provider, a custom connection class, no hiredis); each
        primary's pipeline with a replay cache of `replay_cache_bytes` (0: none)."""
        kwargs = client.get_connection_kwargs()
        if kwargs.get("connection_class", redis.asyncio.Connection) is not redis.asyncio.Connection:
            return None  # TLS, or a connection class of the application's
        settings = settings_of(kwargs)
        if settings is None:
            return None
        settings["replay_cache_bytes"] = replay_cache_bytes
        return cls(client, settings)

    async def send(self, key: bytes, commands: Sequence[Command]) -> list[Any]:
        """`commands` back to back on the shared connection of the primary that serves
        `key`, in one write (a MULTI ... EXEC among them runs there as one transaction);
        their replies, errors in place.

        The hot path: the slot table read in place, the pipeline's own future awaited here.
        A reply that is an error, or a lost connection or timeout (whether the commands ran
        is then unknown), hands this first attempt to `_together`, which follows redirects
        and decides whether a resend is safe; NOSCRIPT then as in `Executor.send`."""
        client = self.client
        if slots_stale(client):
            await self._initialize()
        address = self._address_of(key)
        try:
            replies = await self._pipeline_for(address).execute(commands)
        except LOST as exc:
            outcome: Outcome = exc
        else:
            if _clean(replies):
                return replies
            outcome = replies
        return await self._after(key, commands, address, outcome)

    async def _after(
        self, key: bytes, commands: Sequence[Command], address: Address, outcome: Outcome
    ) -> list[Any]:
        """A first attempt that did not end clean, through the redirect loop; NOSCRIPT then
        as in `Executor.send`."""
        replies, where = await self._together(key, commands, (address, outcome))
        if no_script(replies):
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
        if slots_stale(self.client):
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


class ClusterReplays:
    """The replay caches of a cluster store: each primary's shared connection tracks, and
    keeps, what was read on it (`_replay_cache`); a key's result is looked up and filled
    through the pipeline of the primary its slot has in the slot table, read in
    place (no network call; nothing while the table is stale), and forgotten in all of them.

    An entry holds the bytes that one node held for the key when that node's connection read
    them, and ends when that node reports the key changed, the connection is lost or closed,
    or it is not consulted any more. A key leaves a node in one of these ways, each reported
    on that node's connection, or ending it:

    - deleted, expired, evicted or written on the node: its invalidation;
    - FLUSHALL on the node: an invalidation of everything, for that node's connection
      alone (the other primaries' keys stand);
    - its slot migrated: MIGRATE deletes the key on the source, whose invalidation drops the
      entry there; the copy on the target is not tracked until read there. A slot table
      that still names the source sends the lookup to the source's cache, which no longer
      has the key, so it goes to the store, where MOVED refreshes the table;
    - the node restarted, or the connection lost: the connection's cache is dropped whole;
    - a failover: a demoted primary still connected follows the new primary by replication,
      and reports the keys replication changes (a full resync flushes: everything), checked
      on Redis 7.0 and Valkey 9 (tests/store/test_cluster_replay_cache.py); its pipeline is
      closed, with its cache, at the table refresh that sees it demoted (the first MOVED,
      or a lost connection).

    The window is the single server's (the invalidation's way to this process's event
    loop), plus, while the table names a demoted primary, the replication delay from the
    new one. A primary cut off from its cluster but not from this process answers from
    memory what a read of it would answer."""

    __slots__ = ("executor",)

    def __init__(self, executor: ClusterPipelined) -> None:
        self.executor = executor

    def _pipeline(self, key: bytes) -> AutoPipeline | None:
        """The pipeline of the primary the slot table names for `key`, if it has one yet."""
        executor = self.executor
        if slots_stale(executor.client):
            return None
        try:
            address = executor._address_of(key)
        except (RedisClusterException, ResponseError):  # not covered: the store will say
            return None
        return executor.pipelines.get(address)

    def cached(self, key: bytes) -> bytes | None:
        pipeline = self._pipeline(key)
        return None if pipeline is None else pipeline.cached(key)

    def fill(self, key: bytes, claim: bytes) -> None:
        pipeline = self._pipeline(key)
        if pipeline is not None:
            pipeline.fill(key, claim)

    def discard(self, key: bytes) -> None:
        """Forget `key` in every primary's cache (any thread may call it)."""
        for pipeline in tuple(self.executor.pipelines.values()):
            pipeline.discard(key)


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
        if type(reply) is list and no_script(reply):
            return False
    return True


def _key_of(command: Command) -> bytes:
    """The key of a command that stands alone: after a script's sha and key count, else the
    first argument (every command `send_each` is given: the CAEXPIREs of renewals)."""
    key = command[3] if str(command[0]).upper() in ("EVALSHA", "EVAL") else command[1]
    return key if isinstance(key, bytes) else str(key).encode()


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
