"""What RedisStore checks of its server once, before the first command.

The mode (does every primary know GOBLIN.CLAIM?), the ACL user's permission for every
command the store sends (`StorePermissionError` names each refused one and the rule that
allows it), the eviction policy (a WARNING when it can evict goblin-idem's keys), and the
largest value the server accepts (its proto-max-bulk-len).
"""

from __future__ import annotations

import contextvars
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, TypeAlias

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

from ..exceptions import NotReplicatedError, StorePermissionError
from ._arguments import DEFAULT_MAX_VALUE_BYTES, as_bytes
from ._executor import Executor
from ._protocol import Store
from ._server_errors import SCRIPT_CALLS, acl_rule, permission_error

__all__ = ["Detection", "Mode", "node_name"]

logger = logging.getLogger("goblin_idem.store")

Mode: TypeAlias = Literal["auto", "native", "script"]

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

_UNCHECKED: Final = (
    "goblin-idem store: could not read the eviction policy of %s (%s): make sure its "
    "maxmemory-policy is noeviction, or that it never reaches maxmemory (docs/operating/"
    "failover.md: Eviction)"
)
_EVICTS: Final = (
    "goblin-idem store: %s evicts keys when memory is full (maxmemory-policy %s, maxmemory "
    "%s)%s. It can evict a completed key's result (a duplicate then runs the work again, or "
    "gets 409 in-flight until the claim's TTL ends if the claim stayed) or a running "
    "request's claim (a duplicate then runs while the first run still does). Set "
    "maxmemory-policy noeviction (a full server then refuses new keys with 503 and still "
    "replays completed ones), or give it memory enough never to evict.%s"
)


class Detection:
    """One store's checks: run once, again after a failure (a server that cannot be reached
    decides nothing). What they find describes the server, so every event loop shares it;
    a loop's concurrent first calls wait for one run under that loop's lock
    (`Executor.detecting`: an asyncio lock belongs to one loop), and two loops starting
    together may each run it, to the same findings.

    `limit` is told the largest value the server accepts (its primaries' smallest)."""

    def __init__(self, mode: Mode, user: str, limit: Callable[[int], None]) -> None:
        self.mode: Mode = mode
        self.done = False
        self._user = user
        self._limit = limit

    def ready(self) -> bool:
        """May a command go out without detection (done, or sent by the probe itself)?"""
        return self.done or _PROBING.get()

    async def run(self, store: Store, executor: Executor) -> Mode:
        """Check, unless done, over the running loop's `executor` (its client)."""
        async with executor.detecting:
            if not self.done:
                await self._once(store, executor)
        return self.mode

    async def notes(self, store: Store, executor: Executor) -> list[tuple[int, str]]:
        """`run`, with the lines it would log returned as ``(level, text)`` instead."""
        notes: list[tuple[int, str]] = []
        token = _NOTES.set(notes)
        try:
            await self.run(store, executor)
        except BaseException:
            for level, text in notes:  # what was found before the failure still counts
                logger.log(level, "%s", text)
            raise
        finally:
            _NOTES.reset(token)
        return notes

    async def _once(self, store: Store, executor: Executor) -> None:
        client = executor.client
        auto = self.mode == "auto"
        if auto:
            try:
                native = await self._has_native_commands(client)
            except NoPermissionError as exc:
                raise self.refused(
                    ("command|list",), "to detect the mode (or give mode='native' or 'script')"
                ) from exc
            self.mode = "native" if native else "script"
        refused = await self._probe(store, executor)
        await self._check_eviction(client)
        self._limit(await self._value_limit(client))
        self.done = True
        if auto:
            _note(
                logging.INFO,
                "goblin-idem store mode: %s (%s)",
                self.mode,
                "GOBLIN.CLAIM found on the server"
                if self.mode == "native"
                else "server lacks GOBLIN.CLAIM; running the Lua scripts with EVALSHA",
            )
        if refused:
            raise self.refused(tuple(sorted(refused)), f"in {self.mode} mode")

    def refused(self, commands: tuple[str, ...], context: str) -> StorePermissionError:
        user = self._user
        return StorePermissionError(
            f"the store's ACL user {user!r} may not run {', '.join(commands)}, which "
            f"goblin-idem sends {context}: allow them with ACL SETUSER {user} "
            f"{acl_rule(commands)} (docs/operating/permissions.md lists every command)",
            denied=commands,
        )

    async def _probe(self, store: Store, executor: Executor) -> set[str]:
        """Send each command the store uses once, on probe keys that expire in seconds; the
        commands an ACL refused. A refused key says the command itself was allowed (servers
        check the command first); it is logged, since the middleware's namespace is not
        known here."""
        tag = b"goblin-idem:probe:{%d-%s}:" % (os.getpid(), secrets.token_hex(4).encode())
        ck, rk, tok = tag + b"c", tag + b"r", b"probe"
        steps: list[Callable[[], Awaitable[object]]] = [
            lambda: store.claim_unless_done(ck, rk, tok, 5),  # CLAIM, PTTL (WAIT)
            lambda: store.publish(rk, b"probe", 5000, ck, tok),  # MULTI, SET, CAEXPIRE, EXEC
            lambda: store.cas(rk, b"probe", b"probe"),
            lambda: store.set(ck, tok, px=5000, nx=True),
            lambda: store.get(rk),
            lambda: store.pttl(rk),
            lambda: store.cad(ck, tok),
            lambda: store.delete(ck, rk),
        ]
        if self.mode == "script":  # what the scripts call, named (Redis 7.0 does not)
            steps[:0] = [executor.load_scripts, lambda: executor.client.pexpire(ck, 5000)]
        token = _PROBING.set(True)
        try:
            errors = [await _refusal(step, self._user) for step in steps]
        finally:
            _PROBING.reset(token)
        denied = [e for e in errors if e is not None]
        refused = {c for e in denied if not e.keys and e.denied != SCRIPT_CALLS for c in e.denied}
        if any(e.denied == SCRIPT_CALLS for e in denied) and not refused & set(SCRIPT_CALLS):
            refused.update(SCRIPT_CALLS)  # a command inside a script, unnamed (Redis 7.0)
        keys_refused = next((e for e in reversed(denied) if e.keys), None)
        if keys_refused is not None:
            _note(
                logging.INFO,
                "goblin-idem store: the ACL refused the probe key %r (%s); the middleware's "
                "keys must be allowed (its namespace, ~idem:* by default)",
                ck.decode(),
                keys_refused,
            )
        return refused

    async def _check_eviction(self, client: Any) -> None:
        """Warn when a server may evict goblin-idem's keys, or its policy cannot be read."""
        for node in _nodes(client):
            where = node_name(client, node)
            try:
                policy, limit = await self._memory_settings(client, node)
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

    async def _memory_settings(self, client: Any, node: Any) -> tuple[str, str]:
        """maxmemory-policy and maxmemory, from CONFIG GET or else INFO memory (managed
        services rename CONFIG, and an ACL may refuse it, since it also reads secrets)."""
        try:
            config = _pairs(await _node_command(client, node, "CONFIG GET", "maxmemory*"))
            return config["maxmemory-policy"], config.get("maxmemory", "?")
        except (ResponseError, KeyError) as exc:
            refused = f"CONFIG GET: {exc}"
        try:
            info = await _node_command(client, node, "INFO", "memory")
            return str(info["maxmemory_policy"]), str(info.get("maxmemory", "?"))
        except (ResponseError, KeyError) as exc:
            raise ResponseError(f"{refused}; INFO memory: {exc}") from None

    async def _value_limit(self, client: Any) -> int:
        """The largest value every primary accepts: the smallest proto-max-bulk-len (a
        server drops the connection that sends a larger one, and every call pipelined on
        it fails), or Redis' default where CONFIG GET is refused or renamed."""
        limits = []
        for node in _nodes(client):
            try:
                reply = await _node_command(client, node, "CONFIG GET", "proto-max-bulk-len")
                limits.append(int(_pairs(reply)["proto-max-bulk-len"]))
            except (ResponseError, KeyError, ValueError):
                limits.append(DEFAULT_MAX_VALUE_BYTES)
        return min(limits)

    async def _has_native_commands(self, client: Any) -> bool:
        """True only if every primary knows GOBLIN.CLAIM.

        COMMAND LIST FILTERBY PATTERN answers a plain list on Redis >= 7, Valkey and every
        cluster node, where ``COMMAND INFO`` of an unknown name would trip redis-py's reply
        parser; a server without COMMAND LIST is asked ``COMMAND INFO`` as one raw argument.
        """
        if isinstance(client, RedisCluster):
            await client.initialize()
        for node in _nodes(client):
            try:
                names = await _node_command(
                    client, node, "COMMAND LIST", "FILTERBY", "PATTERN", "goblin.claim"
                )
                found = any(as_bytes(n).lower() == b"goblin.claim" for n in names or ())
            except ResponseError:
                info = await _node_command(client, node, "COMMAND INFO", "goblin.claim")
                found = bool(info) and info[0] is not None
            if not found:
                return False
        return True


async def _refusal(step: Callable[[], Awaitable[object]], user: str) -> StorePermissionError | None:
    """Run one probe step: the ACL's refusal of it, if any (OOM and WAIT errors say the
    command was allowed)."""
    try:
        await step()
    except (ResponseError, NotReplicatedError) as exc:
        return permission_error(exc, user)
    return None


def node_name(client: Any, node: Any) -> str:
    """A node's address (``host:port``, or a socket path); the single server's for None."""
    if node is not None:
        return str(node.name)
    kwargs = client.get_connection_kwargs()
    if kwargs.get("path"):
        return str(kwargs["path"])
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


def _nodes(client: Any) -> list[Any]:
    if isinstance(client, RedisCluster):
        return list(client.get_primaries())
    return [None]


async def _node_command(client: Any, node: Any, *args: Any) -> Any:
    if node is None:
        return await client.execute_command(*args)
    return await client.execute_command(*args, target_nodes=node)


def _note(level: int, message: str, *args: object) -> None:
    notes = _NOTES.get()
    if notes is None:
        logger.log(level, message, *args)
    else:
        notes.append((level, message % args))


def _pairs(reply: Any) -> dict[str, str]:
    """CONFIG GET's reply (a dict from redis-py's callback, or a flat list) as text."""
    items = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {as_bytes(k).decode(): as_bytes(v).decode() for k, v in items}
