"""The process's event loop thread: where sync code (WSGI, Django, a sync `once`) calls
stores through.

One loop per process, in a daemon thread of its own, started on first use: every request
thread's store calls share its connections (the auto-pipeline batches them) and its
watchdog renews every lease they hold, whatever those threads are doing meanwhile.

Fork safety (``gunicorn --preload`` imports the app, which may use a store, then forks):
a child has no thread but the one that forked, so it starts a loop thread of its own on
first use; the parent's loop object is left untouched there (never run, closed or freed,
since its selector is an epoll instance the child shares with the parent), and the stores
drop, in the child, the connections they inherited. The thread is a daemon: it ends with
the process, which a server ends once its requests are answered (and with them every
publish, which a request waits for).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = [
    "LoopThread",
    "in_loop_thread",
    "loop_thread",
    "new_loop",
    "refuse_green_threads",
    "started_loop",
]

T = TypeVar("T")

_current: LoopThread | None = None
_starting = threading.Lock()
_inherited: list[LoopThread] = []  # a parent's, in a fork's child: kept from the collector


class LoopThread:
    """An event loop running forever in a daemon thread (`loop_thread()` gives the
    process's one)."""

    def __init__(self) -> None:
        self.loop = new_loop()
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="goblin-idem loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result here (never from the loop's
        own thread, which would wait for itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from the loop thread itself")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when it is installed (as uvicorn's default picks it), else
    asyncio's. Every keyed request of a sync app hands over to the loop thread and back:
    on uvloop that work (a task per request, the wake-ups) costs the loop thread about a
    third fewer instructions (bench/README.md, the sync adapters under gunicorn)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def loop_thread() -> LoopThread:
    """The process's loop thread, started on first use (again in a fork's child)."""
    thread = _current
    if thread is not None and thread.alive:
        return thread
    return _start()


def in_loop_thread(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` run to its end on the process's loop thread, for sync code: what a door hands
    its claims, so that a claim need not know who drives its loop."""
    return loop_thread().run(coro)


def started_loop() -> asyncio.AbstractEventLoop | None:
    """The loop of this process's loop thread, if one was started, without checking that
    it still runs (`Thread.is_alive` takes a lock): for a read whose answer proves its own
    freshness (a replay cache's connection heard from the server within a second)."""
    thread = _current
    return None if thread is None else thread.loop


def _start() -> LoopThread:
    global _current
    with _starting:
        if _current is None or not _current.alive:
            refuse_green_threads()
            _current = LoopThread()
        return _current


def refuse_green_threads() -> None:
    """RuntimeError, naming the worker and what to use instead, in a process whose threads
    gevent or eventlet made greenlets (gunicorn's gevent and eventlet workers patch
    `threading`): the loop "thread" would be a greenlet that never yields (its selector
    waits in the OS), and a request's wait for it blocks the hub, so every request of the
    worker, keyed or not, would hang without a word."""
    green = _green_threads()
    if green is None:
        return
    worker = f"gunicorn's {green} worker (-k {green})"
    if f"gunicorn.workers.g{green}" not in sys.modules:
        worker = f"{green}'s monkey-patching of threading"
    raise RuntimeError(
        f"goblin-idem cannot serve a sync app under {worker}: its store calls run on a loop "
        "thread of their own, which a green thread cannot be, and every request would hang. "
        "Serve the app with gunicorn's gthread worker (--worker-class gthread --threads 8) "
        "or its sync worker, or as an ASGI app under the ASGI middleware"
    )


def _green_threads() -> str | None:
    """The library that made this process's threads greenlets, if one did (read from the
    modules it loaded: none is imported here)."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return None


def _forget_after_fork() -> None:
    """In a fork's child: the parent's loop thread did not come along."""
    global _current, _starting
    _starting = threading.Lock()  # another thread may have held it at the fork
    if _current is not None:
        _inherited.append(_current)
        _current = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
