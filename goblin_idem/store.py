"""The Store protocol, the argument rules every store shares, and RedisStore.

A store offers the four atomic GOBLIN commands (``../spec``): CLAIM, CAEXPIRE, CAS and CAD,
plus the plain GET/SET/PTTL/DEL the middleware needs. RedisStore speaks them to a
Redis-protocol server either natively (a Goblin server, or Redis/Valkey with the
goblin module loaded) or as the spec's Lua scripts via EVALSHA.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Sequence
from typing import Any, Final, Literal, Protocol, TypeAlias, runtime_checkable

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
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
from .errors import NOT_INTEGER, VALUE_TOO_LARGE, WRONGTYPE, NotReplicatedError, invalid_expire

__all__ = [
    "CLAIMED",
    "ClaimReply",
    "Claimed",
    "KeyT",
    "NotReplicatedError",
    "RedisStore",
    "Store",
]

logger = logging.getLogger("goblin_idem.store")

KeyT: TypeAlias = str | bytes
Mode: TypeAlias = Literal["auto", "native", "script"]

LLONG_MAX: Final = 2**63 - 1
LLONG_MIN: Final = -(2**63)


class Claimed(enum.Enum):
    """Type of the `CLAIMED` sentinel (an enum member, so `is CLAIMED` narrows for mypy)."""

    CLAIMED = "CLAIMED"

    def __repr__(self) -> str:
        return "CLAIMED"


CLAIMED: Final = Claimed.CLAIMED
"""`Store.claim` returns this when the caller won the claim and must do the work.

On the wire the reply is the bulk string ``CLAIMED``, which a result_key holding the
bytes ``b"CLAIMED"`` would also produce: every store maps that reply to this sentinel,
so never publish ``b"CLAIMED"`` as a result (goblin-idem's own records cannot be it).
"""

ClaimReply: TypeAlias = Claimed | bytes | None
_CLAIMED_WIRE: Final = b"CLAIMED"


@runtime_checkable
class Store(Protocol):
    """What the middleware and Lock need of a store; every method is one atomic step."""

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        """CLAIMED: do the work; bytes: it is done, use it; None: in flight, retry."""
        ...

    async def caexpire(self, key: KeyT, expected: KeyT, ms: int) -> int:
        """Renew `key`'s TTL to `ms` only while it still holds `expected`: 1, else 0."""
        ...

    async def cas(self, key: KeyT, expected: KeyT, new: KeyT) -> bool:
        """Swap to `new` only if `key` holds `expected`, keeping the TTL."""
        ...

    async def cad(self, key: KeyT, expected: KeyT) -> int:
        """Delete `key` only if it holds `expected`: 1, else 0."""
        ...

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> int:
        """SET result_key value PX ttl_ms and CAEXPIRE claim_key token ttl_ms, together.

        One round trip. Both or neither take effect, so a claim never expires before the
        result it guards (which would let a duplicate win a fresh claim and run again).
        Replies the CAEXPIRE: 1 if the claim was still this token's, else 0.
        """
        ...

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        """CAEXPIRE each (key, expected, ms) in one round trip; an error is returned in place."""
        ...

    async def get(self, key: KeyT) -> bytes | None: ...

    async def set(
        self,
        key: KeyT,
        value: KeyT,
        *,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
    ) -> bool: ...

    async def pttl(self, key: KeyT) -> int: ...

    async def delete(self, *keys: KeyT) -> int: ...

    async def aclose(self) -> None: ...


# -- argument rules shared by every store -------------------------------------------------


def as_bytes(value: object, what: str = "key") -> bytes:
    """Keys and values are binary-safe: str is UTF-8 encoded, anything else is a bug."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be str or bytes, not {type(value).__name__}")


def parse_int(value: object) -> int:
    """An int64 the way the server parses one (strict decimal, no spaces, no '+', no floats)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        digits = text[1:] if text.startswith("-") else text
        if (
            not digits
            or not digits.isascii()
            or not digits.isdigit()
            or (digits[0] == "0" and (len(digits) > 1 or text.startswith("-")))
        ):
            raise ResponseError(NOT_INTEGER)
        n = int(text)
    else:
        raise ResponseError(NOT_INTEGER)
    if not LLONG_MIN <= n <= LLONG_MAX:
        raise ResponseError(NOT_INTEGER)
    return n


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def claim_seconds(value: object) -> int:
    """GOBLIN.CLAIM's lease: a positive integer whose deadline fits in an int64 of ms."""
    seconds = parse_int(value)
    if seconds <= 0 or seconds > LLONG_MAX // 1000 or seconds * 1000 > LLONG_MAX - _now_ms():
        raise ResponseError(invalid_expire("goblin.claim"))
    return seconds


def caexpire_ms(value: object) -> int:
    """GOBLIN.CAEXPIRE's ms: any integer (non-positive deletes) whose deadline fits."""
    ms = parse_int(value)
    if ms > 0 and ms > LLONG_MAX - _now_ms():
        raise ResponseError(invalid_expire("goblin.caexpire"))
    return ms


def check_size(value: bytes, limit: int | None) -> bytes:
    if limit is not None and len(value) > limit:
        raise ResponseError(VALUE_TOO_LARGE)
    return value


def claim_reply(reply: object) -> ClaimReply:
    if reply is None:
        return None
    if reply == _CLAIMED_WIRE:
        return CLAIMED
    return as_bytes(reply, "reply")


def _normalize(exc: ResponseError) -> ResponseError:
    """Give a script-mode error the text the native command replies with.

    Validation makes this a safety net: only WRONGTYPE can normally come out of a script,
    and Redis 7 appends ``script: <sha>, on @user_script:N.`` to it.
    """
    if type(exc) is not ResponseError:
        return exc
    text = str(exc)
    if text.startswith("WRONGTYPE"):
        return ResponseError(WRONGTYPE)
    if " script: " in text:
        text = text.split(" script: ", 1)[0]
        text = text.replace("in 'set' command", "in 'goblin.claim' command")
        text = text.replace("in 'pexpire' command", "in 'goblin.caexpire' command")
        return ResponseError(text)
    return exc


# -- RedisStore ---------------------------------------------------------------------------

AnyRedis: TypeAlias = redis.asyncio.Redis | RedisCluster


class RedisStore:
    """The GOBLIN commands on a Redis-protocol server, natively or as Lua scripts.

    ``mode="native"`` sends GOBLIN.* as is; ``mode="script"`` runs the spec's Lua with
    EVALSHA (reloading on NOSCRIPT, in a cluster on the node that answered);
    ``mode="auto"`` asks the server once, before the first command, whether it knows
    GOBLIN.CLAIM, and `mode` then reads ``"native"`` or ``"script"``. Both modes give the
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
    def mode(self) -> Mode:
        """``"native"`` or ``"script"``; ``"auto"`` until the first command has detected it."""
        return self._mode

    async def aclose(self) -> None:
        if self._pipeline is not None:
            await self._pipeline.aclose()
        primaries, self._primaries = list(self._primaries.values()), {}
        for primary in primaries:
            await primary.aclose()
        if self._owns_client:
            await self.client.aclose()

    # -- mode detection --

    async def detect(self) -> Mode:
        """Resolve ``mode="auto"`` now (it otherwise happens on the first command)."""
        if self._mode != "auto":
            return self._mode
        if self._detecting is None:
            self._detecting = asyncio.Lock()
        async with self._detecting:
            if self._mode == "auto":
                native = await self._has_native_commands()
                if not native:
                    await self._load_scripts()
                self._mode = "native" if native else "script"
                logger.info(
                    "goblin-idem store mode: %s (%s)",
                    self._mode,
                    "GOBLIN.CLAIM found on the server"
                    if native
                    else "server lacks GOBLIN.CLAIM; running the Lua scripts with EVALSHA",
                )
        return self._mode

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

    async def _resolved_mode(self) -> Mode:
        return self._mode if self._mode != "auto" else await self.detect()

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

    async def _call(self, script: scripts.Script, keys: Sequence[bytes], *args: Any) -> Any:
        command = self._command(await self._resolved_mode(), script, keys, args)
        if self._pipeline is not None:
            (reply,) = await self._pipeline.execute([command])
            if isinstance(reply, NoScriptError):  # it ran nothing: load the scripts, resend
                await self._reload_scripts(keys[0])
                (reply,) = await self._pipeline.execute([command])
            if isinstance(reply, ResponseError):
                raise _normalize(reply)
            if isinstance(reply, Exception):
                raise reply
            return reply
        try:
            try:
                return await self.client.execute_command(*command)
            except NoScriptError:
                await self._reload_scripts(keys[0])
                return await self.client.execute_command(*command)
        except ResponseError as exc:
            raise _normalize(exc) from None

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
        renew = self._command(await self._resolved_mode(), scripts.CAEXPIRE, (ck,), (tok, ttl))
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
                raise _normalize(exc) from None
        raise AssertionError("unreachable")

    async def caexpire_many(
        self, renewals: Sequence[tuple[KeyT, KeyT, int]]
    ) -> list[int | Exception]:
        """Pipelined CAEXPIREs (not a transaction: each renewal stands alone)."""
        if not renewals:
            return []
        mode = await self._resolved_mode()
        commands = [
            self._command(
                mode, scripts.CAEXPIRE, (as_bytes(key),), (as_bytes(expected), caexpire_ms(ms))
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
        return [_renewal_reply(r) for r in replies]

    # -- durability: a write and WAIT on one connection (wait_replicas > 0) --

    async def _claim_replicated(
        self, keys: tuple[bytes, bytes], token: bytes, seconds: int
    ) -> ClaimReply:
        command = self._command(await self._resolved_mode(), scripts.CLAIM, keys, (token, seconds))
        (reply,), acked = await self._then_wait(keys[0], [command])
        if isinstance(reply, ResponseError):
            raise _normalize(reply)
        if isinstance(reply, Exception):
            raise reply
        claimed = claim_reply(reply)
        if claimed is CLAIMED:
            self._check_acked(acked, "the claim (it stays until its lease expires)")
        return claimed

    async def _publish_on_primary(
        self, claim_key: bytes, set_result: tuple[Any, ...], renew: tuple[Any, ...]
    ) -> int:
        replies, acked = await self._then_wait(
            claim_key, [("MULTI",), set_result, renew, ("EXEC",)], wait=bool(self.wait_replicas)
        )
        executed = replies[-1]
        for reply in (*replies[:-1], executed):
            if isinstance(reply, ResponseError):
                raise _normalize(reply)
            if isinstance(reply, Exception):
                raise reply
        _, renewed = executed
        if isinstance(renewed, ResponseError):
            raise _normalize(renewed)
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
                "could not refresh the cluster slot table: %s: %s", type(exc).__name__, exc
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

    async def get(self, key: KeyT) -> bytes | None:
        try:
            reply = await self.client.get(as_bytes(key))
        except ResponseError as exc:
            raise _normalize(exc) from None
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
        return bool(await self.client.set(as_bytes(key), v, ex=ex, px=px, nx=nx))

    async def pttl(self, key: KeyT) -> int:
        return int(await self.client.pttl(as_bytes(key)))

    async def delete(self, *keys: KeyT) -> int:
        if not keys:
            return 0
        return int(await self.client.delete(*(as_bytes(k) for k in keys)))


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


def _renewal_reply(reply: Any) -> int | Exception:
    if isinstance(reply, ResponseError):
        return _normalize(reply)
    return reply if isinstance(reply, Exception) else int(reply)


def _decodes_responses(client: AnyRedis) -> bool:
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()
    else:
        kwargs = client.connection_pool.connection_kwargs
    return bool(kwargs.get("decode_responses", False))
