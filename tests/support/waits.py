"""Waiting for an event with a deadline, instead of sleeping for a guess.

A test that sleeps "long enough for X" fails when a loaded machine makes X slower than the
guess, and wastes the whole sleep when X is quick. `until` (in a coroutine) and `until_sync`
(in a thread) check a condition every few milliseconds and return as soon as it holds; past
the deadline they fail with an AssertionError that says what they waited for. The deadline
is generous on purpose: it is only ever reached when the event never comes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

DEADLINE = 20.0
"""Seconds a wait may take before the test fails: far above any event's time on a loaded
machine, so that reaching it means the event did not happen."""

START_DEADLINE = 120.0
"""Seconds a child process (gunicorn, uvicorn) may take to answer while it is alive: on a
machine loaded by other suites a Django or FastAPI worker boots in tens of seconds. One
that exits fails the wait at once, with its output."""


def _describe(condition: Callable[[], object], what: str) -> str:
    """`what`, or the condition's source line when the caller named nothing."""
    if what:
        return what
    try:
        return inspect.getsource(condition).strip()
    except (OSError, TypeError):
        return repr(condition)


async def until(
    condition: Callable[[], object],
    timeout: float = DEADLINE,
    what: str = "",
    every: float = 0.01,
) -> None:
    """Return once `condition()` (a function, or a coroutine function) is truthy, checking
    every `every` seconds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {_describe(condition, what)}")
        await asyncio.sleep(every)


def until_sync(
    condition: Callable[[], object],
    timeout: float = DEADLINE,
    what: str = "",
    every: float = 0.01,
) -> None:
    """`until` for a thread with no event loop: blocks until `condition()` is truthy."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {_describe(condition, what)}")
        time.sleep(every)
