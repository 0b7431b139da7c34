"""Where a WSGI request's cost goes, in instructions: the WSGI benchmark's apps in process.

    python3 bench/wsgi_instructions.py     # --variants django-bare,django-answer,django-goblin,...

Drives wsgi_serve.py's app (`POST /orders`, the environ gunicorn makes for wrk's request)
straight through WSGI, one request at a time, with no server and no HTTP parsing, under
`valgrind --tool=callgrind --separate-threads=yes`, twice per variant with two request
counts (`--requests`): the difference of the two totals over the difference of the counts
is what one request costs, start-up and warm-up cancelled, for the request's thread and
for the others (goblin-idem's loop thread) apart. One throwaway redis-server serves every
variant (its own work and the kernel's are not counted). `--scenario replay` (the default)
repeats one completed key, `new` sends a fresh key each time, `nokey` none.

`django-answer` is Django with a middleware that answers every keyed request with a
response it makes (no store, no view): Django's own cost for a request and its response,
which no replay inside MIDDLEWARE can go below. `--baseline DIR` runs the variants named
`NAME@baseline` with another checkout's wsgi_serve.py and package. It runs in bench/.venv,
as wsgi_bench.py does, with valgrind on PATH.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BODY = b'{"sku":"A-1","qty":2}'
BASELINE = "@baseline"  # a variant served by --baseline's checkout
VARIANTS = ("django-bare", "django-answer", "django-goblin", "django-goblin-cache")
VARIANTS += ("flask-bare", "flask-goblin", "flask-goblin-cache")


def environ(key: str | None) -> dict[str, Any]:
    """What gunicorn hands the app for wrk's request (scenario.lua)."""
    env: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": "/orders",
        "QUERY_STRING": "",
        "RAW_URI": "/orders",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "REMOTE_ADDR": "127.0.0.1",
        "REMOTE_PORT": "50000",
        "SERVER_SOFTWARE": "gunicorn/27.0.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(BODY),
        "wsgi.errors": sys.stderr,
        "wsgi.version": (1, 0),
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(BODY)),
        "HTTP_HOST": "127.0.0.1:8000",
        "HTTP_CONTENT_TYPE": "application/json",
    }
    if key is not None:
        env["HTTP_IDEMPOTENCY_KEY"] = key
    return env


def child(variant: str, scenario: str, url: str, n: int, tree: Path) -> None:
    os.environ["WSGI_VARIANT"], os.environ["REDIS_URL"] = variant, url
    sys.path[:0] = [str(tree / "bench"), str(tree)]
    import wsgi_serve

    app = wsgi_serve.app
    statuses: set[str] = set()

    def start_response(status: str, headers: Any, exc_info: Any = None) -> None:
        statuses.add(status)

    def one(key: str | None) -> None:
        body = app(environ(key), start_response)
        b"".join(body)
        getattr(body, "close", lambda: None)()

    run = f"{os.getpid()}-{time.monotonic_ns()}"
    keys = {"replay": lambda i: "replay-0", "new": lambda i: f"{run}-{i}", "nokey": None}
    key = keys[scenario]
    one("replay-0")  # completed before the runs: here, or by the other count's child
    while "409 Conflict" in statuses:  # which is running it: replayed once it is done
        time.sleep(0.05)
        statuses.clear()
        one("replay-0")
    for i in range(200):  # warm-up
        one(key(-i - 1) if key else None)
    for i in range(n):
        one(key(i) if key else None)
    if {status[:4] for status in statuses} != {"201 "}:
        raise SystemExit(f"unexpected statuses {statuses}")


def callgrind(
    variant: str, scenario: str, url: str, n: int, baseline: Path | None
) -> tuple[int, int]:
    """Instructions of one child process: (its main thread's, every other thread's). A
    NAME@baseline runs NAME with the baseline checkout's wsgi_serve.py and package."""
    tree = ROOT
    if variant.endswith(BASELINE):
        if baseline is None:
            raise SystemExit(f"{variant} needs --baseline DIR (the checkout serving it)")
        variant, tree = variant.removesuffix(BASELINE), baseline.resolve()
    with tempfile.TemporaryDirectory(prefix="goblin-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes"]
        cmd += [f"--callgrind-out-file={out}", sys.executable, str(Path(__file__).resolve())]
        cmd += ["--child", variant, scenario, url, str(n), str(tree)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{variant} ({tree}) failed:\n{done.stderr[-2000:]}")
        totals = {}
        for part in sorted(Path(tmp).glob("callgrind.out-*")):
            annotate = subprocess.run(
                ["callgrind_annotate", str(part)], check=True, capture_output=True, text=True
            ).stdout
            for line in annotate.splitlines():
                if "PROGRAM TOTALS" in line:
                    totals[part.name] = int(line.split()[0].replace(",", ""))
    main = totals.pop("callgrind.out-01")
    return main, sum(totals.values())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), Path(sys.argv[6]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="500,2000", help="the two request counts (500,2000)")
    p.add_argument("--scenario", choices=("replay", "new", "nokey"), default="replay")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout: a variant named NAME@baseline runs its wsgi_serve.py and package",
    )
    args = p.parse_args()
    low, high = (int(x) for x in args.requests.split(","))
    sys.path.insert(0, str(ROOT))
    from tests.support.servers import start_server

    started = time.monotonic()
    redis = start_server("redis")
    rows = []
    try:
        for variant in [v for v in args.variants.split(",") if v]:
            with ThreadPoolExecutor(2) as pool:  # one valgrind per core
                given = (variant, args.scenario, redis.url)
                counts = [(*given, n, args.baseline) for n in (low, high)]
                (m1, o1), (m2, o2) = pool.map(lambda a: callgrind(*a), counts)
            rows.append((variant, (m2 - m1) / (high - low), (o2 - o1) / (high - low)))
            print(f"  {variant}: {rows[-1][1:]}", flush=True)
    finally:
        redis.stop()
    print("\n```")
    print(
        f"Python {sys.version.split()[0]}, valgrind --tool=callgrind; scenario "
        f"{args.scenario}; {high - low} requests (the difference of runs of {low} and "
        f"{high}), one at a time; total run time {(time.monotonic() - started) / 60:.1f} min"
    )
    print("```\n")
    print("| variant | instructions/req | request's thread | loop thread |")
    print("|---|---:|---:|---:|")
    for variant, mine, others in rows:
        print(f"| {variant} | {mine + others:,.0f} | {mine:,.0f} | {others:,.0f} |")


if __name__ == "__main__":
    main()
