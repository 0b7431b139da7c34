"""`python -m example_app [--host H] [--port N]`: serve the example app with uvicorn.

The store comes from the environment: ``REDIS_URL`` (unset: the embedded MemoryStore),
and ``GOBLIN_LEASE_SECONDS``, ``GOBLIN_TTL_SECONDS``, ``GOBLIN_JOB_LEASE_MS``,
``GOBLIN_DEMO_ROUTES`` (see `example_app.app.app_from_env`).

The payments and the middleware's records go to the database at ``GOBLIN_DATABASE_URL``.
Unset, that is a new SQLite file in the temporary directory, removed when the app stops: as
with the embedded store, each start begins empty and nothing is written to the working
directory (the startup log names the file). ``sqlite+aiosqlite:///example.db`` keeps them
in ``example.db`` across restarts. The tables are created at startup.
``GOBLIN_SQL_RECORDS=0`` keeps the records in the store only.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn
from uvicorn.logging import DefaultFormatter

from .app import app_from_env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = parser.parse_args(argv)

    # The app's own startup line, formatted like uvicorn's. goblin_idem's loggers keep
    # Python's default (warnings and errors only, to stderr).
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    app_logger = logging.getLogger("example_app")
    app_logger.addHandler(handler)
    app_logger.setLevel(args.log_level.upper())
    app_logger.propagate = False

    uvicorn.run(app_from_env(), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
