"""WSGI benchmark: Flask and Django under gunicorn (gthread), bare and with goblin-idem on
Redis, and Django with django-idempotency-key, the most used Django package for the job;
Flask with Flask-SQLAlchemy writing one row per order on PostgreSQL, bare, with goblin-idem,
and with goblin-idem's SQL records (the row and the record in one commit).

    python3 bench/wsgi_bench.py
    python3 bench/wsgi_bench.py --variants flasksql-goblin,flasksql-records
    python3 bench/wsgi_bench.py --variants djangodb-goblin,djangodb-records

The ``djangodb-*`` variants' handler also inserts a row in PostgreSQL (a throwaway server,
commits synced, on core 1) through Django's connection: bare, behind goblin-idem on the
store alone, and with ``RECORDS: "django"`` (the row and the record in one commit).

It runs in the benchmark's own environment (bench/.venv, from bench/requirements.txt, made
by http_bench.py's `ensure_env`), starts one throwaway redis-server and one gunicorn per
variant (one worker, `--threads`, pinned to core 0; wrk and Redis on core 1), and runs wrk
against each: every scenario, every variant in turn with a run of its framework's bare app
before and after (bare A bare B ...), `--reps` times; the table shows medians, each ratio to
the mean of the bare runs just before and after it. Each run is checked: a replay never
runs the handler, a new key and no key run it once per request, and every answer is 2xx.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from http_bench import baseline_name, cpu_seconds, ensure_env, fetch, pin

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PATH = "/orders"
BODY = b'{"sku":"A-1","qty":2}'
SCENARIOS = ("new", "replay", "nokey")
TITLES = {"new": "new key", "replay": "replay", "nokey": "no key"}
BARE = {
    "flask": "flask-bare",
    "flasksql": "flasksql-bare",
    "django": "django-bare",
    "djangodb": "djangodb-bare",
}


BASELINE = "@baseline"  # a variant served by --baseline's checkout


@dataclass
class App:
    variant: str
    label: str
    tree: Path = ROOT  # the checkout whose wsgi_serve.py and package serve it
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    broken: str = ""
    runs: list[Run] = field(default_factory=list)

    @property
    def framework(self) -> str:
        return self.variant.split("-")[0]

    def worker(self) -> int:
        from tests.support.procs import children

        assert self.proc is not None
        return children(self.proc.pid)[0]

    def handler_calls(self) -> int:
        import json

        return int(json.loads(fetch(self.port, "GET", "/__stats")[2])["handler_calls"])


@dataclass
class Run:
    scenario: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    check: str
    ratio: float | None = None
    cpu_ratio: float | None = None


def labels() -> dict[str, str]:
    from importlib.metadata import version

    return {
        "flask-bare": f"Flask {version('flask')}, bare",
        "flask-goblin": "Flask, goblin-idem (Redis)",
        "flasksql-bare": f"Flask-SQLAlchemy {version('flask-sqlalchemy')} on PostgreSQL, bare",
        "flasksql-goblin": "Flask-SQLAlchemy, goblin-idem (Redis)",
        "flasksql-records": "Flask-SQLAlchemy, goblin-idem (Redis) + SQL records",
        "flask-goblin-cache": "Flask, goblin-idem (Redis), replay cache (4 MiB)",
        "django-bare": f"Django {version('django')}, bare",
        "django-goblin": "Django, goblin-idem (Redis)",
        "django-goblin-cache": "Django, goblin-idem (Redis), replay cache (4 MiB)",
        "django-peer": f"Django, django-idempotency-key {version('django-idempotency-key')}"
        " (Redis cache and lock)",
        "djangodb-bare": "Django + PostgreSQL INSERT, bare",
        "djangodb-goblin": "Django + PostgreSQL INSERT, goblin-idem (Redis)",
        "djangodb-records": 'Django + PostgreSQL INSERT, goblin-idem, RECORDS "django"',
    }


def start(app: App, args: argparse.Namespace, redis_url: str, databases: dict[str, str]) -> None:
    from tests.support.procs import wait_http
    from tests.support.servers import free_port

    app.port = free_port()
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "gunicorn", "wsgi_serve:app"]
    cmd += ["--bind", f"127.0.0.1:{app.port}", "--worker-class", "gthread", "--workers", "1"]
    cmd += ["--threads", str(args.threads), "--log-level", "warning"]
    variant = app.variant.removesuffix(BASELINE)
    env = {**os.environ, "WSGI_VARIANT": variant, "REDIS_URL": redis_url}
    env.update(databases)  # DATABASE_URL, DJANGO_DB
    env["PYTHONPATH"] = os.pathsep.join([str(app.tree / "bench"), str(app.tree)])
    cwd = app.tree / "bench"
    app.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL)
    try:
        wait_http(app.proc, app.port, path="/__stats", name=app.variant, timeout=30)
    except RuntimeError as exc:
        app.broken = str(exc).splitlines()[0]
        return
    for i in range(args.replay_keys):  # the keys the replay scenario cycles through
        status, headers, body = fetch(app.port, "POST", PATH, BODY, f"replay-{i}")
        if status != 201:
            app.broken = f"answered {status}: {body[:200]!r}"
            return
    if not app.variant.endswith("bare"):
        status, headers, _ = fetch(app.port, "POST", PATH, BODY, "replay-0")
        replayed = headers.get("idempotent-replayed") == "true" or app.variant == "django-peer"
        if status != 201 or not replayed:
            app.broken = f"no replay: {status} {headers}"


def start_postgres() -> Any:
    """A throwaway PostgreSQL (tests/support/postgres.py) whose commits are synced, as an
    application's are, pinned to core 1 (the app creates its tables)."""
    from tests.support.postgres import start_postgres as start

    pg = start(durable=True)
    pin(pg.pid, 1)
    return pg


def wrk(args: argparse.Namespace, port: int, scenario: str, prefix: str, seconds: int) -> Any:
    import json

    cmd = ["taskset", "-c", "1", "wrk", "-t1", f"-c{args.connections}", f"-d{seconds}s"]
    cmd += ["--timeout", "10s", "-s", str(BENCH / "scenario.lua")]
    cmd += [f"http://127.0.0.1:{port}{PATH}", "--", scenario, prefix, str(args.replay_keys)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("BENCH "))
    return json.loads(line[6:])


def measure(app: App, args: argparse.Namespace, scenario: str, rep: int) -> Run:
    prefix = {"new": f"new-r{rep}-{app.variant}", "replay": "replay"}.get(scenario, "-")
    worker = app.worker()
    calls, cpu = app.handler_calls(), cpu_seconds(worker)
    result = wrk(args, app.port, scenario, prefix, args.duration)
    cpu, calls = cpu_seconds(worker) - cpu, app.handler_calls() - calls
    n = max(result["requests"], 1)
    problems = []
    if result["status_errors"] or result["socket_errors"]:
        problems.append(f"{result['status_errors']} statuses, {result['socket_errors']} sockets")
    replays = scenario == "replay" and not app.variant.endswith("bare")
    if replays and calls:
        problems.append(f"handler ran {calls}x")
    elif not replays and not n <= calls <= n + args.connections:
        problems.append(f"handler ran for {100 * calls / n:.3g}% of requests")
    run = Run(
        scenario,
        n / (result["duration_us"] / 1e6),
        result["p50_us"] / 1000,
        result["p99_us"] / 1000,
        cpu * 1e6 / n,
        "; ".join(problems) or "ok",
    )
    app.runs.append(run)
    print(
        f"  rep {rep} {scenario:6} {app.variant:14} {run.rps:8,.0f} req/s "
        f"p99 {run.p99_ms:6.2f} ms cpu {run.cpu_us:5.0f} us  {run.check}",
        flush=True,
    )
    return run


def table(apps: list[App]) -> str:
    rows = [
        "| app | scenario | req/s | p50 ms | p99 ms | req/s / bare | CPU us/req "
        "| capacity / bare | check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for app in apps:
        for scenario in SCENARIOS:
            runs = [r for r in app.runs if r.scenario == scenario]
            if not runs:
                continue

            def med(values: list[float]) -> float:
                return statistics.median(values)

            ratios = [r.ratio for r in runs if r.ratio is not None]
            cpu_ratios = [r.cpu_ratio for r in runs if r.cpu_ratio is not None]
            ratio = f"{med(ratios):.2f}x" if ratios else "1.00x"
            capacity = f"{med(cpu_ratios):.2f}x" if cpu_ratios else "1.00x"
            checks = sorted({r.check for r in runs})
            rows.append(
                f"| {app.label} | {TITLES[scenario]} | {med([r.rps for r in runs]):,.0f} "
                f"| {med([r.p50_ms for r in runs]):.2f} | {med([r.p99_ms for r in runs]):.2f} "
                f"| {ratio} | {med([r.cpu_us for r in runs]):.0f} | {capacity} "
                f"| {'; '.join(checks)} |"
            )
    return "\n".join(rows)


def main() -> None:
    ensure_env()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=int, default=3, help="seconds per wrk run (3)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    p.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    p.add_argument("--threads", type=int, default=8, help="gunicorn gthread threads (8)")
    p.add_argument("--replay-keys", type=int, default=100, help="completed keys to replay")
    p.add_argument("--variants", default="flask-goblin,django-goblin,django-peer")
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of the project: a variant named NAME@baseline is NAME served "
        "by its bench/wsgi_serve.py and package, in the same run",
    )
    args = p.parse_args()
    from importlib.metadata import version

    from tests.support.procs import stop
    from tests.support.servers import start_server

    names = labels()
    wanted = [v for v in args.variants.split(",") if v]
    frameworks = sorted({v.split("-")[0] for v in wanted})
    apps = [App(BARE[f], names[BARE[f]]) for f in frameworks]
    apps += [App(v, names[v.removesuffix(BASELINE)]) for v in wanted]
    for app in apps:
        if app.variant.endswith(BASELINE):
            if args.baseline is None:
                raise SystemExit(f"{app.variant} needs --baseline DIR (the checkout serving it)")
            app.tree = args.baseline.resolve()
            app.label += f" [{baseline_name(app.tree)}]"
    bare = {a.framework: a for a in apps if a.variant.endswith("bare")}
    started = time.monotonic()
    redis = start_server("redis")
    pin(redis.pid, 1)
    pg: Any = None
    databases: dict[str, str] = {}
    try:
        if {"flasksql", "djangodb"} & set(frameworks):
            pg = start_postgres()
            databases["DATABASE_URL"] = pg.url(driver="psycopg")
            name = pg.new_database()
            pg.psql("CREATE TABLE orders (id serial PRIMARY KEY, sku text, qty int)", name)
            databases["DJANGO_DB"] = f"postgresql://postgres@127.0.0.1:{pg.port}/{name}"
        with redis.sync_client() as client:
            redis_version = client.info("server")["redis_version"]
        for app in apps:
            start(app, args, redis.url, databases)
            if not app.broken:
                wrk(args, app.port, "new", f"warm-{app.variant}", 1)
            print(f"  {app.label}: {app.broken or 'ready'}", flush=True)
        for rep in range(1, args.reps + 1):
            for scenario in SCENARIOS:
                for app in apps:
                    if app.variant.endswith("bare") or app.broken:
                        continue
                    base = bare[app.framework]
                    before = measure(base, args, scenario, rep)
                    run = measure(app, args, scenario, rep)
                    after = measure(base, args, scenario, rep)
                    run.ratio = run.rps / ((before.rps + after.rps) / 2)
                    run.cpu_ratio = (before.cpu_us + after.cpu_us) / 2 / run.cpu_us
    finally:
        for app in apps:
            if app.proc is not None:
                stop(app.proc)
        redis.stop()
        if pg is not None:
            pg.remove()
    cpu = platform.processor() or platform.machine()
    print("\n```")
    print(
        f"{os.cpu_count()} x {cpu}, Linux {platform.release()}, Python "
        f"{platform.python_version()}; gunicorn {version('gunicorn')} (gthread, one worker, "
        f"{args.threads} threads); redis-server {redis_version}; wrk -t1 -c{args.connections}"
        f" -d{args.duration}s per run, {args.reps} repetitions, the framework's bare app "
        f"before and after each run (bare A bare, bare B bare), medians; total "
        f"{(time.monotonic() - started) / 60:.1f} min"
    )
    print("```\n")
    print(table(apps))


if __name__ == "__main__":
    sys.path.append(str(ROOT))  # after PYTHONPATH, which may name another copy
    main()
