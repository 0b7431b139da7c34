"""One sync call's hand-over with the loop thread (the WSGI and Django adapters, sync `once`).

The caller's thread starts a coroutine on the loop thread (the ASGI middleware, or `once`'s
run) and then serves it: whatever must run in the caller's thread (the app, a read of the
request body, the `once` function) the coroutine asks for with `call`, and what it hands
back (the response's messages) it hands over with `post`. The caller's thread runs each
call when it comes and returns each posted item, in order, so a call never overtakes an
item posted before it: the app is asked for the next chunk only once the previous one has
reached the server, which is the only back-pressure a sync server needs.

Each crossing is one wake-up of the other thread (about 25 us on a loaded 2-core machine),
so the adapters cross as few times as they can. A first run of a request with a key and a
small body, answered by an app in one piece, crosses four times: the start (to the loop
thread), the app's run once the claim is won (to the caller's thread), the app's response
(to the loop thread, which publishes it), and the response with the end of the coroutine
(to the caller's thread): an item posted as the `last` one is held and handed over with
the end, so the caller's thread never waits again for an end that follows it at once. A
replay or a refusal (a 409 for a key in flight) crosses twice: the start, then the answer
with the end.

An exception raised in the caller's thread reaches the coroutine as `Raised` (an
Exception: a KeyboardInterrupt or SystemExit raised in a task would stop the loop thread),
and the caller's thread re-raises the original, its traceback untouched. If the caller's
thread is interrupted while it waits (a signal's exception), the coroutine is cancelled:
its closing steps still run on the loop thread, and its later calls fail at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ._loop import LoopThread

__all__ = ["DONE", "Exchange", "Raised"]

T = TypeVar("T")
logger = logging.getLogger("goblin_idem.wsgi")
POLL_SECONDS = 1.0  # how often a waiting caller checks that the loop thread still runs


class Raised(Exception):
    """An exception raised in the caller's thread, as the coroutine sees it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


_NOTHING: Any = object()  # no last item held


class _Done:
    """The end of the coroutine: its result, or its error; and the item posted as its
    last, if it was still held (one hand-over for both)."""

    __slots__ = ("error", "last", "result")

    def __init__(self, result: Any, error: BaseException | None, last: Any) -> None:
        self.result = result
        self.error = error
        self.last = last


class _Call:
    __slots__ = ("args", "fn", "future")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], future: asyncio.Future[Any]
    ) -> None:
        self.fn = fn
        self.args = args
        self.future = future


DONE: Any = object()  # what `next` returns once the coroutine has ended without an error


class Exchange:
    """A coroutine on the loop thread and the thread that waits for it."""

    __slots__ = (
        "_abandoned",
        "_at_end",
        "_jobs",
        "_last",
        "_over",
        "_task",
        "done",
        "loop",
        "thread",
    )

    def __init__(self, thread: LoopThread) -> None:
        self.thread = thread
        self.loop = thread.loop
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._task: asyncio.Task[None] | None = None
        self._abandoned = False  # the caller's thread stopped waiting
        self._over = False  # the coroutine ended (loop side)
        self.done: _Done | None = None  # set in the caller's thread, once it has seen the end
        self._at_end: list[Callable[[], object]] | None = None
        self._last: Any = _NOTHING  # posted as the last item, held for the end (loop side)

    @staticmethod
    def running() -> Exchange | None:
        """The exchange whose coroutine (or a task it started) is running, or None."""
        return _running.get()

    # -- the caller's thread --

    def start(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.loop.call_soon_threadsafe(self._begin, coro)

    def next(self) -> Any:
        """Run the coroutine's calls here until it posts an item, and return that item; at
        the coroutine's end `DONE`, or its error raised (for `Raised`, the original)."""
        while self.done is None:
            job = self._get()
            if type(job) is _Call:
                self._run(job)
            elif type(job) is _Done:
                self.done = job
                self._ended()
                if job.last is not _NOTHING:
                    return job.last
            else:
                return job
        error = self.done.error
        if error is None:
            return DONE
        raise error.error if isinstance(error, Raised) else error

    def wait(self) -> Any:
        """Serve the coroutine to its end (dropping what it posts): its result."""
        while self.next() is not DONE:
            pass
        assert self.done is not None
        return self.done.result

    def _get(self) -> Any:
        try:
            while True:
                try:
                    return self._jobs.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if not self.thread.alive:
                        raise RuntimeError("the goblin-idem loop thread has stopped") from None
        except BaseException:
            self.abandon()
            raise

    def _run(self, call: _Call) -> None:
        try:
            result = call.fn(*call.args)
        except BaseException as exc:
            self.loop.call_soon_threadsafe(_settle, call.future, None, Raised(exc))
        else:
            self.loop.call_soon_threadsafe(_settle, call.future, result, None)

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> None:
        """The caller's thread stops waiting: cancel the coroutine (the call it awaits
        with it), and fail its later calls at once."""
        self._abandoned = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._cancel)
        self._ended()

    def at_end(self, fn: Callable[[], object]) -> None:
        """Run `fn` in the caller's thread once the exchange has ended (the coroutine's end
        seen, or the caller's thread stopped waiting): what must not outlive the request
        in that thread, such as an open transaction. Called from the caller's thread."""
        if self._at_end is None:
            self._at_end = []
        self._at_end.append(fn)

    def _ended(self) -> None:
        callbacks, self._at_end = self._at_end, None
        for fn in callbacks or ():
            try:
                fn()
            except Exception:
                logger.exception("while ending a request in its thread")

    # -- the loop thread --

    def _begin(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._task = self.loop.create_task(self._main(coro))

    async def _main(self, coro: Coroutine[Any, Any, Any]) -> None:
        _running.set(self)  # this task's context, inherited by the tasks it starts
        try:
            result = await coro
        except BaseException as exc:  # the caller's thread re-raises it; the task ends
            self._over = True  # no thread reads calls put after the end
            self._jobs.put(_Done(None, exc, self._take_last()))
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise
        else:
            self._over = True
            self._jobs.put(_Done(result, None, self._take_last()))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` run in the caller's thread, after every item posted before; cancelled
        once the caller's thread stopped waiting or the coroutine ended (a task it started
        that outlives it, such as a records lookup a replay did not need, would otherwise
        wait forever). A call put before the end is run first: both are put by this loop's
        thread, in order."""
        if self._abandoned or self._over:
            raise asyncio.CancelledError
        future: asyncio.Future[T] = self.loop.create_future()
        if self._last is not _NOTHING:
            self._jobs.put(self._take_last())
        self._jobs.put(_Call(fn, args, future))
        return await future

    def post(self, item: Any, last: bool = False) -> None:
        """Hand `item` over to the caller's thread (`next` returns it). An item posted as
        the `last` one (the response's last message) is held and goes with the
        coroutine's end, in one hand-over: what the coroutine does after it (nothing
        that waits, in the adapters: their closing steps come before the last message)
        must end before the caller's thread has it. Anything handed over before the end
        takes it along first, in order."""
        if self._last is not _NOTHING:
            self._jobs.put(self._take_last())
        if last:
            self._last = item
        else:
            self._jobs.put(item)

    def _take_last(self) -> Any:
        last, self._last = self._last, _NOTHING
        return last

    def _cancel(self) -> None:
        if self._task is not None:  # started before: `start` was called first
            self._task.cancel()


_running: contextvars.ContextVar[Exchange | None] = contextvars.ContextVar(
    "goblin_idem_exchange", default=None
)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
