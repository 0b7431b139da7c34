"""Which response statuses are a request's outcome: stored and replayed, or the key released.

A response is stored when it reports what the request did, so that its repeat must get the
same answer. It is not when it says the request was not processed, and a repeat may be
answered otherwise: then nothing is stored (in the store, or in SQL records, where the
run's transaction is rolled back) and the key is released, so the retry runs the handler.
By default, not the outcome:

- 5xx: the work may not have happened (`store_server_errors=True` stores them);
- 307, 308: the request is to be repeated, method and body unchanged, at another URL;
- 401: the caller was not identified; the retry may carry a refreshed credential in the
  same scope (and a forged request must not answer the genuine one for a day);
- 403: an authorization refusal made before the work; the retry may come once access is
  granted, and a refused signature or CSRF check must not answer the genuine request;
- 408, 425, 429: the server did not process the request (timed out reading it, too early,
  throttled): the client is told to send it again;
- 423: the resource was locked by other work; the request did not run.

The answer is a table of 600 flags computed once from the option (a function of the status
or a collection of statuses), so a response costs one index, whatever the option.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeAlias

from ._durations import kind

__all__ = ["NOT_OUTCOME", "Outcome", "OutcomeOption", "default", "is_outcome", "table"]

#: Statuses below 500 that are not a request's outcome by default (see the docstring).
NOT_OUTCOME = frozenset({307, 308, 401, 403, 408, 423, 425, 429})

Outcome: TypeAlias = tuple[bool, ...]  # indexed by status, 0 to 599
OutcomeOption: TypeAlias = Callable[[int], bool] | Collection[int] | None

STATUSES = range(100, 600)  # RFC 9110's three-digit codes


def default(store_server_errors: bool) -> Outcome:
    return tuple(
        (s < 500 and s not in NOT_OUTCOME) or (s >= 500 and store_server_errors)
        if s in STATUSES
        else False
        for s in range(600)
    )


def table(name: str, value: object, store_server_errors: bool = False) -> Outcome:
    """The table an `outcome` option gives: None for the default; a function of the status
    (asked once for each of 100 to 599, here); or the statuses that are the outcome."""
    if value is None:
        return default(store_server_errors)
    if store_server_errors:
        raise ValueError(
            f"{name} and store_server_errors=True both say which statuses are stored: drop "
            f"store_server_errors and name the 5xx statuses in {name}"
        )
    if callable(value):
        return _asked(name, value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise TypeError(
            f"{name} must be a function of the status returning True for a status to store "
            f"and replay, or a collection of statuses such as range(200, 300), not {kind(value)}"
        )
    wanted = set()
    for status in value:
        if isinstance(status, bool) or not isinstance(status, int):
            raise TypeError(f"{name} must hold statuses (int), not {kind(status)}")
        if status not in STATUSES:
            raise ValueError(f"{name}: {status} is not an HTTP status (100 to 599)")
        wanted.add(status)
    if not wanted:
        raise ValueError(
            f"{name} names no status, so no response would ever be stored: name the "
            "statuses to replay, or leave it out for the default"
        )
    return tuple(s in wanted for s in range(600))


def _asked(name: str, predicate: Callable[[int], bool]) -> Outcome:
    flags = [False] * 600
    for status in STATUSES:
        try:
            answer = predicate(status)
        except Exception as exc:
            raise ValueError(
                f"{name} raised {type(exc).__name__} for status {status}: it is called once "
                "for each status from 100 to 599 when the middleware is built, and must "
                f"answer True or False for each ({exc})"
            ) from exc
        if not isinstance(answer, bool):
            raise TypeError(
                f"{name} must return True or False for a status, not {kind(answer)} (for {status})"
            )
        flags[status] = answer
    if not any(flags):
        raise ValueError(
            f"{name} is false for every status, so no response would ever be stored: "
            "answer True for the statuses to replay, or leave it out for the default"
        )
    return tuple(flags)


def is_outcome(outcome: Outcome, status: int) -> bool:
    """Whether a response of `status` is stored; a status outside 100-599 never is."""
    return 0 <= status < 600 and outcome[status]
