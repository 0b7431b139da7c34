"""Where a first run's or a replay's cost goes, in instructions (callgrind) and in time.

    python3 bench/instructions.py          # --requests 400,1600 --concurrency 32
    python3 bench/instructions.py --scenario replay --variants bare,goblin-native-cache

Drives the benchmark's FastAPI app (bench/serve.py, `POST /orders`) straight through ASGI,
with no server and no HTTP parsing: every request a new key, `--concurrency` of them in
flight at once (asyncio.gather), on one event loop (uvloop). Each variant runs twice in a
process of its own under `valgrind --tool=callgrind`, with the two request counts of
`--requests`; the difference of the two totals, over the difference of the counts, is the
instructions one request costs, start-up and warm-up cancelled. `--scenario replay` sends
duplicates instead: `REPLAY_KEYS` keys are completed first, then every request repeats one
of them in turn (goblin-native-cache: answered from its replay cache, filled during the
warm-up; the bare app runs its handler each time). The collector's share is
the inclusive count of CPython's `gc_collect_main`, taken the same way. The store's share
is a loop of the same two calls a first run makes (`claim_unless_done`, then `publish`) on
fresh keys, at the same concurrency, with no app around them (for a replay: the one
`claim_unless_done` of a completed key). As in http_bench.py,
`PYTHONPATH=<other checkout>` measures another version of goblin-idem, and `--baseline DIR`
measures another checkout (its own bench/serve.py and package) beside this one, as
variants named `NAME@baseline` (`--variants goblin-native,goblin-native@baseline`).
`--scenario nokey` sends requests without a key (the app alone: no store call). The
time columns are the same workloads run natively (no valgrind): the measured requests' time
(after the warm-up) over their number, median of `--reps` runs of the larger count.

Instructions are counted for this process only: a Redis store's server (a throwaway
redis-server on a free loopback port, with the goblin module for native mode) and the
kernel's socket work are not in them, and show in the time column only.

It runs in bench/.venv (made by http_bench.py), with valgrind on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VARIANTS = ("bare", "goblin-memory", "goblin-script", "goblin-native")
SCENARIOS = ("new", "replay", "nokey")
REPLAY_KEYS = 64  # completed keys a replay run repeats, in turn
BASELINE = "@baseline"  # a variant served by --baseline's checkout
RESULT = b'{"status":201,"body":"{\\"id\\":1,\\"status\\":\\"created\\"}"}'


# -- the workload, run in a child process ----------------------------------------------------


def make_app(variant: str, url: str) -> Any:
    import serve

    middleware, _ = serve.middleware_for(variant, url, no_hiredis=False)
    return serve.fastapi_app(middleware, serve.middleware_for("bare", "", False)[1])


async def one_request(app: Any, key: bytes | None) -> None:
    from overhead import receive, scope  # wrk's request, as uvicorn hands it to the app

    status = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope(key), receive, send)
    if status != [201]:
        raise SystemExit(f"unexpected response {status}")


def store_of(app: Any) -> Any:
    """The goblin store behind the app's middleware (built on the first request)."""
    from goblin_idem import IdempotencyMiddleware

    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, IdempotencyMiddleware):
        layer = getattr(layer, "app", None)
    if layer is None:
        raise SystemExit("no goblin middleware in the app")
    return layer.store


async def workload(
    variant: str, scenario: str, part: str, url: str, n: int, concurrency: int
) -> float:
    app = make_app(variant, url)
    run = f"{os.getpid()}-{time.monotonic_ns()}"
    store: Any = None
    replay = scenario == "replay"
    if replay:  # the keys every request repeats, completed through the app
        await asyncio.gather(
            *(one_request(app, b"%s-r%d" % (run.encode(), i)) for i in range(REPLAY_KEYS))
        )
    if part == "store":
        await one_request(app, f"{run}-first".encode())  # builds the middleware stack
        store = store_of(app)
        import_used()
    calls = replay_calls if replay else first_run_calls

    async def batch(start: int, count: int) -> None:
        keys: list[Any]
        if replay:
            keys = [f"{run}-r{i % REPLAY_KEYS}".encode() for i in range(start, start + count)]
        elif scenario == "nokey":
            keys = [None] * count
        else:
            keys = [f"{run}-{i}".encode() for i in range(start, start + count)]
        if part == "app":
            await asyncio.gather(*(one_request(app, k) for k in keys))
        elif replay:  # a call answered from memory never waits: no task each, which the
            for k in keys:  # app's requests carry in both columns, counted here as the store's
                await calls(store, k)
        else:
            await asyncio.gather(*(calls(store, k) for k in keys))

    warm = 4 * concurrency
    for start in range(0, warm, concurrency):
        await batch(-warm + start, concurrency)
    started = time.perf_counter()
    for start in range(0, n, concurrency):
        await batch(start, min(concurrency, n - start))
    return time.perf_counter() - started


# goblin_idem's names the store loops use, imported once in the child (from the tree it
# measures), not per call: the store's column would count the imports
USED: dict[str, Any] = {}


def import_used() -> None:
    from goblin_idem.store import CLAIMED

    try:
        from goblin_idem._keys import key_names
    except ImportError:  # a baseline from before the package's layers (goblin_idem.keys)
        from goblin_idem.keys import key_names  # type: ignore[no-redef]
    USED.update(CLAIMED=CLAIMED, key_names=key_names)


async def first_run_calls(store: Any, key: bytes) -> None:
    names = USED["key_names"](b"idem", b"", key)
    token = b"t-" + key
    if await store.claim_unless_done(names.claim, names.result, token, 30) is not USED["CLAIMED"]:
        raise SystemExit("a fresh key was not claimed")
    await store.publish(names.result, RESULT, 86_400_000, names.claim, token)


async def replay_calls(store: Any, key: bytes) -> None:
    names = USED["key_names"](b"idem", b"", key)
    reply = await store.claim_unless_done(names.claim, names.result, b"t-" + key, 30)
    if type(reply) is not bytes:
        raise SystemExit(f"a completed key answered {reply!r}")


def child(args: argparse.Namespace) -> None:
    import uvloop

    tree = Path(args.tree)
    sys.path.insert(0, str(tree / "bench"))
    if tree == ROOT:
        sys.path.append(str(ROOT))  # after PYTHONPATH, which may name another copy
    else:
        sys.path.insert(0, str(tree))  # a baseline: its own package, before PYTHONPATH's
    if args.scenario == "replay":
        # valgrind runs the process some 50 times slower: the second a replay cache serves
        # after its connection last heard from the server, and the quarter of a second
        # after which a reply is late, would run out between the few replays that reach
        # the server, and most replays would read the store
        from goblin_idem.store import _autopipeline

        _autopipeline.HEARD_SECONDS = _autopipeline.STALL_SECONDS = 3600.0
    elapsed = uvloop.run(
        workload(args.variant, args.scenario, args.part, args.url, args.n, args.concurrency)
    )
    import serve

    calls = serve.STATS.get("store_calls", 0)
    print(f"elapsed {elapsed:.6f} gc {gc.get_count()} store_calls {calls}", flush=True)


# -- the driver ------------------------------------------------------------------------------


def child_args(variant: str, part: str, url: str, n: int, concurrency: int) -> list[str]:
    """The command line of one child process; a NAME@baseline runs in --baseline's tree."""
    tree = BASELINE_TREE[0] if variant.endswith(BASELINE) else ROOT
    kind = variant.removesuffix(BASELINE)
    script = str(Path(__file__).resolve())
    return [
        *(sys.executable, script, "--child", kind, SCENARIO[0], part, url),
        *(str(n), str(concurrency), str(tree)),
    ]


BASELINE_TREE: list[Path] = [ROOT]  # --baseline's checkout
SCENARIO: list[str] = ["new"]  # --scenario


def callgrind(variant: str, part: str, url: str, n: int, concurrency: int) -> tuple[int, int]:
    """Total instructions of one child process, and those inside the garbage collector."""
    with tempfile.TemporaryDirectory(prefix="goblin-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            *child_args(variant, part, url, n, concurrency),
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        annotate = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    total = gc_ir = 0
    for line in annotate.splitlines():
        count = line.strip().split(" ", 1)[0].replace(",", "")
        if "PROGRAM TOTALS" in line:
            total = int(count)
        elif ":gc_collect_main [" in line:
            gc_ir = int(count)
    return total, gc_ir


def timed(variant: str, part: str, url: str, n: int, concurrency: int) -> float:
    cmd = child_args(variant, part, url, n, concurrency)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(re.search(r"elapsed ([\d.]+)", out).group(1))  # type: ignore[union-attr]


def measure(
    variant: str, part: str, url: str, concurrency: int, low: int, high: int, reps: int
) -> dict[str, float]:
    """Instructions (total, in the collector) and microseconds of one request or store loop."""
    with ThreadPoolExecutor(2) as pool:  # one valgrind per core
        (t1, g1), (t2, g2) = pool.map(
            lambda n: callgrind(variant, part, url, n, concurrency), (low, high)
        )
    times = [timed(variant, part, url, high, concurrency) for _ in range(reps)]
    return {
        f"{part}_ir": (t2 - t1) / (high - low),
        f"{part}_gc_ir": (g2 - g1) / (high - low),
        f"{part}_us": statistics.median(times) * 1e6 / high,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = argparse.Namespace(
            variant=sys.argv[2],
            scenario=sys.argv[3],
            part=sys.argv[4],
            url=sys.argv[5],
            n=int(sys.argv[6]),
            concurrency=int(sys.argv[7]),
            tree=sys.argv[8],
        )
        child(a)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="400,1600", help="the two request counts (400,1600)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (32)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per figure (3)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="new",
        help="new keys, replays, or requests without a key (new)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of the project: variants named NAME@baseline run its "
        "bench/serve.py and package",
    )
    args = p.parse_args()
    if args.baseline is not None:
        if not (args.baseline / "bench" / "serve.py").is_file():
            p.error(f"--baseline {args.baseline}: no bench/serve.py there (name a checkout)")
        BASELINE_TREE[0] = args.baseline.resolve()
    SCENARIO[0] = args.scenario
    low, high = (int(x) for x in args.requests.split(","))
    variants = [v for v in args.variants.split(",") if v]
    sys.path.insert(0, str(ROOT))
    from goblin_idem.native import build_module
    from tests.support.servers import start_server

    servers: dict[str, Any] = {}
    rows = []
    started = time.monotonic()
    try:
        for v in variants:  # a server of its own for each Redis variant
            if v.removesuffix(BASELINE) == "goblin-script":
                servers[v] = start_server("redis")
            elif v.removesuffix(BASELINE) in (
                "goblin-native",
                "goblin-native-cache",
                "goblin-native-nocache",
            ):
                servers[v] = start_server("redis", modules=[str(build_module())])
        for v in variants:
            if v.endswith(BASELINE) and args.baseline is None:
                raise SystemExit(f"{v} needs --baseline DIR (the checkout that serves it)")
            url = servers[v].url if v in servers else "-"
            alone = v in ("bare", "answer-only") or args.scenario == "nokey"
            parts = ["app"] if alone else ["app", "store"]
            figures: dict[str, float] = {}
            for part in parts:
                figures.update(measure(v, part, url, args.concurrency, low, high, args.reps))
            rows.append((v, figures))
            print(f"  {v}: {figures}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print_table(rows, args, low, high, time.monotonic() - started)


def print_table(
    rows: list[tuple[str, dict[str, float]]],
    args: argparse.Namespace,
    low: int,
    high: int,
    elapsed: float,
) -> None:
    figures = dict(rows)
    bare = figures.get("bare", {"app_ir": float("nan"), "app_gc_ir": 0.0, "app_us": float("nan")})
    fastapi = bare["app_ir"] - bare["app_gc_ir"]
    print()
    print("```")
    print(
        f"Python {sys.version.split()[0]}, valgrind --tool=callgrind; {args.scenario} "
        f"scenario, {high - low} requests "
        f"(the difference of runs of {low} and {high}), {args.concurrency} in flight; "
        f"time: the {high} requests after the warm-up, median of {args.reps}, without valgrind"
    )
    print(f"total run time {elapsed / 60:.1f} min")
    print("```")
    print()
    calls, outer = "2 calls", "FastAPI app"
    if args.scenario == "replay":  # no handler runs: the app's outer layers, as answer-only
        calls, outer = "1 call", "outer layers (answer-only)"
        floor = figures.get("answer-only", {"app_ir": float("nan"), "app_gc_ir": 0.0})
        fastapi = floor["app_ir"] - floor["app_gc_ir"]
    elif args.scenario == "nokey":
        calls = "no call"
    print(
        f"| variant | instructions/req | / bare | {outer} | middleware's own work "
        f"| store: {calls} | collector | us/req | / bare | store us ({calls}) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v, f in rows:
        total, collector = f["app_ir"], f["app_gc_ir"]
        store = f.get("store_ir", 0.0) - f.get("store_gc_ir", 0.0)
        own = total - fastapi - store - collector if v not in ("bare", "answer-only") else 0.0
        store_us = f"{f['store_us']:.1f}" if "store_us" in f else "-"
        print(
            f"| {v} | {total:,.0f} | {total / bare['app_ir']:.2f}x | {fastapi:,.0f} "
            f"| {own:,.0f} | {store:,.0f} | {collector:,.0f} ({collector / total:.0%}) "
            f"| {f['app_us']:.1f} | {f['app_us'] / bare['app_us']:.2f}x | {store_us} |"
        )


if __name__ == "__main__":
    main()
