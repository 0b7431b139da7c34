"""RedisStore: the GOBLIN commands on a Redis-protocol server, natively or as Lua scripts.

Each method builds its commands once and hands them to the executor chosen when the store
is made (`executors`: the shared auto-pipelined connection, the redis-py client, or a
cluster's primaries, with or without WAIT); `replies` turns an error reply into the text
the native command gives; `detection` checks the server before the first command.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import weakref
from asyncio import get_running_loop
from collections.abc import Awaitable, Sequence
from typing import Any, Final, TypeVar, cast

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError, ResponseError

from .._durations import renamed_ms, seconds
from .._keys import shown
from . import _autopipeline as autopipeline
from . import _scripts as scripts
from ._arguments import (
    DEFAULT_MAX_VALUE_BYTES,
    WRITTEN,
    as_bytes,
    caexpire_ms,
    check_size,
    claim_reply,
    claim_seconds,
    publish_ttl,
)
from ._autopipeline import AutoPipeline
from ._cluster import Clustered, ClusterPipelined
from ._detection import Detection, Mode, node_name
from ._executor import NOT_WAITED, Acked, Executor, Wait
from ._protocol import CLAIMED, ClaimReply, KeyT, Published
from ._redis_compat import copy_client, startup_nodes
from ._replay_cache import DEFAULT_REPLAY_CACHE_BYTES
from ._server_errors import normalize, renewal_reply, unwrap
from ._single import Direct, Pipelined
from ._wire import claim_step, claim_wire, publish_step, publish_wire

__all__ = ["AnyRedis", "Mode", "RedisStore"]

logger = logging.getLogger("goblin_idem.store")

HIREDIS = autopipeline.HIREDIS
AnyRedis = redis.asyncio.Redis | RedisCluster
_S = TypeVar("_S", bound="_StoreConnection")
_CLAIM_KEPT = "the claim (it stays until its lease expires)"
_CLAIMED_WIRE: Final = b"CLAIMED"  # CLAIM's reply to the run that won (`claim_reply`)
_SET_REPLIES: Final = (bytes, type(None))  # SET NX's in an EXEC: OK, or nil (a result stood)


class _StoreConnection:
    """RedisStore's link to its server: the client, and an executor per event loop (the
    first on the client given, the others on copies of it). `RedisStore` adds detection
    and the commands."""

    def __init__(
        self,
        client: AnyRedis,
        *,
        mode: Mode = "auto",
        max_value_bytes: int | None = None,
        wait_replicas: int = 0,
        wait_timeout_seconds: float = 1.0,
        autopipeline: bool = True,
        wait_timeout_ms: int | None = None,
        replay_cache_bytes: int = DEFAULT_REPLAY_CACHE_BYTES,
    ) -> None:
        _check_client(client)
        wait_timeout = renamed_ms(
            "wait_timeout_ms", wait_timeout_ms, "wait_timeout_seconds", wait_timeout_seconds, 2
        )
        _check_options(client, mode, wait_replicas, wait_timeout)
        _check_replay_cache(replay_cache_bytes)
        self.client = client
        self.replay_cache_bytes = replay_cache_bytes
        self.max_value_bytes = (
            DEFAULT_MAX_VALUE_BYTES if max_value_bytes is None else max_value_bytes
        )
        self.wait_replicas = wait_replicas
        self.wait_timeout_seconds = wait_timeout
        self.wait_timeout_ms = max(1, round(wait_timeout * 1000))  # WAIT's unit
        self._owns_client = False
        self._acl_user = str(client.get_connection_kwargs().get("username") or "default")
        # WAIT blocks its connection, so it never goes on a shared one.
        self._shared = autopipeline and not wait_replicas
        cluster = isinstance(client, RedisCluster)
        if self._shared and not HIREDIS and (cluster or type(client) is redis.asyncio.Redis):
            logger.info(
                "goblin-idem store: auto-pipelining is off because hiredis is not installed "
                "(pip install 'goblin-idem[fast]'); every call goes through redis-py"
            )
        self._wait = Wait(wait_replicas, self.wait_timeout_ms) if wait_replicas else None
        self._first = self._executor_for(client)
        # The executor of each event loop that has used the store, replaced whole (never
        # changed in place) under `_arriving`, so that a lookup needs no lock.
        self._loops: dict[asyncio.AbstractEventLoop, Executor] = {}
        self._arriving = threading.Lock()
        self._detection = Detection(mode, self._acl_user, self._server_limit)
        _stores.add(self)

    def _executor_for(self, client: AnyRedis) -> Executor:
        if isinstance(client, RedisCluster):
            shared = self._shared
            fast = ClusterPipelined.for_client(client, self.replay_cache_bytes) if shared else None
            return fast or Clustered(client, self._wait)
        shared = self._shared
        pipeline = AutoPipeline.for_client(client, self.replay_cache_bytes) if shared else None
        if pipeline is not None:
            return Pipelined(client, pipeline)
        return Direct(client, self._wait)

    @classmethod
    def from_url(
        cls: type[_S],
        url: str,
        *,
        mode: Mode = "auto",
        max_value_bytes: int | None = None,
        cluster: bool = False,
        max_connections: int = 256,
        pool_timeout: float = 5.0,
        socket_timeout: float = 5.0,
        wait_replicas: int = 0,
        wait_timeout_seconds: float = 1.0,
        autopipeline: bool = True,
        wait_timeout_ms: int | None = None,
        replay_cache_bytes: int = DEFAULT_REPLAY_CACHE_BYTES,
        **kwargs: Any,
    ) -> _S:
        """A store that owns its client (closed by `aclose`).

        The pool waits up to `pool_timeout` for a free connection instead of failing at
        `max_connections`, and a socket timeout bounds how long a request can hang on a
        store that stopped answering; both end in a store error, never a silent wait.
        `wait_replicas`, `wait_timeout_seconds`, `autopipeline` and `replay_cache_bytes`
        are the class's options.
        """
        client = _client_from_url(
            url, cluster, max_connections, pool_timeout, socket_timeout, **kwargs
        )
        store = cls(
            client,
            mode=mode,
            max_value_bytes=max_value_bytes,
            wait_replicas=wait_replicas,
            wait_timeout_seconds=renamed_ms(
                "wait_timeout_ms", wait_timeout_ms, "wait_timeout_seconds", wait_timeout_seconds, 2
            ),
            autopipeline=autopipeline,
            replay_cache_bytes=replay_cache_bytes,
        )
        store._owns_client = True
        return store

    @property
    def address(self) -> str:
        """Where the store is: ``host:port`` or a socket path (a cluster's startup nodes)."""
        client = self.client
        if isinstance(client, RedisCluster):
            return ", ".join(n.name for n in startup_nodes(client))
        return node_name(client, None)

    @property
    def mode(self) -> Mode:
        """``"native"`` or ``"script"``; ``"auto"`` until the first command has detected it."""
        return self._detection.mode

    @property
    def _executor(self) -> Executor:
        """The executor of the running event loop (the first one, outside any loop): the
        hot path's one lookup."""
        try:
            return self._loops[asyncio.get_running_loop()]
        except KeyError:
            return self._arrive(asyncio.get_running_loop())
        except RuntimeError:  # no running loop
            return self._first

    @property
    def _pipeline(self) -> AutoPipeline | None:
        """The running loop's shared connection, if the store auto-pipelines (one server)."""
        executor = self._executor
        return executor.pipeline if isinstance(executor, Pipelined) else None

    def _arrive(self, loop: asyncio.AbstractEventLoop) -> Executor:
        """A loop's first call: the first executor if no open loop has it, else one on a
        copy of the client. Loops that have closed are dropped first (`_drop_closed`)."""
        with self._arriving:
            loops = self._drop_closed()
            executor = self._first
            if any(e is executor for e in loops.values()):
                executor = self._executor_for(copy_client(self.client))
            loops[loop] = executor
            self._loops = loops
            return executor

    def _drop_closed(self) -> dict[asyncio.AbstractEventLoop, Executor]:
        """The loops still open and their executors; those of closed loops are released
        (their sockets shut down, nothing sent through the closed loop). Under `_arriving`."""
        loops = {}
        for loop, executor in self._loops.items():
            if not loop.is_closed():
                loops[loop] = executor
            elif executor is self._first:
                executor.release()  # for the next loop
            else:
                executor.discard()
        return loops

    def _after_fork(self) -> None:
        """In a fork's child: every executor drops what it inherited (`Executor.disown`)."""
        self._arriving = threading.Lock()  # another thread may have held it at the fork
        executors = {id(e): e for e in (self._first, *self._loops.values())}
        self._loops = {}
        for executor in executors.values():
            executor.disown()

    def forget_cached(self, result_key: KeyT) -> None:
        """Stop answering `result_key` from this process's replay cache, at once, in every
        event loop: for a process that deletes a result (the server's invalidation then
        reaches every other process). Not part of the `Store` protocol (a store of another
        kind would stop conforming); `MemoryStore` has it too, and does nothing."""
        self._forget((as_bytes(result_key),))

    def _forget(self, keys: Sequence[bytes]) -> None:
        """Drop `keys` from every loop's replay cache: before this store changes them (a
        fill under way is spoiled) and again once it did (a fill read before the change
        is not served until the server's invalidation arrives)."""
        if not self.replay_cache_bytes:
            return
        loops = self._loops.values()  # replaced whole, never changed in place
        first = self._first  # one of them while its loop runs: visited once
        for executor in loops if first in loops else (first, *loops):
            replays = executor.replays
            if replays is not None:
                for key in keys:
                    replays.discard(key)

    def _server_limit(self, limit: int) -> None:
        """Detection read the server's proto-max-bulk-len: a larger value would make the
        server drop the connection, failing every call pipelined with it."""
        if self.max_value_bytes is None or self.max_value_bytes > limit:
            self.max_value_bytes = limit

    async def aclose(self) -> None:
        """Close the running loop's connections (a later call opens new ones) and release
        those of loops that have closed. Another loop still open keeps its own: close the
        store in it too, or its connections are released once it has closed."""
        executor = self._executor
        await executor.aclose()
        if self._owns_client or executor.client is not self.client:  # a copy is the store's
            client = executor.client
            if isinstance(client, RedisCluster):
                await client.aclose()
            else:  # a pool passed to Redis() is not closed with it unless asked
                await client.aclose(close_connection_pool=True)
        with self._arriving:
            self._loops = self._drop_closed()


# Every RedisStore of the process, for the fork handler.
_stores: weakref.WeakSet[_StoreConnection] = weakref.WeakSet()


def forget_everywhere(keys: Sequence[bytes]) -> None:
    """Drop `keys` from every replay cache of this process, every store's and every loop's:
    called before and after a step that deletes them, so that no connection of this process
    answers them from memory once the step has returned, whether or not the server's
    invalidation has reached it yet (a fill under way then is spoiled; one read before the
    step and done is dropped by the second call)."""
    for store in list(_stores):
        store._forget(keys)


def _after_fork() -> None:
    for store in list(_stores):
        store._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class _StoreCommands(_StoreConnection):
    """What RedisStore's methods go through: the plain commands, detection's gate, one GOBLIN
    command, and a claim's or a publish's replies read past the fast path."""

    # -- plain commands, through the running loop's redis-py client --

    async def _plain(self, command: Awaitable[Any]) -> Any:
        """A redis-py call (not yet started) of the running loop's client."""
        try:
            return await command
        except ResponseError as exc:
            raise normalize(exc, self._acl_user) from None

    async def get(self, key: KeyT) -> bytes | None:
        reply = await self._plain(self._executor.client.get(as_bytes(key)))
        return None if reply is None else as_bytes(reply, "reply")

    async def set(
        self,
        key: KeyT,
        value: KeyT,
        *,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
    ) -> bool:
        k, v = as_bytes(key), check_size(as_bytes(value, "value"), self.max_value_bytes)
        client = self._executor.client
        self._forget((k,))
        try:
            return bool(await self._plain(client.set(k, v, ex=ex, px=px, nx=nx)))
        finally:
            self._forget((k,))

    async def pttl(self, key: KeyT) -> int:
        return int(await self._plain(self._executor.client.pttl(as_bytes(key))))

    async def delete(self, *keys: KeyT) -> int:
        if not keys:
            return 0
        client = self._executor.client
        names = [as_bytes(k) for k in keys]
        self._forget(names)
        try:
            return int(await self._plain(client.delete(*names)))
        finally:
            self._forget(names)

    async def _ready(self) -> bool:
        """Whether the GOBLIN commands are native, once detection has run."""
        detection = self._detection
        if not detection.done and not detection.ready():  # it probes the whole RedisStore
            await detection.run(cast("RedisStore", self), self._executor)
        return detection.mode == "native"

    async def _goblin(self, script: scripts.Script, keys: Sequence[bytes], *args: Any) -> Any:
        """One GOBLIN command, its reply (an error reply raised, as the native one reads)."""
        command = script.call(await self._ready(), keys, args)
        self._forget(keys)  # every GOBLIN command but CLAIM may change its key
        try:
            (reply,) = await self._executor.send(keys[0], [command])
        finally:
            self._forget(keys)
        return unwrap(reply, self._acl_user)

    async def _claimed(
        self, replies: list[Any], acked: Acked, ck: bytes, rk: bytes, tok: bytes, lease: int
    ) -> ClaimReply:
        """What CLAIM's and PTTL's replies say, read the general way (not on the shared
        connection, or not as it came: an error, NOSCRIPT, a result that outlived its claim)."""
        reply, result_ttl = replies
        replays = self._executor.replays  # the running loop's, as `claim_unless_done` read it
        if isinstance(reply, OutOfMemoryError):
            return await self._read_when_full(ck, rk, reply)
        claimed = claim_reply(unwrap(reply, self._acl_user))
        if claimed is not CLAIMED:
            if claimed is not None and replays is not None:
                replays.fill(rk, ck)  # later duplicates: from memory, once it is tracked
            return claimed
        ttl = int(unwrap(result_ttl, self._acl_user))
        if ttl != -2:
            survived = await self._result_survived(ck, rk, tok, lease, ttl)
            if survived is not CLAIMED:
                return survived
        acked.check(_CLAIM_KEPT)
        return CLAIMED

    async def _result_survived(
        self, ck: bytes, rk: bytes, token: bytes, lease: int, result_ttl: int
    ) -> ClaimReply:
        """The claim was won, yet a result is stored: the claim had been lost. Read the
        result and keep the claim as long as the result (a lease at least, so that it never
        expires under a run should the result have expired meanwhile): one round trip."""
        keep = max(result_ttl, lease * 1000)
        renew = scripts.CAEXPIRE.call(self.mode == "native", (ck,), (token, keep))
        value, _ = await self._executor.send(ck, [("GET", rk), renew])
        if unwrap(value, self._acl_user) is None:  # expired meanwhile: the claim is the
            return CLAIMED  # caller's to run
        logger.warning(
            "goblin-idem store: key %s: its claim was gone while its result was stored "
            "(evicted, or lost in a restart or failover): answered from the result instead "
            "of running again, and the claim is retaken for the result's TTL",
            shown(ck),
        )
        return as_bytes(value, "reply")

    async def _read_when_full(self, ck: bytes, rk: bytes, refused: OutOfMemoryError) -> ClaimReply:
        """CLAIM was refused for memory (it writes): answer from reads, which a full server
        still serves. A stored result is the answer; a held claim is in flight; only a free
        key has nothing to go by, and gets the refusal."""
        value, claim_ttl = await self._executor.send(ck, [("GET", rk), ("PTTL", ck)])
        if unwrap(value, self._acl_user) is not None:
            return as_bytes(value, "reply")
        if int(unwrap(claim_ttl, self._acl_user)) != -2:
            return None
        raise refused

    def _published(self, replies: list[Any], acked: Acked) -> tuple[bool, int]:
        """What the publish transaction's replies (its EXEC's last) say was done: whether
        the result was written, and the claim's CAEXPIRE reply."""
        for reply in replies:  # a refusal at MULTI time aborts the EXEC: raise the refusal
            unwrap(reply, self._acl_user)
        stored, renewed = replies[-1][:2]
        written = unwrap(stored, self._acl_user) is not None
        renewed = int(unwrap(renewed, self._acl_user))
        acked.check("the published response")
        return written, renewed

    async def _stood(
        self, rk: bytes, value: bytes, ck: bytes, token: bytes, renewed: int
    ) -> Published:
        """SET NX found a result stored: read it and its TTL (one round trip). If it holds
        these very bytes, it is this publish's own (an earlier attempt landed, its reply
        lost). Otherwise another run's result stands; a claim this publish renewed is then
        cut to that result's remaining TTL (one more round trip), so that it does not
        outlive the result and answer 409 after it. The PTTL was read no earlier than it
        was sent and the CAEXPIRE runs no earlier than it is sent, so the time between the
        two sends is taken off: a delay here (a busy loop) does not lengthen the claim."""
        sent = time.monotonic()
        stored, left = await self._executor.send(ck, [("GET", rk), ("PTTL", rk)])
        if unwrap(stored, self._acl_user) == value:
            return WRITTEN[renewed]
        left = int(unwrap(left, self._acl_user))
        if renewed and left > 0:  # CAEXPIRE, as `RedisStore.caexpire` sends it
            left -= math.ceil((time.monotonic() - sent) * 1000)
            await self._goblin(scripts.CAEXPIRE, (ck,), token, caexpire_ms(max(left, 1)))
        return Published.SUPERSEDED


class RedisStore(_StoreCommands):
    """The GOBLIN commands on a Redis-protocol server, natively or as Lua scripts.

    ``mode="native"`` sends GOBLIN.* as is; ``mode="script"`` runs the spec's Lua with
    EVALSHA (reloading on NOSCRIPT, in a cluster on the node that answered);
    ``mode="auto"`` asks the server once, at detection, whether it knows GOBLIN.CLAIM,
    and `mode` then reads ``"native"`` or ``"script"``. Both modes give the
    same replies and the same error texts; keys given to one call must share a hash slot
    in a cluster (use a ``{tag}``).

    Durability (``wait_replicas``, off by default): Redis replicates asynchronously, so a
    claim the primary acknowledged can be lost when a replica that had not received it is
    promoted, and the next duplicate then runs the work again. With ``wait_replicas=N``
    every claim is followed by ``WAIT N`` (``wait_timeout_seconds``) on the same connection, in one
    pipeline (one round trip; WAIT measures the replication offset of the connection that
    wrote). A won claim that fewer than N replicas acknowledged within ``wait_timeout_seconds``
    raises `NotReplicatedError` (a RedisError: the middleware answers 503 and runs nothing;
    the claim stays on the primary until its lease expires). Only won claims are checked;
    a claim that found the key held or done wrote nothing. `publish` is followed by the
    same WAIT (after its MULTI/EXEC), so that a failover cannot lose a published response
    and let its key run again once the claim's lease runs out; a publish that too few
    replicas acknowledged raises `NotReplicatedError` as well (the middleware retries it
    while the claim holds, then counts ``publish_errors``). Lease renewals are not waited
    for. Every keyed request pays the replication round trip, and while fewer than N
    replicas are connected each claim waits the full ``wait_timeout_seconds``. In a cluster
    these pipelines go to the primary that serves the key over a plain connection
    (`executors.Clustered`).

    Auto-pipelining (``autopipeline=True``, the default): without ``wait_replicas``, the
    GOBLIN commands and `publish` of every concurrent caller share one connection per event
    loop (`AutoPipeline`), written together once per loop turn, instead of a pooled redis-py
    connection each: about a tenth of the CPU per call. In a cluster there is one such
    connection per primary, and each call goes to the one of its key's slot
    (`executors.ClusterPipelined`, which follows MOVED and ASK). It opens its own
    connections with the client's settings, and is skipped (everything goes through
    redis-py) for TLS, a credential provider, a custom connection class, or without
    hiredis. Plain commands and mode detection always use the client.

    Replay cache (``replay_cache_bytes``, 1 MiB by default; 0: off): with a budget, each event
    loop's shared connection keeps in memory the results a duplicate read from the store,
    and answers later duplicates from there (a first run tracks nothing), kept coherent by
    the server's invalidations (RESP3 client
    tracking on that connection, `_replay_cache`); `forget_cached` drops a key at once.
    In a cluster each primary's shared connection has its own, and a key is looked up in
    the one of its slot's primary (`executors.ClusterReplays`, which says what keeps it
    coherent through migrations and failovers). A store that does not auto-pipeline has
    none.

    Detection (`detect`, or the first command): the mode, the ACL user's permission for
    every command the store sends (`StorePermissionError` names what is refused), the
    server's eviction policy (a WARNING when it can evict goblin-idem's keys), and the
    largest value it takes (proto-max-bulk-len, the smallest of a cluster's primaries;
    Redis' default 512 MiB, also before detection, where it cannot be read), which becomes
    ``max_value_bytes`` where that is larger or None. A larger value is refused before it
    is sent, with the native command's error: the server would drop the connection it
    came on, failing every call pipelined with it.

    Processes and loops: connections belong to the process and event loop that opened
    them. One store serves any number of event loops at once (threads each running one):
    the first loop uses the client given, each other open loop a copy of it made with the
    same settings (`executors.copy_client`), with connections and a detection lock of its
    own (and lease renewals: `Watchdog`); what detection found is shared. A loop that has
    closed has its connections released (their sockets shut down, nothing sent through
    the closed loop) at the next loop's first call or `aclose`, and the client given then
    serves the next loop. A store used before a fork drops, in the child, every connection
    it inherited (without writing to or closing the parent's sockets) and opens new ones
    on its first command there.
    """

    # -- detection: the mode, the user's permissions, the eviction policy, the value limit --

    async def detect(self) -> Mode:
        """Check the server once, before the first command (which otherwise does it).

        Resolves ``mode="auto"``; runs every command the store sends once, on probe keys of
        its own, and raises `StorePermissionError` naming each one the server's ACL refuses
        and the rule that allows them (the store still works as far as it is allowed: a
        refused command raises the same error when it is sent); and reads
        ``maxmemory-policy`` on every primary, with a WARNING for a policy that can evict
        goblin-idem's keys, or when it cannot be read. A server that cannot be reached
        decides nothing: the next call checks again.
        """
        if self._detection.done:
            return self._detection.mode
        return await self._detection.run(self, self._executor)

    async def detection_notes(self) -> list[tuple[int, str]]:
        """`detect`, with the lines it would log returned as ``(level, text)`` instead; none
        if detection had already run. Raises as `detect` does."""
        if self._detection.done:
            return []
        return await self._detection.notes(self, self._executor)

    # -- the four GOBLIN commands --

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """Atomically: SET claim_key token NX EX seconds, else GET result_key."""
        keys = (as_bytes(claim_key), as_bytes(result_key))
        tok = check_size(as_bytes(token, "token"), self.max_value_bytes)
        command = scripts.CLAIM.call(await self._ready(), keys, (tok, claim_seconds(seconds)))
        (reply,), acked = await self._executor.send_durably(keys[0], [command])
        claimed = claim_reply(unwrap(reply, self._acl_user))
        if claimed is CLAIMED:
            acked.check(_CLAIM_KEPT)
        return claimed

    async def claim_unless_done(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIM, then PTTL of the result, in one round trip (pipelined, on one connection,
        in that order: a result published between the two is seen). See
        `Store.claim_unless_done` for what the replies promise.

        On a single server's shared connection (`Executor.shared`), the replies are read
        here, as they came: a free key, a held one and a stored result return at once; an
        error, NOSCRIPT or a result that outlived its claim take the general way."""
        ck = claim_key if type(claim_key) is bytes else as_bytes(claim_key)
        rk = result_key if type(result_key) is bytes else as_bytes(result_key)
        tok = token if type(token) is bytes else as_bytes(token, "token")
        if len(tok) > self.max_value_bytes:
            check_size(tok, self.max_value_bytes)  # refused, as the native command does
        lease = claim_seconds(seconds)
        try:  # `_executor`, inline
            executor = self._loops[get_running_loop()]
        except (KeyError, RuntimeError):
            executor = self._executor
        replays = executor.replays
        if replays is not None and (kept := replays.cached(rk)) is not None:
            return kept  # the bytes the store holds: see `_replay_cache`
        detection = self._detection
        if not detection.done:
            await self._ready()
        native = detection.mode == "native"
        shared = executor.shared
        if shared is None:
            replies, acked = await executor.send_durably(ck, claim_step(native, ck, rk, tok, lease))
            return await self._claimed(replies, acked, ck, rk, tok, lease)
        replies = await shared.execute(claim_wire(native, ck, rk, tok, lease))
        reply, result_ttl = replies
        if type(result_ttl) is int and (reply is None or type(reply) is bytes):
            if reply != _CLAIMED_WIRE:  # in flight (None), or the stored result
                if reply is not None and replays is not None:
                    replays.fill(rk, ck)  # later duplicates: from memory, once tracked
                return reply
            if result_ttl == -2:  # won, and no result stored
                return CLAIMED
        else:
            step = claim_step(native, ck, rk, tok, lease)
            replies = await executor.resent(ck, step, replies)
        return await self._claimed(replies, NOT_WAITED, ck, rk, tok, lease)

    async def caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        """Atomically: if GET key == expected, PEXPIRE key ms (ms <= 0 deletes)."""
        k, e = as_bytes(key), as_bytes(expected, "expected")
        return int(await self._goblin(scripts.CAEXPIRE, (k,), e, caexpire_ms(ms)))

    async def cas(self, key: KeyT, expected: KeyT, new: KeyT) -> bool:
        """Atomically: if GET key == expected, SET key new KEEPTTL."""
        k, e = as_bytes(key), as_bytes(expected, "expected")
        n = check_size(as_bytes(new, "new"), self.max_value_bytes)
        return await self._goblin(scripts.CAS, (k,), e, n) in (b"OK", "OK", True)

    async def cad(self, key: KeyT, expected: KeyT) -> int:
        """Atomically: if GET key == expected, DEL key."""
        k, e = as_bytes(key), as_bytes(expected, "expected")
        return int(await self._goblin(scripts.CAD, (k,), e))

    async def forget(
        self, claim_key: KeyT, result_key: KeyT, *others: KeyT, expected: KeyT | None = None
    ) -> int:
        """The claim, the result and `others` in one script (`scripts.FORGET_LUA`), unless
        a run holds the claim: see `Store.forget`. This process's replay caches drop the
        result before and after (`forget_everywhere`)."""
        keys = (as_bytes(claim_key), as_bytes(result_key), *(as_bytes(k) for k in others))
        args = () if expected is None else (as_bytes(expected, "expected"),)
        await self._ready()  # detection first, as for every GOBLIN step
        command = scripts.FORGET.call(False, keys, args)
        forget_everywhere(keys)
        try:
            (reply,) = await self._executor.send(keys[0], [command])
        finally:
            forget_everywhere(keys)
        return int(unwrap(reply, self._acl_user))

    # -- compound steps, one round trip each --

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> Published:
        """SET result PX ttl NX + CAEXPIRE claim, in one MULTI/EXEC (both keys share a slot):
        a stored result is never written over. See `Store.publish` for the replies.

        On a single server's shared connection, the EXEC's reply is read here when nothing
        in the transaction failed (`claim_unless_done`)."""
        rk = result_key if type(result_key) is bytes else as_bytes(result_key)
        ck = claim_key if type(claim_key) is bytes else as_bytes(claim_key)
        v = value if type(value) is bytes else as_bytes(value, "value")
        if len(v) > self.max_value_bytes:
            check_size(v, self.max_value_bytes)  # refused, as the native command does
        tok = token if type(token) is bytes else as_bytes(token, "token")
        ttl = publish_ttl(ttl_ms)
        detection = self._detection
        if not detection.done:
            await self._ready()
        try:  # `_executor`, inline
            executor = self._loops[get_running_loop()]
        except (KeyError, RuntimeError):
            executor = self._executor
        if self.replay_cache_bytes:
            self._forget((rk, ck))  # changed below: what this process kept of them is over
        native = detection.mode == "native"
        shared = executor.shared
        if shared is None:
            step = publish_step(native, rk, v, ttl, ck, tok)
            replies, acked = await executor.send_durably(ck, step)
        else:
            replies = await shared.execute(publish_wire(native, rk, v, ttl, ck, tok))
            done = replies[-1]  # EXEC's: a list only if MULTI and both commands were queued
            if (
                type(done) is list
                and len(done) == 2
                and type(done[1]) is int
                and type(done[0]) in _SET_REPLIES
            ):
                stored, renewed = done
                if stored is not None:
                    return WRITTEN[renewed]
                return await self._stood(rk, v, ck, tok, renewed)
            step = publish_step(native, rk, v, ttl, ck, tok)
            replies, acked = await executor.resent(ck, step, replies), NOT_WAITED
        written, renewed = self._published(replies, acked)
        return WRITTEN[renewed] if written else await self._stood(rk, v, ck, tok, renewed)

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        """Pipelined CAEXPIREs (not a transaction: each renewal stands alone)."""
        if not renewals:
            return []
        native = await self._ready()
        names = [as_bytes(key) for key, _, _ in renewals]
        commands = [
            scripts.CAEXPIRE.call(native, (name,), (as_bytes(expected), caexpire_ms(ms)))
            for name, (_, expected, ms) in zip(names, renewals, strict=True)
        ]
        self._forget(names)
        try:
            replies = await self._executor.send_each(commands)
        finally:
            self._forget(names)
        return [renewal_reply(r, self._acl_user) for r in replies]


def _client_from_url(
    url: str,
    cluster: bool,
    max_connections: int,
    pool_timeout: float,
    socket_timeout: float,
    **kwargs: Any,
) -> AnyRedis:
    kwargs["decode_responses"] = False
    kwargs.setdefault("socket_connect_timeout", socket_timeout)
    kwargs["socket_timeout"] = socket_timeout
    if cluster:
        return RedisCluster.from_url(url, max_connections=max_connections, **kwargs)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout, **kwargs
    )
    return redis.asyncio.Redis(connection_pool=pool)


def _check_client(client: object) -> None:
    """What goes in place of the client: a URL says to use from_url, a sync client says
    which kind of client, anything else what the store takes."""
    if isinstance(client, (redis.asyncio.Redis, RedisCluster)):
        return
    if isinstance(client, (str, bytes)):
        raise TypeError(
            "RedisStore takes a redis.asyncio client, not a URL: "
            "use RedisStore.from_url(url) (cluster=True for a Redis Cluster)"
        )
    what = f"a {type(client).__module__}.{type(client).__qualname__}"
    if hasattr(client, "execute_command"):  # redis.Redis, redis.RedisCluster
        raise TypeError(
            f"RedisStore needs an asyncio client (redis.asyncio.Redis or "
            f"redis.asyncio.RedisCluster), not {what}: build one with RedisStore.from_url(url)"
        )
    raise TypeError(
        "RedisStore takes a redis.asyncio.Redis or redis.asyncio.RedisCluster client, "
        f"not {what}: build one with RedisStore.from_url(url)"
    )


def _check_replay_cache(replay_cache_bytes: object) -> None:
    if isinstance(replay_cache_bytes, bool) or not isinstance(replay_cache_bytes, int):
        raise TypeError("replay_cache_bytes must be an int (0 turns the replay cache off)")
    if replay_cache_bytes < 0:
        raise ValueError(
            "replay_cache_bytes must be 0 (off) or a budget in bytes "
            f"(the default: {DEFAULT_REPLAY_CACHE_BYTES}), not {replay_cache_bytes}"
        )


def _check_options(
    client: AnyRedis, mode: str, wait_replicas: object, wait_timeout: object
) -> None:
    """A configuration error says what to change, at construction."""
    if mode not in ("auto", "native", "script"):
        raise ValueError(f"mode must be 'auto', 'native' or 'script', not {mode!r}")
    if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int):
        raise TypeError("wait_replicas must be an int")
    if wait_replicas < 0:
        raise ValueError("wait_replicas must be 0 (off) or a positive number of replicas")
    seconds("wait_timeout_seconds", wait_timeout, minimum=0.001)  # WAIT 0 blocks forever
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()
    else:
        kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("decode_responses", False):
        raise ValueError(
            "RedisStore needs a client with decode_responses=False: "
            "stored results are bytes and may not be UTF-8"
        )
