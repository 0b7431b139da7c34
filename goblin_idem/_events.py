"""What a door counts and logs: one typed event per outcome, counted in one place, and a
store's failure logged in one place (`log_store_error`).

Every outcome is an `Event`, a name mypy checks wherever one is reported; `Events` is the
one function that counts it (a field of `Counters` per event, checked at import) and tells
the application's `on_event` hook. Each event is reported where its outcome is decided,
once per request; a closing step that is started again after a cancel reports nothing.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from redis.exceptions import AuthenticationError, NoPermissionError

from ._log import describe

if TYPE_CHECKING:
    from .store import Store

__all__ = ["Counters", "Event", "Events", "log_store_error"]

logger = logging.getLogger("goblin_idem.middleware")

Event = Literal[
    "claimed",
    "replayed",
    "in_flight",
    "mismatch",
    "released",
    "lease_lost",
    "store_errors",
    "too_large",
    "invalid_key",
    "missing_key",
    "not_replayable",
    "publish_errors",
    "unprotected",
    "unreadable",
    "superseded",
    "webhook_refused",
    "database_errors",
]


@dataclass
class Counters:
    """What the middleware did, since start. `on_event` sees each increment as it happens."""

    claimed: int = 0
    replayed: int = 0
    in_flight: int = 0
    mismatch: int = 0
    released: int = 0
    lease_lost: int = 0
    store_errors: int = 0
    too_large: int = 0
    invalid_key: int = 0
    missing_key: int = 0
    not_replayable: int = 0
    publish_errors: int = 0
    unprotected: int = 0
    unreadable: int = 0
    superseded: int = 0  # a late run's response not stored: another run's stood first
    webhook_refused: int = 0  # a webhook delivery not verified or malformed: nothing claimed
    database_errors: int = 0  # the records' database unavailable: 503, nothing run

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


if tuple(f.name for f in fields(Counters)) != get_args(Event):  # pragma: no cover
    raise AssertionError("Counters must have one field per Event, in the same order")


class Events:
    """The one event function of a middleware: counts `event` and tells `on_event`."""

    __slots__ = ("counters", "on_event")

    def __init__(self, counters: Counters, on_event: Callable[[str, str], None] | None) -> None:
        self.counters = counters
        self.on_event = on_event

    def __call__(self, event: Event, key_hash: str = "") -> None:
        counters = self.counters
        setattr(counters, event, getattr(counters, event) + 1)
        if self.on_event is not None:
            try:
                self.on_event(event, key_hash)
            except Exception:  # a metrics hook must never fail a request
                logger.exception("on_event hook failed")


# Errors that no retry fixes, only a change of configuration: logged once per store.
CONFIGURATION_ERRORS = (NoPermissionError, AuthenticationError)
_misconfigured: weakref.WeakSet[Any] = weakref.WeakSet()  # stores whose error was logged


def log_store_error(store: Store, level: int, exc: BaseException, message: str, key: str) -> None:
    """`message` and the error, each time; a configuration error (a permission the
    store's user lacks, a wrong password) only once per store, since every request
    would repeat it until the configuration changes, and its text names the fix."""
    if isinstance(exc, CONFIGURATION_ERRORS):
        if store in _misconfigured:
            logger.debug("%s: %s", message % key, describe(exc))
            return
        _misconfigured.add(store)
        message += " (a configuration error, logged once for this store)"
    logger.log(level, "%s: %s", message % key, describe(exc))
