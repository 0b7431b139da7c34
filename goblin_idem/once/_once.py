"""`once`: exactly-once runs of any coroutine function (queue consumers, webhooks, jobs).

A call claims its key with the middleware's claim step (GOBLIN.CLAIM with a read of the
result, one round trip), so the guarantees are the middleware's, for a function instead of
a request:

- at most one run at a time per key: the call that wins the claim runs the function while
  the store's watchdog renews the lease; a call while it runs raises InFlightError, or waits
  (`wait_seconds`) polling with the claim step, which takes the work over if the first run
  died and its lease ran out;
- at most one completed run per `ttl_seconds` while the store keeps the result: the return
  value is stored (codecs.to_stored) with the claim's new TTL in one MULTI/EXEC, never
  over a value already stored, and every later call returns it decoded, without running;
- a call whose key was first used with other arguments raises KeyReusedError and runs
  nothing: the value is stored with the fingerprint of the arguments that produced it
  (`_arguments`), as the middleware stores a request's (``fingerprint=False`` turns this
  off, for a function whose arguments are not the request);
- a run that raises (or is cancelled, or returns what the codec cannot encode) stores
  nothing and releases the claim with CAD, only if it still holds this run's token, so the
  next call runs again: the function must leave nothing behind that a second run would
  duplicate, as a handler must.

A plain ``def`` runs in its caller's thread and the rest of its call on the process's loop
thread (`_sync`): the same steps, the lease renewed while it runs; what no thread can be is
stopped, so it checks `current_claim().ensure_owned()` before it commits.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload

from .. import _options as options
from .._claim import Claim, new_token
from .._claim_step import ClaimStep
from .._keys import KeyNames, key_names
from .._lease import Watchdog
from .._log import describe
from .._recording import Records
from .._run import Core, Held
from .._threads._loop import in_loop_thread
from ..exceptions import InFlightError, KeyReusedError
from ..records._sealing import Sealer
from ..store import CLAIMED, Store
from ._arguments import Fingerprint, fingerprint_option
from ._codecs import Codec, codec_for, from_stored, stored_fingerprint, to_stored
from ._sync import in_callers_thread

__all__ = ["once"]

logger = logging.getLogger("goblin_idem.once")

P = ParamSpec("P")
R = TypeVar("R")

POLL_SECONDS = 0.05  # the middleware's default poll_interval_seconds
RETRY_AFTER = 1.0  # the middleware's default Retry-After


@dataclass(frozen=True, slots=True)
class Decorator:
    """What `once(...)` returns, its options checked: an ``async def`` stays one, a plain
    ``def`` stays one, each with a run of its own (`_Once`)."""

    store: Store
    key: Callable[..., str | bytes | int]
    name: str | None
    namespace: bytes
    codec: Codec | None
    ttl_ms: int
    lease_ms: int
    claim_seconds: int  # the claim's first lease, in GOBLIN.CLAIM's whole seconds
    sealer: Sealer | None
    require_sealed: bool
    wait_seconds: float
    records: Records | None
    fingerprint: bool | Callable[..., Any]

    @overload
    def __call__(
        self, func: Callable[P, Awaitable[R]], /
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, func: Callable[P, R], /) -> Callable[P, R]: ...

    def __call__(self, func: Callable[..., Any], /) -> Callable[..., Any]:
        if not inspect.iscoroutinefunction(func):
            if inspect.iscoroutinefunction(type(func).__call__):
                raise TypeError(
                    f"once decorates functions, and {_name_of(func)} is an object whose "
                    "__call__ is async: decorate an async def that awaits it"
                )
            return in_callers_thread(self, func)
        run = _Once(
            Core(self.store, Watchdog.for_store(self.store), records=self.records),
            func,
            self.key,
            (self.name or _name_of(func)).encode(),
            self.namespace,
            self.codec if self.codec is not None else codec_for(func),
            self.ttl_ms,
            self.lease_ms,
            self.claim_seconds,
            self.sealer,
            self.require_sealed,
            ClaimStep(self.store, self.wait_seconds, POLL_SECONDS, self.records),
            None if self.fingerprint is False else Fingerprint(func, self.fingerprint),
        )

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await run(args, kwargs)

        return wrapper


def once(
    store: Store,
    *,
    key: Callable[..., str | bytes | int],
    ttl_seconds: float = 86_400,
    lease_seconds: float = 30,
    namespace: str = "once",
    codec: Codec | None = None,
    wait_seconds: float = 0,
    name: str | None = None,
    encryption_keys: Sequence[bytes] | Sealer | None = None,
    require_sealed: bool = False,
    records: Records | None = None,
    fingerprint: bool | Callable[..., Any] = True,
) -> Decorator:
    """Run the decorated function at most once per key (see the module docstring; each
    option, its keys, codecs and fingerprints: docs/beyond-http.md).

    `key` is called with the function's arguments and returns the work's identity (an
    event or message id) as str, bytes or int (``1`` and ``"1"`` are the same key). The
    store keys hash it with `name`, so two functions never share a claim.
    """
    the_store = _checked(store, key, codec, wait_seconds, name)
    ttl = options.seconds("ttl_seconds", ttl_seconds, minimum=1)
    lease = options.seconds("lease_seconds", lease_seconds, minimum=1)
    ns = options.namespace(namespace)
    sealer = options.sealer(encryption_keys)
    return Decorator(
        the_store,
        key,
        name,
        ns,
        codec,
        round(ttl * 1000),
        round(lease * 1000),
        math.ceil(lease),
        sealer,
        options.require_sealed(require_sealed, sealer),
        float(wait_seconds),
        options.records(records),
        fingerprint_option(fingerprint),
    )


def _checked(
    store: object, key: object, codec: object, wait_seconds: object, name: object
) -> Store:
    """The store, once every argument that has no check in options.py is checked."""
    if store is None:
        raise TypeError(
            "once needs a store: RedisStore.from_url(url) for several processes, "
            "MemoryStore() for one"
        )
    the_store: Store = options.store(store)
    if not callable(key):
        raise TypeError(
            "key must be a function of the decorated function's arguments returning the "
            f"work's id, as in key=lambda event: event['id']; got {type(key).__name__}"
        )
    if codec is not None and not isinstance(codec, Codec):
        raise TypeError(
            "codec must have encode(value) -> bytes and decode(data) -> value methods, "
            f"not {type(codec).__name__}"
        )
    if isinstance(wait_seconds, bool) or not isinstance(wait_seconds, (int, float)):
        raise TypeError(
            f"wait_seconds must be a number of seconds, not {type(wait_seconds).__name__}"
        )
    if not 0 <= wait_seconds < float("inf"):
        raise ValueError(f"wait_seconds must be >= 0 and finite, got {wait_seconds}")
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError("name must be a non-empty str (the function's identity in store keys)")
    return the_store


def _name_of(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", None) or "?"
    return f"{module}.{getattr(func, '__qualname__', type(func).__qualname__)}"


@dataclass(frozen=True, slots=True)
class _Once:
    """The decorated function's settings, and its one call."""

    core: Core  # the store, its watchdog, the records, the events (a front door's counters)
    func: Callable[..., Awaitable[Any]]
    key: Callable[..., str | bytes | int]
    name: bytes
    namespace: bytes
    codec: Codec
    ttl_ms: int
    lease_ms: int
    claim_seconds: int  # the claim's first lease, in GOBLIN.CLAIM's whole seconds
    sealer: Sealer | None
    require_sealed: bool  # a stored value in the clear raises RecordError
    claim_step: ClaimStep  # with the wait and the database's word on a won claim
    fingerprint: Fingerprint | None  # of the arguments, stored with the value (None: off)
    # Front doors that keep some outcomes only (gRPC's statuses): a value `kept` refuses is
    # returned to its caller, nothing stored, the claim released and the records rolled back.
    kept: Callable[[Any], bool] | None = None

    def _where(self) -> str:
        """The run's name in the WARNING about commits outside its transaction."""
        return f"once {self.name.decode()}"

    def names(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> KeyNames:
        value = self.key(*args, **kwargs)
        if isinstance(value, str):
            raw = value.encode()
        elif isinstance(value, bytes):
            raw = value
        elif isinstance(value, int) and not isinstance(value, bool):
            raw = str(value).encode()
        else:
            raise TypeError(
                f"the key function of {self.name.decode()} must return str, bytes or int, "
                f"not {type(value).__name__}"
            )
        return key_names(self.namespace, self.name, raw)

    async def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = self.names(args, kwargs)
        # Before the claim: arguments the signature refuses raise with nothing claimed.
        fp = None if self.fingerprint is None else self.fingerprint(args, kwargs)
        return await self.call(names, fp, args, kwargs)

    async def call(
        self, names: KeyNames, fp: bytes | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One call under `names`, with the fingerprint `fp`: for a front door that names
        its key and fingerprints its request itself (gRPC), the rest as `__call__`."""
        token = new_token()
        reply = await self.claim_step(names, token, self.claim_seconds)
        if reply is None:
            raise InFlightError(
                f"{self.name.decode()}: another run holds key {names.hash} (or its worker "
                f"died and its lease of {self.lease_ms / 1000:g}s has not run out); nothing ran",
                key_hash=names.hash,
                retry_after=RETRY_AFTER,
            )
        if reply is not CLAIMED:
            stored = stored_fingerprint(reply)
            if fp is not None and stored is not None and stored != fp:
                raise KeyReusedError(
                    f"{self.name.decode()}: key {names.hash} was first used with other "
                    "arguments; its stored value is not theirs, and nothing ran. Use a new "
                    "key for other work (or fingerprint=False if the arguments are not the "
                    "request)",
                    key_hash=names.hash,
                )
            return from_stored(
                self.codec, reply, self.sealer, names.result, require_sealed=self.require_sealed
            )
        return await self._run(args, kwargs, names, token, fp)

    async def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        names: KeyNames,
        token: bytes,
        fp: bytes | None,
    ) -> Any:
        run = _Called(self.core, names, token, self.ttl_ms, self.name.decode())
        run.hold(self.lease_ms)
        if self.core.records is not None:
            run.begin(self._where)
        kept = True
        try:
            run.enter(Claim(self.core.store, run.lease, in_loop_thread))
            try:
                value = await self.func(*args, **kwargs)
            finally:
                run.leave()
            kept = self.kept is None or self.kept(value)
            if not kept:
                raise _NotKept
            try:
                data = to_stored(self.codec, value, self.sealer, names.result, fp)
            except TypeError as exc:
                raise TypeError(
                    f"{self.name.decode()} returned a value its codec cannot store ({exc}); "
                    "nothing was stored and the claim was released. Return JSON types, a "
                    "dataclass or pydantic model named in the return annotation, or pass "
                    "codec="
                ) from exc
            if run.tx is not None:
                data = await run.commit(data, fp or bytes(16))
        except BaseException as exc:
            self.core.report("released", names.hash)  # nothing of the function's writes kept
            await run.to_end(run.release)
            if not kept and isinstance(exc, _NotKept):
                return value  # an outcome not kept: its caller's, and nobody else's
            raise
        await run.to_end(functools.partial(run.publish, data))
        # What every later call gets, so the first caller sees the same (a tuple as a list).
        return from_stored(self.codec, data, self.sealer, names.result)


@dataclass(eq=False, slots=True)
class _Called(Held):
    """One call's run under its won claim, saying what `once` logs of its publish (the
    function's `name` first). A value that never lands is done but not recorded: a call
    after the lease runs it again. A value stored first by another run stands, and later
    calls get it. Either way this caller gets its own value."""

    name: str

    def unpublished(self, exc: Exception) -> None:
        logger.error(
            "%s: could not store the result of key %s (%s); a call after the "
            "lease may run the work again",
            self.name,
            self.names.hash,
            describe(exc),
        )

    def superseded(self) -> None:
        logger.warning(
            "%s: a value was already stored for key %s when this run stored its own "
            "(another run took the key after this run's claim lapsed or was lost): the "
            "stored one stands and later calls get it; this caller got its own",
            self.name,
            self.names.hash,
        )

    async def lapsed(self) -> None:
        # The result is stored; the next call's claim step finds it, returns it and takes
        # the claim back. Another run may have started meanwhile.
        logger.warning(
            "%s: the claim of key %s lapsed before its result was stored; another "
            "run may have started in the meantime",
            self.name,
            self.names.hash,
        )


class _NotKept(Exception):
    """The function's value is not to be kept (`_Once.kept`): the run is undone as if it
    had raised, and the value returned."""
