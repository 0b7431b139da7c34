"""HTTP benchmark: goblin-idem against the bare app and published idempotency middlewares.

One command runs everything and prints a Markdown table (see README.md):

    python3 bench/http_bench.py

It makes its own environment (bench/.venv, from bench/requirements.txt; the peers are
installed there only) and re-runs itself inside it. Then it builds the goblin server module,
starts one throwaway redis-server per Redis variant (a 3-primary Redis Cluster for the
``goblin-cluster-*`` variants, which run only when named in ``--variants``) and one uvicorn
server per variant, all on free 127.0.0.1 ports, and runs wrk against each: every scenario,
every variant in turn with a run of the bare app before and after each (bare A bare B bare
...), `--reps` times; the table shows medians. Uvicorn is pinned to core 0, wrk and the
redis-servers to core 1. Every process it starts is stopped by PID at the end.

Each run is checked, so an error is never timed as a success: replays and in-flight
duplicates must not run the handler, in-flight duplicates must all get 409, and the
others must all succeed. A ratio is to the mean of the bare app's runs just before and
just after, so that the machine's drift over minutes does not enter it.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import venv
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import serve  # bench/serve.py: the variants, and what the scenarios send

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENV = BENCH / ".venv"
REQUIREMENTS = BENCH / "requirements.txt"
SCENARIOS = ("new", "replay", "inflight", "nokey")
BASELINE = "@baseline"  # a variant served by --baseline's checkout
SCENARIO_TITLES = {
    "new": "new key",
    "replay": "replay",
    "inflight": "in flight (409)",
    "nokey": "no key",
}


# -- the environment ------------------------------------------------------------------------


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_env() -> None:
    """Create or update bench/.venv from requirements.txt, then re-run the script in it."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    stamp = VENV / "requirements.sha256"
    if not stamp.is_file() or stamp.read_text().strip() != wanted:
        print(f"preparing {VENV.relative_to(ROOT)} (first run only) ...", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        subprocess.run(
            [str(venv_python()), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
            check=True,
        )
        stamp.write_text(wanted + "\n")
    python = str(venv_python())
    os.execv(python, [python, str(Path(sys.argv[0]).resolve()), *sys.argv[1:]])


# -- processes ------------------------------------------------------------------------------


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so the `finally` blocks stop every server started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def pin(pid: int, core: int) -> None:
    if (os.cpu_count() or 1) > core:
        os.sched_setaffinity(pid, {core})


def fetch(port: int, method: str, path: str, body: bytes = b"", key: str | None = None) -> Any:
    """One request on a fresh connection: (status, headers dict, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@dataclass
class Variant:
    name: str
    label: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    redis: Any = None  # tests.support.servers.Server, or a Cluster for the cluster variants
    broken: str = ""  # why this variant could not be measured
    prefill: dict[str, float] = field(default_factory=dict)  # used memory before and after
    tree: Path | None = None  # NAME@baseline: served by --baseline's checkout, its own serve.py

    @property
    def kind(self) -> str:
        """The variant as serve.py names it (without @baseline)."""
        return self.name.removesuffix(BASELINE)

    def stats(self) -> dict[str, int]:
        _, _, body = fetch(self.port, "GET", serve.STATS_PATH)
        return {k: int(v) for k, v in json.loads(body).items()}


def start_app(v: Variant, args: argparse.Namespace, free_port: Any) -> None:
    from tests.support.procs import wait_http

    v.port = free_port()
    tree = v.tree or ROOT
    cmd = ["taskset", "-c", "0", sys.executable, str(tree / "bench" / "serve.py"), v.kind]
    cmd += ["--port", str(v.port), "--app", args.app]
    if v.redis is not None:
        cmd += ["--redis-url", nodes(v.redis)[0].url]
    if args.no_hiredis:
        cmd.append("--no-hiredis")
    if args.gc_freeze:
        cmd.append("--gc-freeze")
    if args.gc_threshold is not None:
        cmd += ["--gc-threshold", str(args.gc_threshold)]
    if v.tree is None:  # a baseline's serve.py may not know these (parse_args refuses them)
        cmd += ["--body-bytes", str(args.body_bytes), "--compression", args.compression]
    if args.handler in ("pg", "sql", "session"):
        cmd += ["--handler", args.handler, "--pg-dsn", args.pg_dsn]
    if args.prefill_keys and v.kind == "goblin-memory":
        cmd += ["--prefill-keys", str(args.prefill_keys)]
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if v.tree is not None:  # its own package, whatever PYTHONPATH names
        path = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(tree)])}
    v.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait = 30 + args.prefill_keys / 20_000  # a MemoryStore fills as it starts
        wait_http(v.proc, v.port, path=serve.STATS_PATH, name="server", timeout=wait)
    except RuntimeError as exc:  # "server exited (1): <stderr>": keep its last line
        what, _, said = str(exc).partition(": ")
        v.broken = f"{what}: {(said.strip().splitlines() or ['?'])[-1]}"


def check_variant(v: Variant, replay_keys: int) -> None:
    """Complete the replay keys, and check a replay and an in-flight duplicate once."""
    try:
        for i in range(replay_keys):
            status, _, body = fetch(v.port, "POST", serve.PATH, serve.BODY, f"replay-{i}")
            if status != 201:
                v.broken = f"first request answered {status}: {body[:200]!r}"
                return
        if v.name == "bare":
            return
        status, headers, body = fetch(v.port, "POST", serve.PATH, serve.BODY, "replay-0")
        if status != 201 or headers.get("idempotent-replayed") != "true":
            v.broken = f"no replay: {status} {headers} {body[:200]!r}"
            return
        status, _, body = fetch(v.port, "POST", serve.PATH, serve.BODY, serve.INFLIGHT_KEY)
        if status != 409:
            v.broken = f"in-flight duplicate answered {status}: {body[:200]!r}"
    except (OSError, http.client.HTTPException) as exc:
        v.broken = f"{type(exc).__name__}: {exc}"


# -- one measurement ------------------------------------------------------------------------


@dataclass
class Run:
    variant: str
    scenario: str
    rep: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    status_errors: int
    socket_errors: int
    handler_calls: int
    round_trips: float | None = None  # store round trips per request
    server_reads: float | None = None  # read events of the store server per request
    commands: float | None = None  # store commands per request, nested script calls included
    by_command: dict[str, float] = field(default_factory=dict)
    check: str = ""
    cpu_us: float = 0.0  # the server process's CPU time (user + system) per request
    gc_us: float = 0.0  # time in garbage collections per request
    gc_full: float = 0.0  # full (generation 2) collections per 1,000 requests
    rps_ratio: float | None = None  # to the bare runs just before and after this one
    p99_ratio: float | None = None
    cpu_ratio: float | None = None  # bare CPU per request / this one's: capacity vs bare


def nodes(redis: Any) -> list[Any]:
    """The servers of a variant's store: one, or every node of a cluster."""
    return list(getattr(redis, "servers", [redis]))


def redis_snapshot(redis: Any) -> tuple[int, dict[str, int]]:
    """(read events processed, calls per command) in one INFO call per server, summed."""
    reads, calls = 0, dict[str, int]()
    for server in nodes(redis):
        with server.sync_client() as client:
            info = client.execute_command("INFO", "stats", "commandstats")
        reads += int(info["total_reads_processed"])
        for k, v in info.items():
            if k.startswith("cmdstat_"):
                name = k.removeprefix("cmdstat_")
                calls[name] = calls.get(name, 0) + int(v["calls"])
    return reads, calls


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(args: argparse.Namespace, port: int, scenario: str, prefix: str, seconds: int) -> Any:
    cmd = ["taskset", "-c", "1", "wrk", f"-t{args.threads}", f"-c{args.connections}"]
    cmd += [f"-d{seconds}s", "--timeout", "10s", "-s", str(BENCH / "scenario.lua")]
    cmd += [f"http://127.0.0.1:{port}{serve.PATH}", "--", scenario, prefix]
    cmd.append(str(args.replay_keys))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    out = proc.stdout
    for line in out.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    raise RuntimeError(f"wrk printed no result:\n{out}")


def measure(v: Variant, args: argparse.Namespace, scenario: str, rep: int) -> Run:
    # New keys of their own per variant (its port: the same length for all), as variants
    # with SQL records share one database, where another's record would be replayed.
    prefix = {"new": f"new-r{rep}-{v.port}", "replay": "replay", "inflight": serve.INFLIGHT_KEY}
    assert v.proc is not None
    before_stats = v.stats()
    before = redis_snapshot(v.redis) if v.redis is not None else None
    cpu_before = cpu_seconds(v.proc.pid)
    result = wrk(args, v.port, scenario, prefix.get(scenario, "-"), args.duration)
    cpu_after = cpu_seconds(v.proc.pid)
    after = redis_snapshot(v.redis) if v.redis is not None else None
    after_stats = v.stats()
    n = max(result["requests"], 1)
    run = Run(
        v.name,
        scenario,
        rep,
        result["requests"] / (result["duration_us"] / 1e6),
        result["p50_us"] / 1000,
        result["p99_us"] / 1000,
        result["requests"],
        result["status_errors"],
        result["socket_errors"],
        after_stats["handler_calls"] - before_stats["handler_calls"],
        cpu_us=(cpu_after - cpu_before) * 1e6 / n,
        gc_us=(after_stats["gc_us"] - before_stats["gc_us"]) / n,
        gc_full=(after_stats["gc_full"] - before_stats["gc_full"]) * 1000 / n,
    )
    if before is not None and after is not None:
        # the second INFO is one read event and one `info` call of its own, per server
        run.server_reads = (after[0] - before[0] - len(nodes(v.redis))) / n
        run.round_trips = run.server_reads
        if "store_calls" in after_stats:  # a store that batches: count its calls
            run.round_trips = (after_stats["store_calls"] - before_stats["store_calls"]) / n
        delta = {c: after[1].get(c, 0) - before[1].get(c, 0) for c in after[1] if c != "info"}
        run.by_command = {c: d / n for c, d in sorted(delta.items()) if d}
        run.commands = sum(delta.values()) / n
    return run


def check(v: Variant, runs: list[Run], connections: int) -> str:
    """'ok', or how the runs differ from what their scenario means (over all of them)."""
    requests = sum(r.requests for r in runs) or 1
    status = sum(r.status_errors for r in runs)  # responses outside 2xx/3xx
    handler = sum(r.handler_calls for r in runs)
    problems = []
    if sockets := sum(r.socket_errors for r in runs):
        problems.append(f"{sockets} socket errors")
    expect_409 = runs[0].scenario == "inflight" and v.name != "bare"
    if expect_409 and status != requests:
        problems.append(f"{100 * (requests - status) / requests:.2g}% not 409")
    if not expect_409 and status:
        problems.append(f"{100 * status / requests:.2g}% not 2xx")
    if v.name == "bare" or runs[0].scenario in ("new", "nokey"):
        if not requests <= handler <= requests + connections * len(runs):
            problems.append(f"handler ran for {100 * handler / requests:.2g}% of requests")
    elif handler:
        problems.append(f"handler ran {handler}x")
    return "; ".join(problems) or "ok"


# -- the report -----------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values)


FIGURES = (  # Run fields, medians of which make a row of the table and of --results
    "rps", "p50_ms", "p99_ms", "rps_ratio", "p99_ratio", "cpu_us", "cpu_ratio", "gc_us",
    "gc_full", "round_trips", "server_reads", "commands",
)  # fmt: skip


def medians(v: Variant, runs: list[Run], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per scenario of `v`: the median of each figure over the repetitions (None when
    no run has it); each run's ratios are to the bare app's runs on either side of it."""
    rows = []
    for scenario in args.scenarios:
        mine = [r for r in runs if r.variant == v.name and r.scenario == scenario]
        if not mine:
            continue
        row: dict[str, Any] = {"variant": v.name, "label": v.label, "scenario": scenario}
        for name in FIGURES:
            values = [getattr(r, name) for r in mine if getattr(r, name) is not None]
            row[name] = med(values) if values else None
        if v.name == "bare":
            row.update(rps_ratio=1.0, p99_ratio=1.0, cpu_ratio=1.0)
        row["check"] = check(v, mine, args.connections * args.threads)
        rows.append(row)
    return rows


def cell(value: float | None, form: str) -> str:
    """`value` in `form`, or '-' when there is none."""
    return "-" if value is None else format(value, form)


def table(variants: list[Variant], runs: list[Run], args: argparse.Namespace) -> str:
    """One row per variant and scenario, of the medians over the repetitions."""
    lines = [
        "| variant | scenario | req/s | p50 ms | p99 ms | req/s / bare | p99 / bare "
        "| CPU us/req | capacity / bare | GC us/req | full GCs/1k req | round trips/req "
        "| server reads/req | store cmds/req | check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in variants:
        if v.broken:
            lines.append(
                f"| {v.label} | all | - | - | - | - | - | - | - | - | - | - | - | - "
                f"| does not work: {v.broken} |"
            )
            continue
        for m in medians(v, runs, args):
            row = [
                v.label,
                SCENARIO_TITLES[m["scenario"]],
                cell(m["rps"], ",.0f"),
                cell(m["p50_ms"], ".2f"),
                cell(m["p99_ms"], ".2f"),
                cell(m["rps_ratio"], ".2f") + "x",
                cell(m["p99_ratio"], ".2f") + "x",
                cell(m["cpu_us"], ".1f"),
                cell(m["cpu_ratio"], ".3f") + "x",
                cell(m["gc_us"], ".1f"),
                cell(m["gc_full"], ".1f"),
                cell(m["round_trips"], ".2f"),
                cell(m["server_reads"], ".2f"),
                cell(m["commands"], ".2f"),
                m["check"],
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def command_table(variants: list[Variant], runs: list[Run], args: argparse.Namespace) -> str:
    """Which store commands one request costs (medians), for the Redis variants."""
    lines = ["| variant | scenario | store commands per request |", "|---|---|---|"]
    for v in variants:
        if v.broken or v.redis is None:
            continue
        for scenario in args.scenarios:
            mine = [r for r in runs if r.variant == v.name and r.scenario == scenario]
            names = sorted({c for r in mine for c in r.by_command})
            parts = []
            for c in names:
                value = med([r.by_command.get(c, 0.0) for r in mine])
                if value >= 0.005:
                    parts.append(f"{c} {value:.2f}")
            summary = ", ".join(parts) or "none"
            lines.append(f"| {v.label} | {SCENARIO_TITLES[scenario]} | {summary} |")
    return "\n".join(lines)


def environment(args: argparse.Namespace, redis_version: str) -> str:
    from importlib.metadata import version

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split()[1]
    parser = "pure-Python parser" if args.no_hiredis else f"hiredis {version('hiredis')}"
    driver = f"{args.pg_driver} {version(args.pg_driver)}"
    sql, session = args.handler == "sql", args.handler == "session"
    return (
        f"{os.cpu_count()} x {cpu}, Linux {platform.release()}, Python {platform.python_version()}"
        f"\nuvicorn {version('uvicorn')} (uvloop {version('uvloop')}, httptools "
        f"{version('httptools')}), one worker, {args.app} {version(args.app)}; "
        f"redis-py {version('redis')} with {parser}; redis-server {redis_version}; "
        f"wrk {wrk_version}{'; gc.freeze() after startup' if args.gc_freeze else ''}"
        f"{'' if args.gc_threshold is None else f'; gc.set_threshold({args.gc_threshold}, ...)'}"
        f"{f'; response body {args.body_bytes} B' if args.body_bytes else ''}"
        f"{'; compression off' if args.compression == 'none' else ''}"
        f"{f'; {args.prefill_keys:,} completed keys in Redis' if args.prefill_keys else ''}"
        f"{'; handler: one INSERT into PostgreSQL (asyncpg)' if args.handler == 'pg' else ''}"
        f"{f'; handler: one INSERT into PostgreSQL (SQLAlchemy, {driver})' if sql else ''}"
        f"{f'; handler: one INSERT, session dependency ({driver})' if session else ''}"
        f"\nwrk -t{args.threads} -c{args.connections} -d{args.duration}s per run, "
        f"{args.reps} repetitions, scenarios then variants in turn, the bare app between "
        "each two (bare A bare B bare), medians"
    )


# -- what some runs need besides Redis ------------------------------------------------------


def prefill(redis: Any, keys: int) -> dict[str, float]:
    """Complete `keys` keys as the middleware would (a claim renewed to the result's TTL,
    and the result record), pipelined straight into Redis; used_memory before and after."""
    from goblin_idem._keys import key_names

    server = nodes(redis)[0]
    if len(nodes(redis)) > 1:
        raise SystemExit("--prefill-keys fills a single server, not a cluster")
    record = fetch_record(server)
    with server.sync_client() as client:
        before = float(client.info("memory")["used_memory"])
        started = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for i in range(keys):
            names = key_names(b"idem", b"", f"prefill-{i}".encode())
            pipe.set(names.claim, b"t-%d" % i, px=86_400_000)
            pipe.set(names.result, record, px=86_400_000)
            if i % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        seconds = time.monotonic() - started
        after = float(client.info("memory")["used_memory"])
    return {"keys": keys, "before": before, "after": after, "seconds": seconds}


def per_node(v: Variant) -> str:
    """How a cluster variant's whole run spread over its primaries: commands and CPU each."""
    figures = []
    for server in nodes(v.redis):
        with server.sync_client() as client:
            info = client.info()
        cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        figures.append(f"{int(info['total_commands_processed']):,} commands, {cpu:.1f} s CPU")
    return f"{v.name}, per primary over the whole run: " + "; ".join(figures)


def fetch_record(server: Any) -> bytes:
    """A result record as the middleware stores it: the first completed replay key's."""
    from goblin_idem._keys import key_names

    with server.sync_client() as client:
        record = client.get(key_names(b"idem", b"", b"replay-0").result)
    if record is None:
        raise SystemExit("no completed replay key to copy the record of")
    return bytes(record)


def start_postgres() -> Any:
    """A throwaway PostgreSQL (tests/support/postgres.py) whose commits are synced, as an
    application's are, its server pinned to the second core, with the handler's table."""
    from tests.support.postgres import start_postgres as start

    pg = start(durable=True)
    pin(pg.pid, 1)
    pg.psql(
        f"CREATE TABLE {serve.PG_TABLE} (id bigserial PRIMARY KEY, sku text NOT NULL, "
        "qty int NOT NULL, created timestamptz DEFAULT now())"
    )
    return pg


# -- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=int, default=3, help="seconds per wrk run (3)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (3)")
    p.add_argument("--connections", type=int, default=50, help="wrk connections (50)")
    p.add_argument("--threads", type=int, default=1, help="wrk threads (1: it has one core)")
    p.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per variant")
    p.add_argument("--replay-keys", type=int, default=200, help="completed keys to replay")
    p.add_argument("--variants", default=",".join(serve.VARIANTS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--app", choices=("starlette", "fastapi"), default="fastapi")
    p.add_argument("--no-hiredis", action="store_true", help="redis-py's pure-Python parser")
    p.add_argument("--gc-freeze", action="store_true", help="servers gc.freeze() after startup")
    p.add_argument(
        "--gc-threshold",
        type=int,
        help="servers set the collector's first threshold (default 700; 0: no collections)",
    )
    p.add_argument("--body-bytes", type=int, default=0, help="the handler answers N bytes")
    p.add_argument("--compression", choices=("zlib", "none"), default="zlib")
    p.add_argument(
        "--handler",
        choices=("json", "pg", "sql", "session"),
        default="json",
        help="pg: insert one row into a throwaway PostgreSQL per request (asyncpg); sql: the "
        "same through SQLAlchemy, which variant goblin-sql records in the same transaction; "
        "session: the same through FastAPI's session dependency (goblin-sql: Depends(session))",
    )
    p.add_argument(
        "--pg-driver",
        choices=("asyncpg", "psycopg"),
        default="asyncpg",
        help="the SQLAlchemy driver of --handler sql and session (the handler's engine and "
        "the records'); --handler pg is asyncpg's own",
    )
    p.add_argument(
        "--prefill-keys",
        type=int,
        default=0,
        help="complete this many keys in each Redis variant's store (and MemoryStore's) "
        "before the runs",
    )
    p.add_argument("--cluster-primaries", type=int, default=3, help="for goblin-cluster-*")
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of the project (a git worktree of an older commit): a variant "
        f"named NAME{BASELINE} is NAME served by that checkout's bench/serve.py and package, "
        "in the same run as this one's",
    )
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    p.add_argument(
        "--results",
        type=Path,
        help="also write the table's medians here, for bench/charts.py "
        "(bench/results/http.json is the committed run's)",
    )
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.variants = ["bare", *(v for v in args.variants if v != "bare")]
    for name in args.variants:
        if name.removesuffix(BASELINE) not in serve.ALL_VARIANTS or name == "bare" + BASELINE:
            p.error(f"unknown variant {name!r}")
        if name.endswith(BASELINE) and args.baseline is None:
            p.error(f"{name} needs --baseline DIR (the checkout that serves it)")
    if args.baseline is not None:
        if not (args.baseline / "bench" / "serve.py").is_file():
            p.error(f"--baseline {args.baseline}: no bench/serve.py there (name a checkout)")
        if (args.body_bytes, args.compression, args.prefill_keys) != (0, "zlib", 0):
            p.error(
                "--baseline measures the default body only: drop --body-bytes, "
                "--compression and --prefill-keys"
            )
    if args.handler == "pg" and args.pg_driver != "asyncpg":
        p.error("--handler pg is asyncpg's own: --pg-driver names the SQLAlchemy driver")
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}")
    return args


def labels(primaries: int = 3) -> dict[str, str]:
    from importlib.metadata import version

    return {
        "bare": "bare app",
        "goblin-memory": "goblin-idem, MemoryStore",
        "goblin-script": "goblin-idem, Redis script mode",
        "goblin-native": "goblin-idem, Redis native mode",
        "goblin-native-direct": "goblin-idem, Redis native, autopipeline=False",
        "goblin-native-cache": "goblin-idem, Redis native, replay cache (4 MiB)",
        "goblin-native-nocache": "goblin-idem, Redis native, replay cache off",
        "goblin-sql": "goblin-idem, Redis native mode, SQL records (records=)",
        "goblin-cluster-native": f"goblin-idem, Redis Cluster ({primaries} primaries), native mode",
        "goblin-cluster-script": f"goblin-idem, Redis Cluster ({primaries} primaries), script mode",
        "goblin-cluster-direct": f"goblin-idem, Redis Cluster ({primaries} primaries), native, "
        "autopipeline=False",
        "goblin-cluster-native-cache": f"goblin-idem, Redis Cluster ({primaries} primaries), "
        "native, replay cache (4 MiB per primary)",
        "asgi-idempotency-header": f"asgi-idempotency-header {version('asgi-idempotency-header')}"
        " (Redis)",
        "fastapi-idempotency": f"fastapi-idempotency {version('fastapi-idempotency')}"
        " (its MemoryStore)",
    }


def baseline_name(tree: Path) -> str:
    """The baseline checkout's commit and date, for its variants' labels."""
    out = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %cs"], capture_output=True, text=True
    ).stdout.strip()
    return f"baseline {out or tree.name}"


def main() -> None:
    args = parse_args()
    for tool in ("wrk", "taskset", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (Debian: apt-get install -y wrk redis-server)")
    from goblin_idem.native import build_module
    from tests.support.procs import stop
    from tests.support.servers import free_port, start_cluster, start_server

    names = labels(args.cluster_primaries)
    variants = [Variant(n, names[n.removesuffix(BASELINE)]) for n in args.variants]
    for v in variants:
        if v.name.endswith(BASELINE):
            v.tree = args.baseline.resolve()
            v.label += f" [{baseline_name(v.tree)}]"
    per_run = (2 * len(variants) - 1) * len(args.scenarios) * args.reps
    estimate = per_run * (args.duration + 0.5) + len(variants) * (args.warmup + 3)
    print(f"{per_run} wrk runs of {args.duration:g} s, about {estimate / 60:.0f} min", flush=True)
    started = time.monotonic()
    servers = []
    pg: Any = None
    spread: list[str] = []  # a cluster variant's commands and CPU per primary
    runs: list[Run] = []
    redis_version = "-"
    try:
        if args.handler in ("pg", "sql", "session"):
            pg = start_postgres()
            args.pg_dsn = pg.url(driver=args.pg_driver)
        kinds = {v.kind for v in variants}
        module = build_module() if serve.NATIVE_VARIANTS & kinds else None
        for v in variants:
            if v.kind in serve.REDIS_VARIANTS:
                mods = [str(module)] if v.kind in serve.NATIVE_VARIANTS and module else []
                if v.kind in serve.CLUSTER_VARIANTS:  # no replicas
                    masters = args.cluster_primaries
                    v.redis = start_cluster("redis", masters=masters, modules=mods)
                else:
                    v.redis = start_server("redis", modules=mods)
                servers.append(v.redis)
                for server in nodes(v.redis):
                    pin(server.pid, 1)
                with nodes(v.redis)[0].sync_client() as c:
                    redis_version = c.info("server")["redis_version"]
            start_app(v, args, free_port)
            if not v.broken:
                check_variant(v, args.replay_keys)
            if not v.broken and args.prefill_keys and v.redis is not None:
                v.prefill = prefill(v.redis, args.prefill_keys)
            if not v.broken and args.warmup > 0:
                wrk(args, v.port, "new", "warm", args.warmup)
            print(f"  {v.label}: {v.broken or 'ready'}", flush=True)

        def one_run(v: Variant, scenario: str, rep: int) -> Run:
            run = measure(v, args, scenario, rep)
            run.check = check(v, [run], args.connections * args.threads)
            runs.append(run)
            print(
                f"  rep {rep} {scenario:8} {v.name:24} {run.rps:8,.0f} req/s "
                f"p99 {run.p99_ms:6.2f} ms  {run.check}",
                flush=True,
            )
            return run

        bare = variants[0]  # parse_args puts it first
        if bare.broken:
            raise SystemExit(f"the bare app does not work: {bare.broken}")
        for rep in range(1, args.reps + 1):
            for scenario in args.scenarios:
                before = one_run(bare, scenario, rep)
                for v in variants[1:]:
                    if v.broken:
                        continue
                    run = one_run(v, scenario, rep)
                    after = one_run(bare, scenario, rep)
                    run.rps_ratio = run.rps / ((before.rps + after.rps) / 2)
                    run.p99_ratio = run.p99_ms / ((before.p99_ms + after.p99_ms) / 2)
                    run.cpu_ratio = (before.cpu_us + after.cpu_us) / 2 / run.cpu_us
                    before = after
        spread = [per_node(v) for v in variants if len(nodes(v.redis)) > 1]
    finally:
        for v in variants:
            if v.proc is not None:
                stop(v.proc)
        for s in servers:
            s.stop()
        if pg is not None:
            pg.remove()
    elapsed = time.monotonic() - started
    print()
    print("```")
    print(environment(args, redis_version))
    print(f"total run time {elapsed / 60:.1f} min")
    print("```")
    print()
    print(table(variants, runs, args))
    for v in variants:
        if v.prefill:
            f = v.prefill
            print(
                f"\n{v.name}: {f['keys']:,.0f} completed keys (2 Redis keys each) filled in "
                f"{f['seconds']:.0f} s; used_memory {f['before'] / 2**20:,.0f} -> "
                f"{f['after'] / 2**20:,.0f} MiB, {(f['after'] - f['before']) / f['keys']:,.0f} "
                "bytes per completed key"
            )
    for line in spread:
        print(f"\n{line}")
    print()
    print(command_table(variants, runs, args))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    if args.results:
        rows = [m for v in variants if not v.broken for m in medians(v, runs, args)]
        results = {
            "command": "python3 bench/http_bench.py",
            "environment": environment(args, redis_version).splitlines(),
            "total_minutes": round(elapsed / 60, 1),
            "rows": rows,
        }
        args.results.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    ensure_env()
    exit_on_sigterm()
    sys.path.append(str(ROOT))  # after PYTHONPATH, which may name another copy
    main()
