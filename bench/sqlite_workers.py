"""SQL records on one SQLite file under several uvicorn workers: how many answers are 500 or
503 when every run writes.

    python bench/sqlite_workers.py [--requests 400] [--clients 16] [--work-ms 100]
                                   [--workers 2] [--read-first | --hold-ms MS] [--log CHARS]

A redis-server without persistence on a free loopback port, a fresh SQLite file, and
``uvicorn --workers N`` serving tests/support/apps/sql_app.py; every request a new key
whose run works ``--work-ms`` and then inserts a payment (``--read-first``: reads the
payments table, then inserts; ``--hold-ms``: inserts, then works that long in its
transaction). Prints the answers by status (and problem type), the keys answered 201 and
the payments in the file, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sql.sqlite_load import run
from tests.support.servers import start_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--work-ms", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--read-first", action="store_true", help="each run reads, then writes")
    parser.add_argument("--hold-ms", type=int, default=0, help="work after the write, in it")
    parser.add_argument("--log", type=int, default=0, help="print the servers' last N chars")
    args = parser.parse_args()
    server = start_server("redis")
    try:
        with tempfile.TemporaryDirectory() as directory:
            outcome = run(
                Path(directory),
                server.url,
                requests=args.requests,
                clients=args.clients,
                work_ms=args.work_ms,
                workers=args.workers,
                read_first=args.read_first,
                hold_ms=args.hold_ms,
            )
    finally:
        server.stop()
    print(json.dumps(outcome.as_dict(), indent=2))
    if args.log:
        print(outcome.log[-args.log :], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
