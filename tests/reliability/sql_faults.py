"""Randomized faults over SQL records, on real servers: the scenario behind
``tests/reliability/test_sql_faults.py`` and ``bench/sql_faults.py``.

A throwaway PostgreSQL, a redis-server without persistence and `workers` servers (one port
each) of one stack (`STACKS`) with ``records=`` on PostgreSQL and a short lease: uvicorn
serving FastAPI (``tests/support/apps/sql_app.py``, asyncpg), or gunicorn (one gthread
worker each, which its master restarts when it dies) serving Flask with Flask-SQLAlchemy
(``tests/support/apps/sync_sql_app.py``, psycopg) or a Django project whose views write
through the ORM with ``RECORDS: "django"`` (`django_faults`). Client threads send ``POST /payments``
with a unique Idempotency-Key per payment, each key by `copies` clients at once, each client
to a random worker per attempt and again after every 409, 5xx or connection error, until it
gets a 2xx. Meanwhile a fault thread, driven by a seeded RNG, at random moments: restarts
Redis without persistence (SIGKILL, then a new server on the same port: every claim and
result gone), SIGKILLs a worker, or arms a worker to SIGKILL itself right after its next
commit (before the store hears of it); a dead worker is started again on its port. After the
faults stop and every key has its answer, each key is sent once more to every worker.

Then the database is counted: payment rows per key (a second row is a duplicate effect),
every 2xx body of a key the same bytes naming that key's one row, a committed record for
every key that got a 2xx. With ``records=False`` the same app runs without records (its
handler commits its own row), for the contrast: there a Redis restart can pay twice.

With ``store="postgres"`` (the FastAPI stack) the store is a PostgresStore in the same
database, and no Redis runs: the fault that was a Redis restart restarts PostgreSQL instead
(an immediate shutdown, a crash as far as the server knows, on a server whose commits are
synced), with keys in flight.

Every request, answer and fault is logged as a JSON line; every process is stopped by PID.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.support.apps.sql_app import create_tables
from tests.support.postgres import Postgres, start_postgres
from tests.support.procs import alive, children, spawn, stop, uvicorn_args, wait_http
from tests.support.servers import Server, free_port, start_server

APP = "tests.support.apps.sql_app:app"


@dataclass(frozen=True)
class Stack:
    """How one server of a stack is started on a port, and how its worker dies."""

    driver: str  # the database URL's
    supervised: bool  # a master restarts the worker: a kill ends the worker, not the server

    def args(self, port: int) -> list[str]:
        raise NotImplementedError


class UvicornFastAPI(Stack):
    def args(self, port: int) -> list[str]:
        return [*uvicorn_args(APP, port, "warning"), "--no-access-log"]


class GunicornFlask(Stack):
    def args(self, port: int) -> list[str]:
        args = ["-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1"]
        args += ["--worker-class", "gthread", "--threads", "4", "--log-level", "warning"]
        return [*args, "tests.support.apps.sync_sql_app:flask_app"]


class GunicornDjango(Stack):
    def args(self, port: int) -> list[str]:
        args = ["-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1"]
        args += ["--worker-class", "gthread", "--threads", "4", "--log-level", "warning"]
        return [*args, "tests.support.apps.django_records.wsgi:application"]


STACKS: dict[str, Stack] = {
    "fastapi": UvicornFastAPI("asyncpg", supervised=False),
    "flask": GunicornFlask("psycopg", supervised=True),
    "django": GunicornDjango("psycopg", supervised=True),  # `django_faults` prepares it
}
RECORDS_TABLE = "goblin_idem_records"
PAYMENTS_TABLE = "payments"
FAULTS = ("redis_restart", "worker_kill", "kill_after_commit")
POSTGRES_FAULTS = ("postgres_restart", "worker_kill", "kill_after_commit")


@dataclass
class Options:
    seed: int
    keys: int
    duration: float  # seconds of new keys and faults
    workers: int = 3
    clients: int = 12  # client threads
    copies: int = 2  # clients sending each key at once
    lease: float = 2.0
    fault_gap: float = 1.5  # mean seconds between faults
    grace: float = 60.0  # after `duration`, for the last keys to get their answers
    records: bool = True
    path: str = "/payments"  # or /payments/session: the app's session dependency
    stack: str = "fastapi"  # one of STACKS
    store: str = "redis"  # or "postgres": a PostgresStore in the records' database
    dir: Path | None = None  # for requests.jsonl (every request, answer and fault) and
    # the workers' logs; a new temporary directory if None


@dataclass
class Outcome:
    figures: dict[str, Any]
    failures: list[str]  # what broke (only asserted with records)
    duplicate_effects: int
    log: Path


@dataclass
class Log:
    """JSON lines, written by every thread."""

    out: IO[str]
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, **entry: Any) -> None:
        entry = {"t": round(time.monotonic() - self.t0, 3), **entry}
        line = json.dumps(entry, sort_keys=True)
        with self.lock:
            self.out.write(line + "\n")


class Workers:
    """`n` servers of the app, one port each; each worker can be killed and restarted."""

    def __init__(self, n: int, env: dict[str, str], directory: Path, stack: Stack) -> None:
        self.env, self.dir, self.stack = env, directory, stack
        self.seen: set[int] = set()  # a supervised server's worker processes
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.logs: list[IO[bytes]] = []
        self.started = 0

    def arm_file(self, i: int) -> Path:
        return self.dir / f"kill-after-commit-{i}"

    def start(self, i: int) -> None:
        out = (self.dir / f"worker-{i}.log").open("ab")
        self.logs.append(out)
        env = {**self.env, "KILL_AFTER_COMMIT_FILE": str(self.arm_file(i))}
        proc = spawn(self.stack.args(self.ports[i]), env, stderr=out)
        self.procs[i] = proc
        wait_http(proc, self.ports[i], name=f"worker {i}", timeout=60)
        self.started += 1

    def dead(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is None or p.poll() is not None]

    def workers_of(self, proc: subprocess.Popen[bytes]) -> list[int]:
        pids = [p for p in children(proc.pid) if alive(p)]
        self.seen.update(pids)
        return pids

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return
        if self.stack.supervised:  # the worker; its master starts another
            for pid in self.workers_of(proc):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                if self.stack.supervised:
                    self.workers_of(proc)
                stop(proc, signal.SIGKILL)
        for pid in self.seen:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for out in self.logs:
            out.close()


def post(
    port: int, key: str, timeout: float = 10.0, path: str = "/payments"
) -> tuple[int, bool, bytes]:
    """One ``POST /payments`` (or `path`) for `key`: status, replayed, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"ref": key, "amount": 7, "mode": "id"})
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        replayed = response.getheader("idempotent-replayed") == "true"
        return response.status, replayed, response.read()
    finally:
        conn.close()


RETRIED = {409, 500, 502, 503}


class Clients:
    """Each key sent by `copies` clients until each gets a 2xx."""

    def __init__(self, opts: Options, ports: list[int], log: Log, keys: list[str]) -> None:
        self.opts, self.ports, self.log, self.keys = opts, ports, log, keys
        self.lock = threading.Lock()
        self.statuses: Counter[str] = Counter()
        self.answers: dict[str, list[bytes]] = {k: [] for k in keys}  # 2xx bodies
        self.replays = 0
        self.unexpected: list[str] = []
        self.gave_up: list[str] = []

    def send(self, key: str, port: int) -> tuple[str, bool, bytes]:
        try:
            status, replayed, body = post(port, key, path=self.opts.path)
        except (OSError, http.client.HTTPException) as exc:
            self.log.write(key=key, port=port, error=type(exc).__name__)
            with self.lock:
                self.statuses["connection error"] += 1
            return "error", False, b""
        self.log.write(key=key, port=port, status=status, replayed=replayed, body=body.decode())
        with self.lock:
            self.statuses[str(status)] += 1
            if 200 <= status < 300:
                self.answers[key].append(body)
                self.replays += replayed
        return str(status), replayed, body

    def until_answered(self, index: int, copy: int, deadline: float) -> None:
        key = self.keys[index]
        rng = random.Random(f"{self.opts.seed}:{index}:{copy}")
        start = self.log.t0 + index * self.opts.duration / len(self.keys)
        time.sleep(max(0.0, start - time.monotonic()) + (rng.uniform(0, 0.05) if copy else 0))
        while time.monotonic() < deadline:
            status, _, _ = self.send(key, rng.choice(self.ports))
            if status.startswith("2"):
                return
            if status != "error" and int(status) not in RETRIED:
                with self.lock:
                    self.unexpected.append(f"{key}: status {status}")
                return
            time.sleep(rng.uniform(0.1, 0.3) if status == "409" else rng.uniform(0.02, 0.1))
        with self.lock:
            self.gave_up.append(key)

    def run(self, deadline: float) -> None:
        with ThreadPoolExecutor(self.opts.clients) as pool:
            jobs = [
                pool.submit(self.until_answered, i, c, deadline)
                for i in range(len(self.keys))
                for c in range(self.opts.copies)
            ]
            for job in jobs:
                job.result()


class Faults:
    """The seeded fault schedule, and the restart of dead workers, in one thread."""

    def __init__(
        self,
        opts: Options,
        redis: Server | None,
        workers: Workers,
        log: Log,
        postgres: Postgres | None = None,
    ) -> None:
        self.opts, self.redis, self.workers, self.log = opts, redis, workers, log
        self.postgres = postgres
        self.kinds = POSTGRES_FAULTS if redis is None else FAULTS
        self.rng = random.Random(opts.seed)
        self.counts: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.armed: set[int] = set()

    def restart_dead(self) -> None:
        for i in sorted(self.armed):  # the worker took the file: it died after a commit
            if not self.workers.arm_file(i).exists():
                self.armed.discard(i)
                self.counts["killed_after_commit"] += 1
                self.log.write(fault="killed_after_commit", worker=i)
        for i in self.workers.dead():
            self.log.write(fault="worker_restart", worker=i)
            self.workers.start(i)
            self.counts["worker_restarts"] += 1

    def fire(self) -> None:
        kind = self.rng.choice(self.kinds)
        victim = self.rng.randrange(len(self.workers.ports))
        self.log.write(fault=kind, worker=victim if not kind.endswith("_restart") else None)
        self.counts[kind] += 1
        if kind == "postgres_restart":
            assert self.postgres is not None
            down = self.rng.uniform(0.0, 0.5)
            self.postgres.stop()  # immediate: what was committed is kept, nothing else
            time.sleep(down)
            self.postgres.start()
        elif kind == "redis_restart":
            assert self.redis is not None
            down = self.rng.uniform(0.0, 0.5)
            self.redis.kill()
            time.sleep(down)
            self.redis.restart()
        elif kind == "worker_kill":
            self.workers.kill(victim)
        else:
            self.workers.arm_file(victim).touch()
            self.armed.add(victim)

    def run(self, until: float, stop_event: threading.Event) -> None:
        try:
            next_at = time.monotonic() + self.rng.uniform(0.3, 2) * self.opts.fault_gap
            while not stop_event.is_set():
                self.restart_dead()
                now = time.monotonic()
                if now >= until:
                    if stop_event.wait(0.1):
                        break
                    continue
                if now >= next_at:
                    self.fire()
                    next_at = time.monotonic() + self.rng.uniform(0.3, 1.7) * self.opts.fault_gap
                time.sleep(0.02)
        except BaseException as exc:
            self.error = exc
            self.log.write(fault="fault thread failed", error=repr(exc))


def _prepare(postgres: Postgres, driver: str) -> str:
    database = postgres.new_database()
    create_tables(postgres.url(database), RECORDS_TABLE, PAYMENTS_TABLE)
    return postgres.url(database, driver)


def _store_env(postgres: Postgres, database: str, redis: Server | None) -> dict[str, str]:
    """The app's store: the Redis, or a PostgresStore in the database (its table made)."""
    if redis is not None:
        return {"REDIS_URL": redis.url}
    from goblin_idem.store._postgres_sql import ddl

    postgres.psql(ddl(), database)
    return {"POSTGRES_STORE_URL": f"postgresql://postgres@127.0.0.1:{postgres.port}/{database}"}


def _database(postgres: Postgres, database: str) -> tuple[dict[str, list[int]], list[bytes]]:
    """Payment row ids by ref, and the committed records."""
    rows: dict[str, list[int]] = {}
    out = postgres.psql(f"SELECT ref, id FROM {PAYMENTS_TABLE} ORDER BY id", database)
    for line in out.splitlines():
        ref, payment = line.split("|")
        rows.setdefault(ref, []).append(int(payment))
    out = postgres.psql(f"SELECT encode(record, 'hex') FROM {RECORDS_TABLE}", database)
    return rows, [bytes.fromhex(line) for line in out.splitlines() if line]


def _check(
    keys: list[str],
    clients: Clients,
    rows: dict[str, list[int]],
    records: list[bytes],
) -> list[str]:
    failures: list[str] = [*clients.unexpected]
    failures += [f"{k}: no 2xx answer in time" for k in clients.gave_up]
    stray = set(rows) - set(keys)
    failures += [f"a payment row for a key never sent: {k}" for k in sorted(stray)]
    by_ref: dict[str, list[bytes]] = {}
    for record in records:
        found = re.search(rb'\{"ref":"([^"]+)"', record)
        if found:
            by_ref.setdefault(found.group(1).decode(), []).append(record)
    for key in keys:
        ids = rows.get(key, [])
        if len(ids) > 1:
            failures.append(f"{key}: {len(ids)} payment rows {ids} (a duplicate effect)")
        bodies = clients.answers[key]
        if not bodies:
            continue
        if len(ids) != 1:
            failures.append(f"{key}: answered 2xx, but {len(ids)} payment rows")
        if len(set(bodies)) > 1:
            failures.append(f"{key}: {len(set(bodies))} different 2xx bodies {sorted(set(bodies))}")
        paid = json.loads(bodies[0]).get("payment")
        if ids and paid not in ids:
            failures.append(f"{key}: answered payment {paid}, its rows are {ids}")
        if not any(bodies[0] in r for r in by_ref.get(key, [])):
            failures.append(f"{key}: answered 2xx, but no committed record holds its body")
    return failures


def run(opts: Options) -> Outcome:
    """The whole scenario; every process it started is stopped by PID before it returns."""
    scratch = opts.dir or Path(tempfile.mkdtemp(prefix="goblin-sql-faults-"))
    scratch.mkdir(parents=True, exist_ok=True)
    log_path = scratch / "requests.jsonl"
    postgres: Postgres | None = None
    redis: Server | None = None
    workers: Workers | None = None
    stop_faults = threading.Event()
    started = time.monotonic()
    with log_path.open("w") as out:
        log = Log(out)
        try:
            on_postgres = opts.store == "postgres"
            if on_postgres and opts.stack != "fastapi":
                raise ValueError("store='postgres' runs with the fastapi stack")
            postgres = start_postgres(durable=on_postgres)  # a crash keeps what committed
            stack = STACKS[opts.stack]
            if not on_postgres:
                redis = start_server("redis")  # no persistence: a restart loses every key
            if opts.stack == "django":
                from tests.reliability import django_faults

                assert redis is not None
                env = django_faults.prepare(postgres, redis.url, opts)
                database = env["DJANGO_DB"].rsplit("/", 1)[1]
            else:
                url = _prepare(postgres, stack.driver)
                database = url.rsplit("/", 1)[1]
                env = {
                    "DATABASE_URL": url,
                    **_store_env(postgres, database, redis),
                    "RECORDS_TABLE": RECORDS_TABLE,
                    "PAYMENTS_TABLE": PAYMENTS_TABLE,
                    "LEASE_SECONDS": str(opts.lease),
                    "RECORDS": "1" if opts.records else "0",
                }
            workers = Workers(opts.workers, env, scratch, stack)
            for i in range(opts.workers):
                workers.start(i)
            keys = [f"pay-{opts.seed}-{i}" for i in range(opts.keys)]
            clients = Clients(opts, workers.ports, log, keys)
            faults = Faults(opts, redis, workers, log, postgres)
            log.t0 = time.monotonic()
            fault_thread = threading.Thread(
                target=faults.run, args=(log.t0 + opts.duration, stop_faults), daemon=True
            )
            fault_thread.start()
            clients.run(log.t0 + opts.duration + opts.grace)
            load_seconds = time.monotonic() - log.t0
            stop_faults.set()
            fault_thread.join(timeout=120)
            faults.restart_dead()
            for i, _ in enumerate(workers.procs):  # an armed worker that never committed
                with contextlib.suppress(FileNotFoundError):
                    workers.arm_file(i).unlink()
            rows, _ = _database(postgres, database)
            before = sum(len(ids) - 1 for ids in rows.values() if len(ids) > 1)
            log.write(phase="every key once more to every worker")
            for key in keys:
                if clients.answers[key]:
                    for port in workers.ports:
                        clients.send(key, port)
            rows, records = _database(postgres, database)
            failures = _check(keys, clients, rows, records)
            if faults.error is not None:
                failures.append(f"the fault thread failed: {faults.error!r}")
            duplicates = sum(len(ids) - 1 for ids in rows.values() if len(ids) > 1)
            figures: dict[str, Any] = {
                "seed": str(opts.seed),  # not a quantity: printed as is
                "stack": opts.stack,
                "records": opts.records,
                "path": opts.path,
                "keys": len(keys),
                "keys_answered": sum(1 for k in keys if clients.answers[k]),
                "requests": sum(clients.statuses.values()),
                "statuses": dict(sorted(clients.statuses.items())),
                "replays": clients.replays,
                "store": opts.store,
                "faults": {k: faults.counts[k] for k in faults.kinds},
                "killed_after_commit": faults.counts["killed_after_commit"],
                "worker_restarts": faults.counts["worker_restarts"],
                "payment_rows": sum(len(ids) for ids in rows.values()),
                "committed_records": len(records),
                "duplicate_effects": duplicates,
                "duplicate_effects_before_last_pass": before,
                "keys_with_duplicates": sum(1 for ids in rows.values() if len(ids) > 1),
                "workers": opts.workers,
                "clients": opts.clients,
                "copies_per_key": opts.copies,
                "lease_s": opts.lease,
                "load_s": round(load_seconds, 1),
                "wall_s": round(time.monotonic() - started, 1),
            }
            return Outcome(figures, failures, duplicates, log_path)
        finally:
            stop_faults.set()
            if workers is not None:
                workers.stop()
            if redis is not None:
                redis.stop()
            if postgres is not None:
                postgres.remove()
            for path in scratch.glob("kill-after-commit-*"):
                path.unlink()


__all__ = ["Options", "Outcome", "run"]
