"""The Django stack of the fault run (`sql_faults`, ``stack="django"``): the records project
(tests/support/apps/django_records) under gunicorn, one master per port with one gthread
worker process (4 threads), on PostgreSQL, with ``RECORDS: "django"`` (or without records,
the control: each view's payment commits on its own).

A worker killed (SIGKILL, or by itself right after a commit) is replaced by its master: a
worker is dead until the master's new one answers, which `start` waits for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from tests.support.postgres import Postgres
from tests.support.procs import alive, children, http_status, spawn, stop
from tests.support.wsgi import run_until_exit

from .sql_faults import Options, Workers

APP = "tests.support.apps.django_records.wsgi:application"
SETTINGS = "tests.support.apps.django_records.settings"


def prepare(postgres: Postgres, redis_url: str, opts: Options) -> dict[str, str]:
    """A new database with the project's tables (its payments and goblin_idem's records);
    the workers' environment."""
    database = postgres.new_database()
    env = {
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DJANGO_DB": f"postgresql://postgres@127.0.0.1:{postgres.port}/{database}",
        "REDIS_URL": redis_url,
        "LEASE_SECONDS": str(opts.lease),
        "RECORDS": "1" if opts.records else "0",
    }
    code, said = run_until_exit(["-m", "django", "migrate", "--run-syncdb", "-v", "0"], env)
    if code != 0:
        raise RuntimeError(f"migrate failed: {said}")
    return env


class DjangoWorkers(Workers):
    """A gunicorn master per port, each with one worker process it replaces when it dies."""

    def __init__(self, n: int, env: dict[str, str], directory: Path) -> None:
        super().__init__(n, env, directory)
        self.pids: list[int | None] = [None] * n  # each master's worker process

    def start(self, i: int) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            out = (self.dir / f"worker-{i}.log").open("ab")
            self.logs.append(out)
            env = {**self.env, "KILL_AFTER_COMMIT_FILE": str(self.arm_file(i))}
            args = ["-m", "gunicorn", "--bind", f"127.0.0.1:{self.ports[i]}", "--workers", "1"]
            args += ["--worker-class", "gthread", "--threads", "4", "--timeout", "30"]
            args += ["--graceful-timeout", "5", "--log-level", "warning", APP]
            proc = self.procs[i] = spawn(args, env, stderr=out)
        deadline = time.monotonic() + 60
        while True:
            workers = [p for p in children(proc.pid) if alive(p)]
            if workers and http_status(self.ports[i], "/health") == 200:
                self.pids[i] = workers[0]
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {i} did not start (see worker-{i}.log)")
            time.sleep(0.05)
        self.started += 1

    def dead(self) -> list[int]:
        return [i for i, pid in enumerate(self.pids) if pid is None or not alive(pid)]

    def kill(self, i: int) -> None:
        pid = self.pids[i]
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.01)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                workers = children(proc.pid)
                stop(proc, signal.SIGINT)  # gunicorn's quick shutdown
                for pid in workers:
                    if alive(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
        for out in self.logs:
            out.close()
