"""`once` for plain ``def`` functions (a Celery task, a management command, a thread's job).

The function runs in its caller's thread; everything else is the ``async def`` path's own
run (`_once`), on the process's loop thread (`_loop`): the claim step, the lease renewed
by that thread's watchdog while the function runs, the value stored (or the claim
released), the stored value returned to every later call. The run calls back into the
caller's thread for the function itself (`_exchange`), so the guarantees, keys and stored
values are those of an ``async def`` decorated with the same options.

What the loop thread cannot do is stop the function: a thread that outlives its lease (the
store unreachable for longer than the lease, the process paused) runs on, and another run
may take the key meanwhile. `current_claim().ensure_owned()` before the commit stops it
there (it raises ClaimLostError); nothing stops what it does between that check and its
commit, nor a commit that does not check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from .._claim import ClaimHolder, current, for_sync_code
from .._threads._exchange import Exchange
from .._threads._loop import loop_thread

__all__ = ["in_callers_thread"]

P = ParamSpec("P")
R = TypeVar("R")

AsyncDecorator = Callable[
    [Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]
]


def in_callers_thread(decorate: AsyncDecorator[P, R], func: Callable[P, R]) -> Callable[P, R]:
    """`func` run by `decorate` (once's, for ``async def``) in the caller's thread."""

    async def call_back(*args: P.args, **kwargs: P.kwargs) -> R:
        holder = for_sync_code(current.get())
        exchange = Exchange.running()
        assert exchange is not None  # the run is the coroutine of `wrapper`'s exchange
        result: R = await exchange.call(_call, holder, func, args, kwargs)
        return result

    # The function's module, name and annotations: the same keys, the same codec.
    run = decorate(functools.update_wrapper(call_back, func))

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        exchange = Exchange(loop_thread())
        exchange.start(run(*args, **kwargs))
        result: R = exchange.wait()
        return result

    return wrapper


def _call(
    holder: ClaimHolder | None,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R:
    held = current.set(holder)
    try:
        return func(*args, **kwargs)
    finally:
        current.reset(held)
