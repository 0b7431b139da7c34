"""SQL records under randomized faults, at a chosen size and seed.

    python bench/sql_faults.py [--seed 20261202] [--keys 1500] [--duration 90]
                               [--workers 3] [--clients 12] [--fault-gap 1.5]
                               [--no-records] [--stack fastapi|flask|django]
                               [--session] [--store redis|postgres] [--dir DIR]

The scenario of ``tests/reliability/test_sql_faults.py``
(``tests/reliability/sql_faults.py``): a throwaway PostgreSQL, a redis-server without
persistence and servers of one stack (``--stack``: uvicorn serving FastAPI, the default, or
gunicorn serving Flask with Flask-SQLAlchemy) serving a payments app with ``records=``;
clients send every key until it gets a 2xx while a seeded fault schedule restarts Redis
(every claim and result lost), SIGKILLs workers, and has workers SIGKILL themselves right
after a commit. Every process runs on 127.0.0.1 and is stopped by PID when the run ends. It
prints the figures as JSON, and what broke.

``--stack django`` serves a Django project under gunicorn (gthread) instead, its views
writing through the ORM with ``RECORDS: "django"``. With ``--no-records`` the same app runs
on the store alone (its handler commits its own row): the contrast, where a Redis restart
can pay a key twice. The exit status is 1 if a guarantee broke with records (a duplicate
effect, an answer that differs), else 0.
With ``--session`` (FastAPI) the handler writes through ``Depends(session)`` (with
``--no-records``, through the session dependency apps write themselves, which commits after
the handler).
With ``--store postgres`` (FastAPI) the claims are in PostgreSQL too (a PostgresStore in the
records' database), no Redis runs, and the restart fault restarts PostgreSQL.
``--dir`` keeps every request, answer and fault (``requests.jsonl``) and the workers' logs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.sql_faults import STACKS, Options, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--keys", type=int, default=1500)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load and faults")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--fault-gap", type=float, default=1.5, help="mean seconds between faults")
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--no-records", action="store_true", help="the store alone")
    parser.add_argument("--stack", choices=sorted(STACKS), default="fastapi")
    parser.add_argument(
        "--session",
        action="store_true",
        help="write through the session dependency (without records: the app's own)",
    )
    parser.add_argument("--store", choices=("redis", "postgres"), default="redis")
    parser.add_argument("--dir", type=Path, help="keep the request log and workers' logs here")
    args = parser.parse_args()
    if args.session and args.stack != "fastapi":
        parser.error("--session is FastAPI's session dependency: with --stack fastapi only")
    if args.store == "postgres" and args.stack != "fastapi":
        parser.error("--store postgres runs with --stack fastapi")
    outcome = run(
        Options(
            seed=args.seed,
            keys=args.keys,
            duration=args.duration,
            workers=args.workers,
            clients=args.clients,
            fault_gap=args.fault_gap,
            lease=args.lease,
            records=not args.no_records,
            path="/payments/session" if args.session else "/payments",
            stack=args.stack,
            store=args.store,
            dir=args.dir,
        )
    )
    print(json.dumps(outcome.figures, indent=1))
    for failure in outcome.failures[:30]:
        print("broke:", failure)
    if len(outcome.failures) > 30:
        print(f"... and {len(outcome.failures) - 30} more")
    print(f"log: {outcome.log}")
    return 1 if outcome.failures and not args.no_records else 0


if __name__ == "__main__":
    raise SystemExit(main())
