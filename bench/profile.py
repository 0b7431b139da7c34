"""Where a request's time goes: py-spy samples one variant's server while wrk drives it.

    python3 bench/profile.py goblin-native new [--seconds 10] [--out stacks.txt] [--native]

Same servers, pinning and scenarios as http_bench.py. py-spy (in bench/.venv) records the
uvicorn process; the summary lists the functions with the most samples, inclusive and
self, and the share of samples inside goblin_idem and redis-py. `--out` keeps the
collapsed stacks (speedscope.app or flamegraph.pl read them).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

import http_bench
import serve


def frame_name(frame: str) -> str:
    """'func (redis/asyncio/client.py:12)' -> 'redis/asyncio/client.py:func'."""
    func, _, where = frame.partition(" (")
    parts = Path(where.rstrip(")").rsplit(":", 1)[0]).parts
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1 :]
    elif "goblin_idem" in parts:
        parts = parts[parts.index("goblin_idem") :]
    elif parts and parts[0] == "/":
        parts = parts[-1:]
    return f"{'/'.join(parts)}:{func}"


def summarize(stacks: Path, top: int) -> str:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    collecting = 0  # samples inside the garbage collector (seen with --native only)
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";") if f.strip()]
        total += n
        for name in set(frames):
            inclusive[name] += n
        if "gc_collect_main" in stack:
            collecting += n
            own["(garbage collector)"] += n
            continue
        python = [f for f in frames if ".py:" in f]  # with --native, C frames are left out
        if python:
            own[python[-1]] += n
    if not total:
        return "no samples"

    def share(prefix: str) -> float:
        return 100 * sum(n for name, n in own.items() if name.startswith(prefix)) / total

    out = [
        f"{total} samples; self time in goblin_idem {share('goblin_idem/'):.1f}%, "
        f"redis-py {share('redis/'):.1f}%, hiredis {share('hiredis'):.1f}%, "
        f"starlette {share('starlette/'):.1f}%, fastapi {share('fastapi/'):.1f}%, "
        f"uvicorn {share('uvicorn/'):.1f}%, asyncio {share('asyncio/'):.1f}%; "
        f"inside the garbage collector {100 * collecting / total:.1f}%",
        "",
        "inclusive %  function",
    ]
    for name, n in inclusive.most_common(top):
        out.append(f"{100 * n / total:10.1f}  {name}")
    out += ["", "self %      function"]
    for name, n in own.most_common(top):
        out.append(f"{100 * n / total:10.1f}  {name}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=serve.VARIANTS)
    p.add_argument("scenario", choices=http_bench.SCENARIOS)
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--app", choices=("starlette", "fastapi"), default="fastapi")
    p.add_argument("--no-hiredis", action="store_true")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after startup")
    p.add_argument("--out", type=Path, help="keep the collapsed stacks here")
    p.add_argument(
        "--native",
        action="store_true",
        help="C frames too: the garbage collector's time shows as its own (gc_collect_main)",
    )
    args = p.parse_args()
    # what http_bench's helpers read from their own arguments
    args.threads, args.connections, args.replay_keys = 1, 50, 200

    from goblin_idem.native import build_module
    from tests.support.procs import stop
    from tests.support.servers import free_port, start_server

    v = http_bench.Variant(args.variant, args.variant)
    out = args.out or Path(tempfile.mkdtemp(prefix="goblin-profile-")) / "stacks.txt"
    try:
        if v.name in serve.REDIS_VARIANTS:
            modules = [str(build_module())] if v.name in serve.NATIVE_VARIANTS else []
            v.redis = start_server("redis", modules=modules)
            http_bench.pin(v.redis.pid, 1)
        http_bench.start_app(v, args, free_port)
        if not v.broken:
            http_bench.check_variant(v, args.replay_keys)
        if v.broken:
            raise SystemExit(f"{v.name}: {v.broken}")
        http_bench.wrk(args, v.port, "new", "warm", 2)
        assert v.proc is not None
        spy = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--pid",
                str(v.proc.pid),
                "--rate",
                str(args.rate),
                "--duration",
                str(args.seconds),
                "--format",
                "raw",
                # native unwinding needs the process stopped while it is sampled
                *(["--native"] if args.native else ["--nonblocking"]),
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            result = http_bench.wrk(args, v.port, args.scenario, "prof", args.seconds)
        finally:
            spy.wait(timeout=args.seconds + 30)
    finally:
        if v.proc is not None:
            stop(v.proc)
        if v.redis is not None:
            v.redis.stop()
    rps = result["requests"] / (result["duration_us"] / 1e6)
    print(f"{args.variant} / {args.scenario}: {rps:,.0f} req/s while sampled; stacks in {out}")
    print(summarize(out, args.top))


if __name__ == "__main__":
    http_bench.ensure_env()
    http_bench.exit_on_sigterm()
    sys.path.append(str(http_bench.ROOT))  # after PYTHONPATH, which may name another copy
    main()
