"""Where goblin-idem's log lines go while the application has not configured logging.

A library's WARNING and ERROR lines that no handler takes reach Python's last-resort
handler, which prints the bare message: no level, no logger, no time, and under a server
not in the server's format. One handler on the ``goblin_idem`` logger takes its place and
does nothing more: it stands aside for any handler the application gave those lines (on
the root logger, or on the line's own logger chain), so each line is written once, by the
application's handlers. Otherwise it hands the line to the server's error log, in the
server's format and at the server's level, with the logger's name in front; without a
server, it writes to stderr what the last-resort handler would, with the time, the level
and the logger's name. The root logger is never touched.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

__all__ = ["configured", "describe", "install", "server_log"]

# The error logs of the servers that run ASGI apps, in the order they are looked for
# (gunicorn's uvicorn workers share gunicorn's handlers through uvicorn.error).
SERVER_LOGS = ("uvicorn.error", "gunicorn.error", "_granian")
_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def configured(name: str) -> bool:
    """Whether a handler of the application's takes the lines of logger `name`: one on
    that logger or on the way up from it to the root logger, this module's aside.

    Called while a handler's lock is held, so it takes no lock of logging's: a logging
    (re)configuration holds logging's lock while it takes each handler's."""
    log = logging.Logger.manager.loggerDict.get(name)
    if not isinstance(log, logging.Logger):  # not created yet: nothing of its own
        log = logging.root
    while log is not None:
        if any(not isinstance(handler, _Handler) for handler in log.handlers):
            return True
        log = log.parent if log.propagate else None
    return False


def server_log() -> logging.Logger | None:
    """The error log of the server running this process, once it has set one up."""
    known = logging.Logger.manager.loggerDict
    for name in SERVER_LOGS:
        log = known.get(name)
        if isinstance(log, logging.Logger) and log.hasHandlers():
            return log
    return None


class _Handler(logging.Handler):
    """In place of the last-resort handler, for the loggers under ``goblin_idem``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if configured(record.name):
                return
            server = server_log()
            if server is not None:
                if record.levelno >= server.getEffectiveLevel():  # no lock taken
                    named = copy.copy(record)  # the server's format may not show the name
                    named.msg, named.args = f"{record.name}: {record.getMessage()}", None
                    server.handle(named)
            elif logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                sys.stderr.write(_FORMAT.format(record) + "\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


def install() -> None:
    """The handler on the ``goblin_idem`` logger, once per process."""
    log = logging.getLogger("goblin_idem")
    if not any(isinstance(handler, _Handler) for handler in log.handlers):
        log.addHandler(_Handler())


def describe(exc: BaseException) -> str:
    """`TypeName: message` for a log line or an error message (redis-py's repr of its
    errors drops the message), and the system's words for an OS error behind it
    (redis-py says "Error 111 connecting to ...", not "Connection refused")."""
    text = f"{type(exc).__name__}: {exc}"
    cause: BaseException | None = exc
    seen: set[int] = set()  # a chain can loop back on itself
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno:
            words = os.strerror(cause.errno)
            return text if words in text else f"{text} ({words})"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return text
