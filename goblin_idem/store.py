"""RedisStore: the GOBLIN commands on a Redis-protocol server, natively (a Goblin server,
or Redis/Valkey with the goblin module loaded) or as the spec's Lua scripts via EVALSHA.

The Store protocol and CLAIMED live in `protocol`, the rules every store shares in `rules`,
a server's error texts in `replies`; their names stay importable from here.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Literal, TypeAlias

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ResponseError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

from . import scripts
from .autopipeline import HIREDIS, AutoPipeline
from .errors import NotReplicatedError, StorePermissionError, invalid_expire
from .protocol import CLAIMED, Claimed, ClaimReply, KeyT, Store
from .replies import SCRIPT_CALLS as _SCRIPT_CALLS
from .replies import acl_rule as _acl_rule
from .replies import normalize as _normalize
from .replies import permission_error as _permission_error
from .replies import renewal_reply as _renewal_reply
from .replies import unwrap as _unwrap
from .rules import as_bytes, caexpire_ms, check_size, claim_reply, claim_seconds

__all__ = [
    "CLAIMED",
    "ClaimReply",
    "Claimed",
    "KeyT",
    "NotReplicatedError",
    "RedisStore",
    "Store",
    "StorePermissionError",
    "as_bytes",
]

logger = logging.getLogger("goblin_idem.store")


Mode: TypeAlias = Literal["auto", "native", "script"]

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

# Set while detection runs its probe, so that the probe's own store calls do not wait for
# the detection they are part of.
_PROBING: Final[contextvars.ContextVar[bool]] = contextvars.ContextVar(
    "goblin_idem_probing", default=False
)
# Detection's log lines, gathered here instead of logged while set: the middleware's startup
# logs them as one line (`RedisStore.detection_notes`).
_NOTES: Final[contextvars.ContextVar[list[tuple[int, str]] | None]] = contextvars.ContextVar(
    "goblin_idem_detection_notes", default=None
)


def _note(level: int, message: str, *args: object) -> None:
    notes = _NOTES.get()
    if notes is None:
        logger.log(level, message, *args)
    else:
        notes.append((level, message % args))


# -- RedisStore ---------------------------------------------------------------------------

AnyRedis: TypeAlias = redis.asyncio.Redis | RedisCluster


class RedisStore:
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
    every claim is followed by ``WAIT N wait_timeout_ms`` on the same connection, in one
    pipeline (one round trip; WAIT measures the replication offset of the connection that
    wrote). A won claim that fewer than N replicas acknowledged within ``wait_timeout_ms``
    raises `NotReplicatedError` (a RedisError: the middleware answers 503 and runs nothing;
    the claim stays on the primary until its lease expires). Only won claims are checked;
    a claim that found the key held or done wrote nothing. `publish` is followed by the
    same WAIT (after its MULTI/EXEC), so that a failover cannot lose a published response
    and let its key run again once the claim's lease runs out; a publish that too few
    replicas acknowledged raises `NotReplicatedError` as well (the middleware retries it
    once, then counts ``publish_errors``). Lease renewals are not waited for. Every keyed
    request pays the replication round trip, and while fewer than N replicas are connected
    each claim waits the full ``wait_timeout_ms``. In a cluster, redis-py cannot route a
    keyless WAIT, so these pipelines go through one plain connection pool per primary (the
    one the cluster client's slot table names for the key, with its connection settings),
    following MOVED (after refreshing the cluster client's slot table) and ASK redirects.

    Auto-pipelining (``autopipeline=True``, the default): on a single server, without
    ``wait_replicas``, the GOBLIN commands and `publish` of every concurrent caller share
    one connection per event loop (`AutoPipeline`), written together once per loop turn,
    instead of a pooled redis-py connection each: about a tenth of the CPU per call. It
    opens its own connection with the client's settings, and is skipped (everything goes
    through redis-py) for a cluster, TLS, a credential provider, a custom connection
    class, or without hiredis. Plain commands, mode detection and script loading always
    use the client.

    Detection (`detect`, or the first command): the mode, the ACL user's permission for
    every command the store sends (`StorePermissionError` names what is refused), and the
    server's eviction policy (a WARNING when it can evict goblin-idem's keys).

    Processes and loops: connections belong to the process and event loop that opened
    them. A store used before a fork, or in a loop that has since closed, drops those
    connections (without writing to or closing the parent's sockets) and opens new ones
    on its first command in the child or the new loop.
    """

    def __init__(
        self,
        client: AnyRedis,
        *,
        mode: Mode = "auto",
        max_value_bytes: int | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        autopipeline: bool = True,
    ) -> None:
        if mode not in ("auto", "native", "script"):
            raise ValueError(f"mode must be 'auto', 'native' or 'script', not {mode!r}")
        if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int):
            raise TypeError("wait_replicas must be an int")
        if wait_replicas < 0:
            raise ValueError("wait_replicas must be 0 (off) or a positive number of replicas")
        if isinstance(wait_timeout_ms, bool) or not isinstance(wait_timeout_ms, int):
            raise TypeError("wait_timeout_ms must be an int")
        if wait_timeout_ms <= 0:
            raise ValueError("wait_timeout_ms must be positive (WAIT 0 would block forever)")
        if _decodes_responses(client):
            raise ValueError(
                "RedisStore needs a client with decode_responses=False: "
                "stored results are bytes and may not be UTF-8"
            )
        self.client = client
        self.max_value_bytes = max_value_bytes
        self._mode: Mode = mode
        self._owns_client = False
        self._detecting: asyncio.Lock | None = None
        self._detected = False  # mode resolved, server checked (see `detect`)
        self._acl_user = str(client.get_connection_kwargs().get("username") or "default")
        self._loop: asyncio.AbstractEventLoop | None = None  # where the connections were made
        self._forks = _forks
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._primaries: dict[tuple[str, int], redis.asyncio.Redis] = {}
        # WAIT blocks its connection, so it never goes on the shared one.
        self._pipeline = (
            AutoPipeline.for_client(client) if autopipeline and not wait_replicas else None
        )
        if (
            autopipeline
            and not wait_replicas
            and not HIREDIS
            and type(client) is redis.asyncio.Redis
        ):
            logger.info(
                "goblin-idem store: auto-pipelining is off because hiredis is not installed "
                "(pip install 'goblin-idem[fast]'); every call goes through redis-py"
            )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        mode: Mode = "auto",
        max_value_bytes: int | None = None,
        cluster: bool = False,
        max_connections: int = 256,
        pool_timeout: float = 5.0,
        socket_timeout: float = 5.0,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        autopipeline: bool = True,
        **kwargs: Any,
    ) -> RedisStore:
        """A store that owns its client (closed by `aclose`).

        The pool waits up to `pool_timeout` for a free connection instead of failing at
        `max_connections`, and a socket timeout bounds how long a request can hang on a
        store that stopped answering; both end in a store error, never a silent wait.
        `wait_replicas`, `wait_timeout_ms` and `autopipeline` are the class's options.
        """
        kwargs["decode_responses"] = False
        kwargs.setdefault("socket_connect_timeout", socket_timeout)
        kwargs["socket_timeout"] = socket_timeout
        client: AnyRedis
        if cluster:
            client = RedisCluster.from_url(url, max_connections=max_connections, **kwargs)
        else:
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=pool_timeout, **kwargs
            )
            client = redis.asyncio.Redis(connection_pool=pool)
        store = cls(
            client,
            mode=mode,
            max_value_bytes=max_value_bytes,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
            autopipeline=autopipeline,
        )
        store._owns_client = True
        return store

    @property
    def address(self) -> str:
        """Where the store is: ``host:port`` or a socket path (a cluster's startup nodes)."""
        client = self.client
        if isinstance(client, RedisCluster):
            return ", ".join(n.name for n in _startup_nodes(client))
        return self._where(None)

    @property
    def mode(self) -> Mode:
        """``"native"`` or ``"script"``; ``"auto"`` until the first command has detected it."""
        return self._mode

    async def aclose(self) -> None:
        self._here()  # a fork's child must not close the sockets it shares with its parent
        if self._pipeline is not None:
            await self._pipeline.aclose()
        primaries, self._primaries = list(self._primaries.values()), {}
        for primary in primaries:
            await primary.aclose()
        if self._owns_client:
            if isinstance(self.client, RedisCluster):
                await self.client.aclose()
            else:  # a pool passed to Redis() is not closed with it unless asked
                await self.client.aclose(close_connection_pool=True)

    # -- detection: the mode, the user's permissions, the eviction policy --

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
        self._here()
        if self._detected:
            return self._mode
        if self._detecting is None:
            self._detecting = asyncio.Lock()
        async with self._detecting:
            if not self._detected:
                await self._detect_once()
        return self._mode

    async def detection_notes(self) -> list[tuple[int, str]]:
        """`detect`, with the lines it would log returned as ``(level, text)`` instead; none
        if detection had already run. Raises as `detect` does."""
        notes: list[tuple[int, str]] = []
        token = _NOTES.set(notes)
        try:
            await self.detect()
        except BaseException:
            for level, text in notes:  # what was found before the failure still counts
                logger.log(level, "%s", text)
            raise
        finally:
            _NOTES.reset(token)
        return notes

    async def _detect_once(self) -> None:
        auto = self._mode == "auto"
        if auto:
            try:
                native = await self._has_native_commands()
            except NoPermissionError as exc:
                raise self._refused(
                    ("command|list",),
                    "to detect the mode (or give mode='native' or 'script')",
                ) from exc
            self._mode = "native" if native else "script"
        refused = await self._probe()
        await self._check_eviction()
        self._detected = True
        if auto:
            _note(
                logging.INFO,
                "goblin-idem store mode: %s (%s)",
                self._mode,
                "GOBLIN.CLAIM found on the server"
                if self._mode == "native"
                else "server lacks GOBLIN.CLAIM; running the Lua scripts with EVALSHA",
            )
        if refused:
            raise self._refused(tuple(sorted(refused)), f"in {self._mode} mode")

    def _refused(self, commands: tuple[str, ...], context: str) -> StorePermissionError:
        user = self._acl_user
        return StorePermissionError(
            f"the store's ACL user {user!r} may not run {', '.join(commands)}, which "
            f"goblin-idem sends {context}: allow them with ACL SETUSER {user} "
            f"{_acl_rule(commands)} (the README's Permissions section lists every command)",
            denied=commands,
        )

    async def _probe(self) -> set[str]:
        """Send each command the store uses once, on probe keys that expire in seconds; the
        commands an ACL refused. A refused key says the command itself was allowed (servers
        check the command first); it is logged, since the middleware's namespace is not
        known here."""
        tag = b"goblin-idem:probe:{%d-%s}:" % (
            os.getpid(),
            secrets.token_hex(4).encode(),
        )
        ck, rk, tok = tag + b"c", tag + b"r", b"probe"
        steps: list[Callable[[], Awaitable[object]]] = [
            lambda: self.claim_unless_done(ck, rk, tok, 5),  # CLAIM, PTTL (WAIT)
            lambda: self.publish(rk, b"probe", 5000, ck, tok),  # MULTI, SET, CAEXPIRE, EXEC
            lambda: self.cas(rk, b"probe", b"probe"),
            lambda: self.set(ck, tok, px=5000, nx=True),
            lambda: self.get(rk),
            lambda: self.pttl(rk),
            lambda: self.cad(ck, tok),
            lambda: self.delete(ck, rk),
        ]
        if self._mode == "script":  # what the scripts call, named (Redis 7.0 does not)
            steps[:0] = [self._load_scripts, lambda: self.client.pexpire(ck, 5000)]
        refused: set[str] = set()
        in_script = False  # a command inside a script, unnamed (Redis 7.0)
        keys_refused: StorePermissionError | None = None
        token = _PROBING.set(True)
        try:
            for step in steps:
                try:
                    await step()
                except (ResponseError, NotReplicatedError) as exc:  # OOM, WAIT: allowed
                    denied = _permission_error(exc, self._acl_user)
                    if denied is None:
                        continue
                    if denied.keys:
                        keys_refused = denied
                    elif denied.denied == _SCRIPT_CALLS:
                        in_script = True
                    else:
                        refused.update(denied.denied)
        finally:
            _PROBING.reset(token)
        if in_script and not refused & set(_SCRIPT_CALLS):
            refused.update(_SCRIPT_CALLS)
        if keys_refused is not None:
            _note(
                logging.INFO,
                "goblin-idem store: the ACL refused the probe key %r (%s); the middleware's "
                "keys must be allowed (its namespace, ~idem:* by default)",
                ck.decode(),
                keys_refused,
            )
        return refused

    async def _check_eviction(self) -> None:
        """Warn when a server may evict goblin-idem's keys, or its policy cannot be read."""
        for node in self._nodes():
            where = self._where(node)
            try:
                policy, limit = await self._memory_settings(node)
            except ResponseError as exc:
                _note(logging.WARNING, _UNCHECKED, where, exc)
                continue
            if policy != "noeviction":
                _note(
                    logging.WARNING,
                    _EVICTS,
                    where,
                    policy,
                    limit,
                    " (volatile-* evicts keys that have a TTL: every goblin-idem key has one)"
                    if policy.startswith("volatile-")
                    else "",
                    " Its maxmemory is 0 (no limit), so nothing is evicted until one is set."
                    if limit == "0"
                    else "",
                )

    async def _memory_settings(self, node: Any) -> tuple[str, str]:
        """maxmemory-policy and maxmemory, from CONFIG GET or else INFO memory (managed
        services rename CONFIG, and an ACL may refuse it, since it also reads secrets)."""
        try:
            config = _pairs(await self._node_command(node, "CONFIG GET", "maxmemory*"))
            return config["maxmemory-policy"], config.get("maxmemory", "?")
        except (ResponseError, KeyError) as exc:
            refused = f"CONFIG GET: {exc}"
        try:
            info = await self._node_command(node, "INFO", "memory")
            return str(info["maxmemory_policy"]), str(info.get("maxmemory", "?"))
        except (ResponseError, KeyError) as exc:
            raise ResponseError(f"{refused}; INFO memory: {exc}") from None

    def _where(self, node: Any) -> str:
        if node is not None:
            return str(node.name)
        kwargs = self.client.get_connection_kwargs()
        if kwargs.get("path"):
            return str(kwargs["path"])
        return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"

    # -- connections belong to a process and an event loop --

    def _here(self) -> None:
        """Before any command: drop connections this process or loop cannot use."""
        if self._loop is not asyncio.get_running_loop() or self._forks != _forks:
            self._adopt_loop()

    def _adopt_loop(self) -> None:
        """Connections belong to the process and event loop that opened them. In a fork's
        child (``gunicorn --preload``: the app imported, and the store used, before the fork)
        they are the parent's sockets; after ``asyncio.run()`` returned, their loop is
        closed. Either way they are dropped, never written to or closed, and new ones open
        on first use, as redis-py's synchronous pool does after a fork. A loop that is
        merely another one (a second thread's) keeps its connections."""
        forked = self._forks != _forks
        previous = self._loop
        if forked or (previous is not None and previous.is_closed()):
            self._drop_connections(keep=forked)
        self._loop, self._forks = asyncio.get_running_loop(), _forks

    def _drop_connections(self, *, keep: bool) -> None:
        dropped: list[object] = []
        if self._pipeline is not None:
            dropped += self._pipeline.forget()
        dropped += self._primaries.values()
        self._primaries = {}
        self._detecting = None
        client = self.client
        if isinstance(client, RedisCluster):
            nodes = {id(n): n for n in (*client.get_nodes(), *_startup_nodes(client))}
            for node in nodes.values():  # redis-py has no public way to reset a node's pool
                connections = getattr(node, "_connections", None)
                if isinstance(connections, list):
                    dropped += connections
                    node._connections = []
                    node._free.clear()
        else:
            pool = client.connection_pool
            dropped += getattr(pool, "_available_connections", ())
            dropped += getattr(pool, "_in_use_connections", ())
            pool.reset()  # type: ignore[no-untyped-call]
            if getattr(client, "connection", None) is not None:  # single_connection_client
                dropped.append(client.connection)
                client.connection = None
        if keep:
            _inherited.extend(dropped)

    def _nodes(self) -> list[Any]:
        if isinstance(self.client, RedisCluster):
            return list(self.client.get_primaries())
        return [None]

    async def _node_command(self, node: Any, *args: Any) -> Any:
        if node is None:
            return await self.client.execute_command(*args)
        return await self.client.execute_command(*args, target_nodes=node)

    async def _has_native_commands(self) -> bool:
        """True only if every primary knows GOBLIN.CLAIM.

        COMMAND LIST FILTERBY PATTERN answers a plain list on Redis >= 7, Valkey and every
        cluster node, where ``COMMAND INFO`` of an unknown name would trip redis-py's reply
        parser; a server without COMMAND LIST is asked ``COMMAND INFO`` as one raw argument.
        """
        if isinstance(self.client, RedisCluster):
            await self.client.initialize()
        for node in self._nodes():
            try:
                names = await self._node_command(
                    node, "COMMAND LIST", "FILTERBY", "PATTERN", "goblin.claim"
                )
                found = any(as_bytes(n).lower() == b"goblin.claim" for n in names or ())
            except ResponseError:
                info = await self._node_command(node, "COMMAND INFO", "goblin.claim")
                found = bool(info) and info[0] is not None
            if not found:
                return False
        return True

    async def _load_scripts(self, node: Any = None) -> None:
        if self._pipeline is not None:  # the connection that met NOSCRIPT is surely up
            loaded = await self._pipeline.execute([("SCRIPT", "LOAD", s.body) for s in scripts.ALL])
            for reply in loaded:
                if isinstance(reply, Exception):
                    raise reply
            return
        nodes = [node] if node is not None else self._nodes()
        for n in nodes:
            for script in scripts.ALL:
                await self._node_command(n, "SCRIPT LOAD", script.body)

    async def _ready(self) -> Mode:
        """The mode, once detection has run, on connections of this process and loop."""
        self._here()
        if self._detected or _PROBING.get():
            return self._mode
        return await self.detect()

    @staticmethod
    def _command(
        mode: Mode, script: scripts.Script, keys: Sequence[bytes], args: Sequence[Any]
    ) -> tuple[Any, ...]:
        if mode == "native":
            return (script.command, *keys, *args)
        return ("EVALSHA", script.sha, len(keys), *keys, *args)

    async def _reload_scripts(self, key: bytes) -> None:
        """After NOSCRIPT (a restarted or failed-over server forgot the scripts), load them
        where the key lives; a NOSCRIPT ran nothing, so the caller may simply retry."""
        node = None
        if isinstance(self.client, RedisCluster):
            node = self.client.get_node_from_key(key)  # type: ignore[arg-type]
        await self._load_scripts(node)

    async def _resend(self, commands: list[tuple[Any, ...]], key: bytes) -> list[Any]:
        """After NOSCRIPT on the shared connection (the script ran nothing, and what follows
        it only reads): load the scripts, send `commands` again; their replies."""
        assert self._pipeline is not None
        await self._reload_scripts(key)
        return await self._pipeline.execute(commands)

    async def _call(self, script: scripts.Script, keys: Sequence[bytes], *args: Any) -> Any:
        command = self._command(await self._ready(), script, keys, args)
        if self._pipeline is not None:
            (reply,) = await self._pipeline.execute([command])
            if isinstance(reply, NoScriptError):
                (reply,) = await self._resend([command], keys[0])
            return _unwrap(reply, self._acl_user)
        try:
            try:
                return await self.client.execute_command(*command)
            except NoScriptError:
                await self._reload_scripts(keys[0])
                return await self.client.execute_command(*command)
        except ResponseError as exc:
            raise _normalize(exc, self._acl_user) from None

    # -- the four GOBLIN commands --

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """Atomically: SET claim_key token NX EX seconds, else GET result_key."""
        keys = (as_bytes(claim_key), as_bytes(result_key))
        tok = check_size(as_bytes(token, "token"), self.max_value_bytes)
        if self.wait_replicas:
            return await self._claim_replicated(keys, tok, claim_seconds(seconds))
        return claim_reply(await self._call(scripts.CLAIM, keys, tok, claim_seconds(seconds)))

    async def claim_unless_done(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIM, then PTTL of the result, in one round trip (pipelined, on one connection,
        in that order: a result published between the two is seen). See
        `Store.claim_unless_done` for what the replies promise."""
        ck, rk = as_bytes(claim_key), as_bytes(result_key)
        tok = check_size(as_bytes(token, "token"), self.max_value_bytes)
        lease = claim_seconds(seconds)
        commands = [self._command(await self._ready(), scripts.CLAIM, (ck, rk), (tok, lease))]
        commands.append(("PTTL", rk))
        acked = None
        if self._pipeline is not None:
            reply, result_ttl = await self._pipeline.execute(commands)
            if isinstance(reply, NoScriptError):
                reply, result_ttl = await self._resend(commands, ck)
        else:
            (reply, result_ttl), acked = await self._then_wait(
                ck, commands, wait=bool(self.wait_replicas)
            )
        if isinstance(reply, OutOfMemoryError):
            return await self._read_when_full(ck, rk, reply)
        claimed = claim_reply(_unwrap(reply, self._acl_user))
        if claimed is not CLAIMED:
            return claimed
        ttl = int(_unwrap(result_ttl, self._acl_user))
        if ttl != -2:
            survived = await self._result_survived(ck, rk, tok, lease, ttl)
            if survived is not CLAIMED:
                return survived
        if self.wait_replicas:
            self._check_acked(acked, "the claim (it stays until its lease expires)")
        return CLAIMED

    async def _result_survived(
        self, ck: bytes, rk: bytes, token: bytes, lease: int, result_ttl: int
    ) -> ClaimReply:
        """The claim was won, yet a result is stored: the claim had been lost. Read the
        result and keep the claim as long as the result (a lease at least, so that it never
        expires under a run should the result have expired meanwhile): one round trip."""
        keep = max(result_ttl, lease * 1000)
        renew = self._command(self._mode, scripts.CAEXPIRE, (ck,), (token, keep))
        (value, _), _ = await self._then_wait(ck, [("GET", rk), renew], wait=False)
        if _unwrap(value, self._acl_user) is None:  # expired meanwhile: the claim is the
            return CLAIMED  # caller's to run
        logger.warning(
            "goblin-idem store: the claim %s was gone while its result was stored (evicted, "
            "or lost in a restart or failover): answered from the result instead of running "
            "again, and the claim is retaken for the result's TTL",
            ck.decode("latin-1"),
        )
        return as_bytes(value, "reply")

    async def _read_when_full(self, ck: bytes, rk: bytes, refused: OutOfMemoryError) -> ClaimReply:
        """CLAIM was refused for memory (it writes): answer from reads, which a full server
        still serves. A stored result is the answer; a held claim is in flight; only a free
        key has nothing to go by, and gets the refusal."""
        (value, claim_ttl), _ = await self._then_wait(ck, [("GET", rk), ("PTTL", ck)], wait=False)
        if _unwrap(value, self._acl_user) is not None:
            return as_bytes(value, "reply")
        if int(_unwrap(claim_ttl, self._acl_user)) != -2:
            return None
        raise refused

    async def caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        """Atomically: if GET key == expected, PEXPIRE key ms (ms <= 0 deletes)."""
        k, e = as_bytes(key), as_bytes(expected, "expected")
        return int(await self._call(scripts.CAEXPIRE, (k,), e, caexpire_ms(ms)))

    async def cas(self, key: KeyT, expected: KeyT, new: KeyT) -> bool:
        """Atomically: if GET key == expected, SET key new KEEPTTL."""
        k, e = as_bytes(key), as_bytes(expected, "expected")
        n = check_size(as_bytes(new, "new"), self.max_value_bytes)
        reply = await self._call(scripts.CAS, (k,), e, n)
        return reply in (b"OK", "OK", True)

    async def cad(self, key: KeyT, expected: KeyT) -> int:
        """Atomically: if GET key == expected, DEL key."""
        k, e = as_bytes(key), as_bytes(expected, "expected")
        return int(await self._call(scripts.CAD, (k,), e))

    # -- compound steps, one round trip each --

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> int:
        """SET result PX ttl + CAEXPIRE claim, in one MULTI/EXEC (both keys share a slot)."""
        rk, ck = as_bytes(result_key), as_bytes(claim_key)
        v = check_size(as_bytes(value, "value"), self.max_value_bytes)
        tok = as_bytes(token, "token")
        ttl = caexpire_ms(ttl_ms)
        if ttl <= 0:
            raise ResponseError(invalid_expire("set"))
        renew = self._command(await self._ready(), scripts.CAEXPIRE, (ck,), (tok, ttl))
        if (
            self._pipeline is not None
            or self.wait_replicas
            or isinstance(self.client, RedisCluster)
        ):
            # On the shared connection; or followed by WAIT; or, in a cluster, to the
            # primary over a plain connection, because redis-py's async cluster client
            # runs a transaction pipeline in a thread of its own, which breaks after a
            # topology change.
            return await self._publish_on_primary(ck, ("SET", rk, v, "PX", ttl), renew)
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=True)
            pipe.execute_command("SET", rk, v, "PX", ttl)
            pipe.execute_command(*renew)
            try:
                _, renewed = await pipe.execute()
                return int(renewed)
            except NoScriptError:
                if attempt == 2:
                    raise
                await self._reload_scripts(ck)  # repeating SET and CAEXPIRE is harmless
            except ResponseError as exc:
                raise _normalize(exc, self._acl_user) from None
        raise AssertionError("unreachable")

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        """Pipelined CAEXPIREs (not a transaction: each renewal stands alone)."""
        if not renewals:
            return []
        mode = await self._ready()
        commands = [
            self._command(
                mode,
                scripts.CAEXPIRE,
                (as_bytes(key),),
                (as_bytes(expected), caexpire_ms(ms)),
            )
            for key, expected, ms in renewals
        ]
        replies: list[Any]
        if self._pipeline is not None:
            replies = await self._pipeline.execute(commands)
        else:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = await pipe.execute(raise_on_error=False)
        if mode == "script" and any(isinstance(r, NoScriptError) for r in replies):
            await self._load_scripts()
            return await self.caexpire_many(renewals)
        return [_renewal_reply(r, self._acl_user) for r in replies]

    # -- durability: a write and WAIT on one connection (wait_replicas > 0) --

    async def _claim_replicated(
        self, keys: tuple[bytes, bytes], token: bytes, seconds: int
    ) -> ClaimReply:
        command = self._command(await self._ready(), scripts.CLAIM, keys, (token, seconds))
        (reply,), acked = await self._then_wait(keys[0], [command])
        claimed = claim_reply(_unwrap(reply, self._acl_user))
        if claimed is CLAIMED:
            self._check_acked(acked, "the claim (it stays until its lease expires)")
        return claimed

    async def _publish_on_primary(
        self, claim_key: bytes, set_result: tuple[Any, ...], renew: tuple[Any, ...]
    ) -> int:
        replies, acked = await self._then_wait(
            claim_key,
            [("MULTI",), set_result, renew, ("EXEC",)],
            wait=bool(self.wait_replicas),
        )
        for reply in replies:
            _unwrap(reply, self._acl_user)
        _, renewed = replies[-1]
        _unwrap(renewed, self._acl_user)
        if self.wait_replicas:
            self._check_acked(acked, "the published response")
        return int(renewed)

    def _check_acked(self, acked: Any, what: str) -> None:
        if isinstance(acked, Exception):
            raise acked
        if int(acked) < self.wait_replicas:
            raise NotReplicatedError(
                f"WAIT: {int(acked)} of {self.wait_replicas} replica(s) acknowledged "
                f"{what} within {self.wait_timeout_ms} ms"
            )

    async def _then_wait(
        self, key: bytes, commands: Sequence[tuple[Any, ...]], *, wait: bool = True
    ) -> tuple[list[Any], Any]:
        """Send `commands` then WAIT (unless `wait` is false) on one connection of the
        primary that serves `key`, in one round trip; the replies of `commands` (errors in
        place) and WAIT's reply (None without WAIT).

        NOSCRIPT (a queued EVALSHA inside MULTI reports it in EXEC's reply) reloads the
        scripts there and sends again: it ran nothing, and repeating the SET of a publish is
        harmless. In a cluster, MOVED refreshes the cluster client's slot table and sends to
        the new owner; ASK sends to the named node after ASKING; a connection error
        refreshes the slot table, and is retried only if another node now owns the slot
        (a claim that did reach the old primary then reads as in flight, never as won).
        """
        cluster = isinstance(self.client, RedisCluster)
        ask: tuple[str, int] | None = None
        for _ in range(5):
            node = await self._primary_for(key, ask) if cluster else None
            client = self._primary_client(node) if node is not None else self.client
            sent: list[tuple[Any, ...]] = [("ASKING",)] if ask is not None else []
            sent += commands
            if wait:
                sent.append(("WAIT", self.wait_replicas, self.wait_timeout_ms))
            try:
                if self._pipeline is not None and not wait:
                    replies = await self._pipeline.execute(sent)
                else:
                    pipe = client.pipeline(transaction=False)
                    for command in sent:
                        pipe.execute_command(*command)
                    replies = await pipe.execute(raise_on_error=False)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                if not cluster:
                    raise
                await self._refresh_slots()
                if ask is None and await self._primary_for(key, None) != node:
                    continue
                raise
            if ask is not None:
                replies = replies[1:]
            mine, acked = (replies[:-1], replies[-1]) if wait else (replies, None)
            ask = None
            nested = mine[-1] if isinstance(mine[-1], list) else []
            if cluster:
                redirect = next((r for r in mine if isinstance(r, AskError)), None)
                if isinstance(redirect, MovedError):
                    await self._refresh_slots()
                    continue
                if redirect is not None:
                    ask = self._remap(redirect.host, redirect.port)
                    continue
            if any(isinstance(r, NoScriptError) for r in (*mine, *nested)):
                if node is None:
                    await self._load_scripts()
                else:
                    for script in scripts.ALL:
                        await client.execute_command("SCRIPT LOAD", script.body)
                continue
            return mine, acked
        raise ResponseError("WAIT pipeline: too many redirections or script reloads")

    def _remap(self, host: str, port: int) -> tuple[str, int]:
        assert isinstance(self.client, RedisCluster)
        remapped = self.client.nodes_manager.remap_host_port(host, port)
        return str(remapped[0]), int(remapped[1])

    async def _primary_for(self, key: bytes, ask: tuple[str, int] | None) -> tuple[str, int]:
        if ask is not None:
            return ask
        assert isinstance(self.client, RedisCluster)
        await self.client.initialize()  # a no-op unless redis-py flagged the layout stale
        node = self.client.get_node_from_key(key)  # type: ignore[arg-type]
        if node is None:
            raise ResponseError("no primary serves the key's slot")
        return str(node.host), int(node.port)

    async def _refresh_slots(self) -> None:
        assert isinstance(self.client, RedisCluster)
        try:
            await self.client.nodes_manager.initialize()
        except Exception as exc:  # the cluster client refreshes again on its next command
            logger.warning(
                "could not refresh the cluster slot table: %s: %s",
                type(exc).__name__,
                exc,
            )

    def _primary_client(self, address: tuple[str, int]) -> redis.asyncio.Redis:
        """A plain client of one primary, with the cluster client's connection settings and
        no retries of its own (a retry belongs to `_then_wait`, which knows the topology)."""
        client = self._primaries.get(address)
        if client is None:
            assert isinstance(self.client, RedisCluster)
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
            client = self._primaries[address] = redis.asyncio.Redis(connection_pool=pool)
        return client

    # -- plain commands --

    async def _plain(self, command: Awaitable[Any]) -> Any:
        """A redis-py call (not yet started), on connections of this process and loop."""
        self._here()
        try:
            return await command
        except ResponseError as exc:
            raise _normalize(exc, self._acl_user) from None

    async def get(self, key: KeyT) -> bytes | None:
        reply = await self._plain(self.client.get(as_bytes(key)))
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
        v = check_size(as_bytes(value, "value"), self.max_value_bytes)
        return bool(await self._plain(self.client.set(as_bytes(key), v, ex=ex, px=px, nx=nx)))

    async def pttl(self, key: KeyT) -> int:
        return int(await self._plain(self.client.pttl(as_bytes(key))))

    async def delete(self, *keys: KeyT) -> int:
        if not keys:
            return 0
        return int(await self._plain(self.client.delete(*(as_bytes(k) for k in keys))))


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


_UNCHECKED: Final = (
    "goblin-idem store: could not read the eviction policy of %s (%s): make sure its "
    "maxmemory-policy is noeviction, or that it never reaches maxmemory (README: Failover, "
    "restarts and eviction)"
)
_EVICTS: Final = (
    "goblin-idem store: %s evicts keys when memory is full (maxmemory-policy %s, maxmemory "
    "%s)%s. It can evict a completed key's result (a duplicate then runs the work again, or "
    "gets 409 in-flight until the claim's TTL ends if the claim stayed) or a running "
    "request's claim (a duplicate then runs while the first run still does). Set "
    "maxmemory-policy noeviction (a full server then refuses new keys with 503 and still "
    "replays completed ones), or give it memory enough never to evict.%s"
)


def _pairs(reply: Any) -> dict[str, str]:
    """CONFIG GET's reply (a dict from redis-py's callback, or a flat list) as text."""
    items = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {as_bytes(k).decode(): as_bytes(v).decode() for k, v in items}


def _startup_nodes(client: RedisCluster) -> list[Any]:
    return list(client.nodes_manager.startup_nodes.values())


def _decodes_responses(client: AnyRedis) -> bool:
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()
    else:
        kwargs = client.connection_pool.connection_kwargs
    return bool(kwargs.get("decode_responses", False))
